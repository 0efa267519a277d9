"""Exponent-coded words decode to exactly the words packed, by the Triton kernel and by the torch reference.

Runs the Triton kernel on CPU tensors under ``TRITON_INTERPRET=1`` (the CI setting); the ``gpu`` test repeats it on
the device inside a CUDA graph. Guards: every 16-bit pattern class (zeros, subnormals, inf/nan, both signs, values
outside the exponent window, which must escape), escape ranks across chunk boundaries (the kernel's prefix sum from
``offsets`` against the reference's global order), word counts that end inside a byte of the code planes and inside
a chunk, an empty escape stream and an all-escape one, and the validation errors.
"""
import os

import pytest
import torch

from leandiffusion.kernels import bf16_unpack
from leandiffusion.kernels.bf16_unpack import CHUNK, unpack_reference, unpack_triton, unpack_words
from leandiffusion.memory.packed_weights import pack_words

interpret = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or bf16_unpack.triton is None,
                               reason="runs the Triton kernel on the CPU only under TRITON_INTERPRET=1")
UNLIMITED = 1 << 40


def _weights(n: int, seed: int = 0) -> torch.Tensor:
    """bf16 weights around one scale with every special pattern planted: the words a packed unit holds."""
    g = torch.Generator().manual_seed(seed)
    words = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16).view(torch.int16).clone()
    specials = [0, -32768, 0x0001, -32767, 0x7F80, -128, 0x7FC0, -1, 0x3F80, 0x4780, 0x0080]
    idx = torch.randperm(n, generator=g)[: min(n, 4 * len(specials))]
    for i, j in enumerate(idx.tolist()):
        words[j] = specials[i % len(specials)]
    return words


def _decode(packed, impl: str) -> torch.Tensor:
    out = torch.full((packed.words,), 0x5555, dtype=torch.int16)
    fn = unpack_triton if impl == "triton" else unpack_reference
    fn(*packed.views(packed.host.tensor), packed.base, out)
    return out


@pytest.mark.parametrize("n", [1, 7, 256, 1000, CHUNK, CHUNK + 3, 5 * CHUNK + 517])
def test_the_reference_gives_back_every_word(n):
    words = _weights(n, seed=n)
    packed = pack_words(words, limit_bytes=UNLIMITED)
    assert torch.equal(_decode(packed, "reference"), words)


@interpret
@pytest.mark.parametrize("n", [1, 7, 1000, CHUNK + 3, 5 * CHUNK + 517])
def test_the_kernel_gives_back_every_word(n):
    words = _weights(n, seed=n)
    packed = pack_words(words, limit_bytes=UNLIMITED)
    assert packed.escapes > 0  # planted out-of-window words: escape ranks across chunks are exercised
    assert torch.equal(_decode(packed, "triton"), words)


@interpret
def test_no_escapes_and_all_escapes():
    inside = torch.full((3000,), 0x3F80, dtype=torch.int16)  # 1.0 everywhere: one exponent, in the window
    packed = pack_words(inside, limit_bytes=UNLIMITED)
    assert packed.escapes == 0
    zeros = torch.zeros(3000, dtype=torch.int16)  # exponent field 0 always escapes
    packed_zeros = pack_words(zeros, limit_bytes=UNLIMITED)
    assert packed_zeros.escapes == 3000
    for p, words in ((packed, inside), (packed_zeros, zeros)):
        for impl in ("reference", "triton"):
            assert torch.equal(_decode(p, impl), words), impl


def test_weights_around_one_scale_pack_to_about_70_percent_and_over_the_limit_stay_plain():
    words = (torch.randn(1 << 18, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    words = words.view(torch.int16)
    packed = pack_words(words)
    assert 0.68 < packed.nbytes / (2 * words.numel()) < 0.72
    # random 16-bit patterns (an fp8 or fp16 unit read as words) do not pack under the slot's limit
    noise = torch.randint(-32768, 32767, (1 << 16,), dtype=torch.int16, generator=torch.Generator().manual_seed(1))
    assert pack_words(noise) is None


def test_bad_sections_are_refused_naming_them():
    packed = pack_words(_weights(2048), limit_bytes=UNLIMITED)
    sm, planes, offsets, escapes = packed.views(packed.host.tensor)
    out = torch.empty(2048, dtype=torch.int16)
    with pytest.raises(ValueError, match="out must be a 1-D int16"):
        unpack_reference(sm, planes, offsets, escapes, packed.base, out.float())
    with pytest.raises(ValueError, match="planes must be torch.uint8 of shape"):
        unpack_reference(sm, planes[:, :-1], offsets, escapes, packed.base, out)
    with pytest.raises(ValueError, match="offsets must be torch.int32"):
        unpack_reference(sm, planes, offsets[:-1], escapes, packed.base, out)
    with pytest.raises(ValueError, match="base=250"):
        unpack_reference(sm, planes, offsets, escapes, 250, out)
    with pytest.raises(ValueError, match="words must be a 1-D int16"):
        pack_words(torch.zeros(8))


def test_the_dispatcher_takes_the_reference_on_the_cpu(monkeypatch):
    packed = pack_words(_weights(4096), limit_bytes=UNLIMITED)
    called = []
    monkeypatch.setattr(bf16_unpack, "unpack_reference", lambda *a: called.append("reference"))
    monkeypatch.setattr(bf16_unpack, "unpack_triton", lambda *a: called.append("triton"))
    out = torch.empty(4096, dtype=torch.int16)
    unpack_words(*packed.views(packed.host.tensor), packed.base, out)
    unpack_words(*packed.views(packed.host.tensor), packed.base, out, impl="triton")
    assert called == ["reference", "triton"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_kernel_decodes_on_the_gpu_inside_a_cuda_graph():
    words = _weights(3 * CHUNK * 1000 + 77)
    packed = pack_words(words, device="cuda", pin=True, limit_bytes=UNLIMITED)
    slot = torch.empty(packed.nbytes, dtype=torch.uint8, device="cuda")
    out = torch.zeros(words.numel(), dtype=torch.int16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    unpack_words(*packed.views(slot), packed.base, out)  # compile outside the capture
    with torch.cuda.graph(graph):
        slot.copy_(packed.host.tensor, non_blocking=True)
        unpack_words(*packed.views(slot), packed.base, out)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), words)

"""vae.untiled: the fast untiled decode / encode equals diffusers' plain decode / encode; its swaps are scoped.

References are independent of the code under test: the same diffusers ``AutoencoderKL`` called without the scope
(its own GroupNorm and attention processor), and on the GPU an fp64 decode of the same latent.
"""
import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F

from leandiffusion.tests.kit import process_state, tiny_components
from leandiffusion.vae import attention as attention_mod
from leandiffusion.vae import group_norm as gn
from leandiffusion.vae import untiled


def _tiny_vae(family="sdxl"):
    return tiny_components(family)["vae"]


def _state(vae):
    return ([type(m) for m in vae.modules()],
            [m.processor for m in vae.modules() if hasattr(m, "processor") and hasattr(m, "to_q")])


def test_decode_and_encode_equal_diffusers_plain_calls_and_use_run_attention(monkeypatch):
    vae = _tiny_vae()
    z = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    x = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(1)) * 2 - 1
    calls = []
    real = attention_mod.run_attention

    def counted(spec, hidden, tf32=False):
        calls.append(tf32)
        return real(spec, hidden, tf32=tf32)

    monkeypatch.setattr(untiled, "run_attention", counted)
    with torch.no_grad():
        plain_image = vae.decode(z, return_dict=False)[0]
        plain_latent = vae.encode(x).latent_dist.mean
        before = _state(vae)
        with untiled.fast_vae(vae):
            image = untiled.decode(vae, z)
            latent = untiled.encode(vae, x)
    assert calls == [False, False]  # the decoder's and the encoder's mid-block attention; no TF32 on the CPU
    assert _state(vae) == before
    # fp32 rounding only: within 1e-4 of the plain calls, and no farther from the fp64 result than they are
    assert (image - plain_image).abs().max().item() <= 1e-4
    assert (latent - plain_latent).abs().max().item() <= 1e-4
    vae64 = copy.deepcopy(vae).double()
    with torch.no_grad():
        ref_image = vae64.decode(z.double(), return_dict=False)[0]
        ref_latent = vae64.encode(x.double()).latent_dist.mean
    for ours, plain, ref in ((image, plain_image, ref_image), (latent, plain_latent, ref_latent)):
        err_ours, err_plain = (ours - ref).abs().max().item(), (plain - ref).abs().max().item()
        assert err_ours <= 2 * err_plain + 1e-6, (err_ours, err_plain)


def test_scope_restores_everything_on_error():
    vae = _tiny_vae()
    before = _state(vae)
    with pytest.raises(RuntimeError, match="boom"):
        with untiled.fast_vae(vae):
            assert _state(vae) != before
            raise RuntimeError("boom")
    assert _state(vae) == before


def test_calls_it_cannot_serve_go_to_the_blocks_own_processor():
    vae = _tiny_vae()
    attn = vae.decoder.mid_block.attentions[0]
    seen = []

    def original(block, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None):
        seen.append(next(name for name, v in (("context", encoder_hidden_states), ("mask", attention_mask),
                                              ("temb", temb), ("3-D", hidden_states)) if v is not None))
        return hidden_states

    proc = untiled._RunAttentionProcessor(original, untiled.spec_from_diffusers(attn))
    h = torch.randn(1, 64, 4, 4)
    assert proc(attn, h, encoder_hidden_states=torch.randn(1, 16, 64)) is h
    # a masked call keeps its own processor, never runs unmasked through run_attention
    assert proc(attn, h, attention_mask=torch.zeros(1, 16, 16)) is h
    assert proc(attn, h, temb=torch.randn(1, 8)) is h
    tokens = torch.randn(1, 16, 64)
    assert proc(attn, tokens) is tokens
    assert seen == ["context", "mask", "temb", "3-D"]


# matmul precision choices a user (or another pack) may have made before a decode, through each of PyTorch's APIs
USER_MATMUL_SETTINGS = {
    "defaults": lambda: None,
    "legacy matmul.allow_tf32=True": lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", True),
    "float32_matmul_precision=medium": lambda: torch.set_float32_matmul_precision("medium"),
    "matmul.fp32_precision=ieee": lambda: setattr(torch.backends.cuda.matmul, "fp32_precision", "ieee"),
    "backends.fp32_precision=tf32": lambda: setattr(torch.backends, "fp32_precision", "tf32"),
    "fp16 reduced-precision reductions off": lambda: setattr(
        torch.backends.cuda.matmul, "allow_fp16_reduced_precision_reduction", False),
}


@pytest.mark.skipif(not hasattr(torch.backends.cuda.matmul, "fp32_precision"),
                    reason="PyTorch < 2.9 has no fp32_precision API (the legacy flag's scope: the test below)")
@pytest.mark.parametrize("error", [False, True], ids=["returns", "raises"])
@pytest.mark.parametrize("user_setting", list(USER_MATMUL_SETTINGS))
def test_tf32_matmuls_changes_nothing_outside_its_block(user_setting, error):
    """The untiled decode's TF32 score-matmul scope: TF32 inside, and afterwards every process-wide setting as the
    user had it (whichever API set it; the legacy flags stay readable), after a return and after an error. The flags
    are process state that torch reads and writes on the CPU too."""
    with process_state.preserved():
        USER_MATMUL_SETTINGS[user_setting]()
        before = process_state.snapshot()
        with pytest.raises(ValueError) if error else contextlib.nullcontext():
            with attention_mod.tf32_matmuls():
                assert torch.backends.cuda.matmul.fp32_precision == "tf32"
                if error:
                    raise ValueError("inside the attention block")
        assert process_state.changes(before, process_state.snapshot()) == {}


class _LegacyMatmul:
    """``torch.backends.cuda.matmul`` as PyTorch 2.4-2.8 have it (torch 2.4.1's ``cuBLASModule``): the legacy flags
    only; any other name, ``fp32_precision`` included, raises ``AttributeError("Unknown attribute ...")``."""

    def __init__(self):
        object.__setattr__(self, "flags", {"allow_tf32": False, "allow_fp16_reduced_precision_reduction": True,
                                           "allow_bf16_reduced_precision_reduction": True})

    def __getattr__(self, name):
        if name in self.flags:
            return self.flags[name]
        raise AttributeError("Unknown attribute " + name)

    def __setattr__(self, name, value):
        if name not in self.flags:
            raise AttributeError("Unknown attribute " + name)
        self.flags[name] = value


@pytest.mark.parametrize("error", [False, True], ids=["returns", "raises"])
def test_tf32_matmuls_on_pytorch_without_fp32_precision(monkeypatch, error):
    """PyTorch < 2.9 (the pack's floor is 2.4) has only the legacy ``allow_tf32`` flag. The tiled executor's online
    attention enters ``tf32_matmuls`` for every fp16 / bf16 map on CUDA (the streamed scheme, and the resident one above
    a 2048 px image), whatever ``convolutions_use_tf32()`` says; reading ``fp32_precision`` there would raise
    ``AttributeError: Unknown attribute fp32_precision`` and end the decode. TF32 through the legacy flag inside the
    block, the user's value back after it."""
    legacy = _LegacyMatmul()
    monkeypatch.setattr(torch.backends.cuda, "matmul", legacy)
    with pytest.raises(ValueError) if error else contextlib.nullcontext():
        with attention_mod.tf32_matmuls():
            assert legacy.allow_tf32 is True
            if error:
                raise ValueError("inside the attention block")
    assert legacy.flags == _LegacyMatmul().flags


def test_chunked_attention_equals_sdpa():
    """The query-chunked path (what the TF32 path runs on CUDA) equals one SDPA call; chunks forced small."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 300, 32, generator=g) for _ in range(3))
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double()).float()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attention_mod, "_SCORE_BYTES", 4 * 300 * 64)  # 64 query rows per chunk: 5 chunks
        out = attention_mod._sdpa(q, k, v, tf32=True)
    assert (out - ref).abs().max().item() <= 1e-5


def test_chunked_attention_holds_at_most_the_score_cap_across_batch_and_heads():
    """The fallback path's score matrix held at once (``chunk x N`` fp32 per image and head) stays within
    ``_SCORE_BYTES``, and the chunks are as large as the cap allows (not one chunk of all the queries, an N x N matrix;
    not the heads left out of the chunk size, 3x the cap)."""
    g = torch.Generator().manual_seed(1)
    b, heads, n, d = 2, 3, 300, 16
    q, k, v = (torch.randn(b, heads, n, d, generator=g) for _ in range(3))
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double()).float()
    cap = 4 * n * b * heads * 50  # 50 query rows per chunk
    held = []
    sdpa = F.scaled_dot_product_attention

    def spy(qc, kc, vc, *args, **kwargs):
        held.append(4 * qc.shape[0] * qc.shape[1] * qc.shape[2] * kc.shape[2])
        return sdpa(qc, kc, vc, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attention_mod, "_SCORE_BYTES", cap)
        mp.setattr(F, "scaled_dot_product_attention", spy)
        out = attention_mod._sdpa(q, k, v)
    assert len(held) == 6 and max(held) == cap
    assert (out - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("shape", [(1, 64, 32, 32), (1, 32, 24, 20), (1, 16, 7, 9)])
def test_channels_last_statistics_equal_fp64(shape):
    """Two-level per-channel statistics of a channels-last image (256 slabs; 32 for 480 pixels; one for 63) equal
    the fp64 per-channel variance and mean; the group norm built on them equals ``F.group_norm``."""
    g = torch.Generator().manual_seed(0)
    shift = 3.0 * torch.randn(shape[1], generator=g).view(1, -1, 1, 1)
    x = (torch.randn(shape, generator=g) * 0.5 + shift).contiguous(memory_format=torch.channels_last)
    var, mean = gn.channel_var_mean(x, torch.float32)
    ref_var, ref_mean = torch.var_mean(x.double(), dim=(2, 3), correction=0)
    assert (mean.double() - ref_mean).abs().max().item() <= 1e-5
    assert ((var.double() - ref_var).abs() / ref_var).max().item() <= 1e-5
    out = gn.parallel_stats_group_norm(x, 8, None, None, 1e-6)
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert (out - F.group_norm(x.contiguous(), 8, eps=1e-6)).abs().max().item() <= 1e-4


@pytest.mark.gpu
def test_full_size_sdxl_decode_on_gpu_is_as_close_to_fp64_as_diffusers():
    """SDXL's VAE in fp32 at 1024 px on CUDA: the fast decode (channels-last, TF32 attention) against an fp64
    decode of the same latent, beside diffusers' own fp32 decode (TF32 convolutions, PyTorch's default). Both
    round at TF32's level; ours must stay within 1.5x diffusers' error plus half an 8-bit level, and within 2/255
    of diffusers' image on the 0..1 scale. A wrong layout or attention moves values by orders of magnitude more."""
    from leandiffusion.bench.models import full_vae

    vae = full_vae(device="cuda", dtype=torch.float32)
    z = torch.randn(1, 4, 128, 128, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    with torch.no_grad():
        plain = vae.decode(z, return_dict=False)[0].double()
        with untiled.fast_vae(vae):
            ours = untiled.decode(vae, z).double()
        assert ours.is_contiguous(memory_format=torch.channels_last)
        assert torch.backends.cuda.matmul.fp32_precision != "tf32" or attention_mod.convolutions_use_tf32()
        ref = vae.double().decode(z.double(), return_dict=False)[0]
    err_plain = (plain - ref).abs().max().item()
    err_ours = (ours - ref).abs().max().item()
    assert err_ours <= 1.5 * err_plain + 1 / 255, (err_ours, err_plain)
    assert ((ours - plain).abs().max().item()) / 2 <= 2 / 255


def test_engine_calls_return_float32_on_the_cpu_whatever_the_vae_dtype():
    """``vae_decode`` / ``vae_encode`` of an engine keep ComfyUI's LATENT and IMAGE conventions: float32 CPU
    tensors, also from a bf16 VAE."""
    from leandiffusion.tests.kit import tiny_engine

    engine = tiny_engine("sd1").with_changes(vae_dtype=torch.bfloat16)
    with engine.session("vae"):
        latents = untiled.vae_encode(engine, torch.rand(1, 16, 24, 3, generator=torch.Generator().manual_seed(0)))
        image = untiled.vae_decode(engine, latents)
    assert latents.dtype == image.dtype == torch.float32 and latents.device.type == image.device.type == "cpu"
    assert latents.shape == (1, 4, 2, 3) and image.shape == (1, 16, 24, 3)

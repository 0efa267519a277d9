"""GPU paths of exact tiling: CUDA streams, pinned host stores, fp16/bf16, and the full-size SD VAE.

Guards the promises the CPU cannot check: asynchronous host<->device band copies ordered correctly (a race shows
up as an error far above rounding against a high-precision reference), and bounded peak memory on the real
architecture.

Why the tiny-VAE parity tests compare against an fp64 reference rather than tiled against untiled: on the GPU the
untiled and the tiled decode run the same math on different shapes, so cuDNN/cuBLAS pick different algorithms (TF32
or not for fp32 convolutions, different reduction orders for fp16/bf16). Both are then approximations of the exact
result, and their difference is up to the *sum* of their rounding errors: with the random tiny VAE (which amplifies
rounding; its untiled bf16 decode is ~0.07 off fp64 on the CPU) a fixed tiled-vs-untiled bound is either too tight
to pass or too loose to mean anything. So both decodes (same dtype, same weights, same device) are measured against
the decode of those weights in fp64 on the CPU, and the tiled error must satisfy
``err_tiled <= FACTOR * err_untiled + FLOOR[dtype]``: tiling may round differently but not be materially worse
than the untiled decode in the same precision. ``FACTOR = 2`` leaves room for the tiled run drawing the unlucky
algorithm; ``FLOOR`` (about two output ulps of the dtype near 1.0; TF32 has fp16's 10-bit mantissa, and under TF32
one side may run a non-TF32 kernel, hence one 8-bit level) keeps a lucky, near-exact untiled run from making the
bound vanish. A tiling bug (wrong halo, wrong GroupNorm statistics, a band copied before it was written) gives
errors of the order of the image itself (tiles with their own statistics, the former cross-faded blend mode, were
0.75 off at the worst pixel of this VAE), far above every bound here. fp32 is checked twice: with TF32 disabled (a
context that restores the flags; strict floor) and with the process's default flags (what users run).

The full-size SD VAE keeps the absolute acceptance line: exact fp16 tiled vs untiled max abs diff <= 2/255.
Memory there is measured as deltas from a baseline taken at the test's start (other tests' leftovers do not count).
"""
import contextlib
import copy

import pytest
import torch

from leandiffusion.bench.models import full_vae
from leandiffusion.tests.kit import tiny_components
from leandiffusion.tests.kit.precision import strict_fp32
from leandiffusion.tests.vae.qwen_vae import tiny_qwen_vae
from leandiffusion.vae.targets import from_module
from leandiffusion.vae.tiled import tiled_decode, tiled_encode

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
MiB = 2 ** 20
FACTOR = 2.0
FLOOR = {"fp32-ieee": 1e-4, "fp32-default": 1 / 255, "fp16": 2 / 1024, "bf16": 2 / 128}
DTYPE = {"fp32-ieee": torch.float32, "fp32-default": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@contextlib.contextmanager
def _precision(mode):
    """TF32 off for cuDNN convolutions and cuBLAS matmuls inside the block for ``fp32-ieee``; settings restored."""
    if mode != "fp32-ieee":
        yield
        return
    with strict_fp32():
        yield


def _img(x):
    return (x.double() / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).cpu()


@pytest.fixture(scope="module")
def tiny_vae_and_reference():
    vae = tiny_components("sd1")["vae"]
    z = torch.randn(2, 4, 41, 29, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = _img(vae.double().decode(z.double()).sample)
    return vae.float(), z, ref


@pytest.mark.parametrize("mode", list(FLOOR))
@pytest.mark.parametrize("budget", [None, 3 * MiB], ids=["device-stores", "host-stores"])
def test_exact_decode_cuda_vs_fp64(tiny_vae_and_reference, mode, budget):
    """See the module docstring: tiled error vs fp64 within FACTOR x the untiled error + FLOOR (same dtype)."""
    base_vae, z, ref = tiny_vae_and_reference
    vae = copy.deepcopy(base_vae).to(CUDA, DTYPE[mode])
    with _precision(mode):
        with torch.no_grad():
            untiled = _img(vae.decode(z.to(CUDA, DTYPE[mode])).sample)
        tiled = tiled_decode(from_module(vae), z, tile_size=128, overlap=32, budget_bytes=budget, quiet=True)
    _assert_within_bound(tiled, untiled, ref, mode)


def _assert_within_bound(tiled, untiled, ref, mode):
    """See the module docstring: tiled error vs fp64 within FACTOR x the untiled error + FLOOR (same dtype)."""
    assert tiled.shape == ref.shape
    err_untiled = (untiled - ref).abs().max().item()
    err_tiled = (tiled.double() - ref).abs().max().item()
    bound = FACTOR * err_untiled + FLOOR[mode]
    assert err_tiled <= bound, f"tiled {err_tiled:.3g} vs untiled {err_untiled:.3g} (bound {bound:.3g}) off fp64"


@pytest.fixture(scope="module")
def qwen_vae_and_reference():
    vae = tiny_qwen_vae()
    z = torch.randn(2, 16, 41, 29, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = _img(vae.double().decode(z.double().unsqueeze(2)).sample[:, :, 0])
    return vae.float(), z, ref


@pytest.mark.parametrize("mode", ["fp32-ieee", "fp32-default", "bf16"])
@pytest.mark.parametrize("budget", [None, 1 * MiB], ids=["device-stores", "host-stores"])
def test_exact_decode_qwen_vae_cuda_vs_fp64(qwen_vae_and_reference, mode, budget):
    """Qwen-Image's causal 3D VAE (``vae/causal3d.py``) under the same bound: its per-pixel RMS norms in bf16 (the
    family's CUDA dtype), frame convolutions on channels-last bands, and the mid-block attention with a per-pixel
    norm in the CUDA-only schemes (online softmax for fp32 under TF32, streamed bands under the small budget)."""
    base_vae, z, ref = qwen_vae_and_reference
    vae = copy.deepcopy(base_vae).to(CUDA, DTYPE[mode])
    with _precision(mode):
        with torch.no_grad():
            untiled = _img(vae.decode(z.to(CUDA, DTYPE[mode]).unsqueeze(2)).sample[:, :, 0])
        tiled = tiled_decode(from_module(vae), z, tile_size=128, overlap=32, budget_bytes=budget, quiet=True)
    _assert_within_bound(tiled, untiled, ref, mode)


@pytest.mark.parametrize("budget", [None, 2 * MiB], ids=["device-stores", "host-stores"])
def test_exact_encode_cuda(budget):
    vae = tiny_components("sd1")["vae"].to(CUDA, torch.float16)
    pixels = torch.rand(1, 328, 232, 3)
    with torch.no_grad():
        ref = vae.encode(pixels.permute(0, 3, 1, 2).to(CUDA, torch.float16) * 2 - 1).latent_dist.mean.float().cpu()
    out = tiled_encode(from_module(vae), pixels, tile_size=128, overlap=32, budget_bytes=budget, quiet=True)
    assert (out - ref).abs().max().item() <= 0.02 * ref.abs().max().item()


def test_full_sd_vae_1024_fp16_exact_bounded():
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()  # other tests' leftovers are not this test's
    vae = full_vae(CUDA, torch.float16)
    weights = sum(p.numel() * p.element_size() for p in vae.parameters())
    z = torch.randn(1, 4, 128, 128)
    with torch.no_grad():
        torch.cuda.reset_peak_memory_stats()
        ref = _img(vae.decode(z.to(CUDA, torch.float16)).sample).float()
        untiled_peak = torch.cuda.max_memory_allocated() - base
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before_tiled = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = tiled_decode(from_module(vae), z, 0, 64, "exact", budget_bytes=256 * MiB, quiet=True)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert (out - ref).abs().max().item() <= 2 / 255
    assert peak < 0.5 * untiled_peak, f"tiled peak {peak / MiB:.0f} MiB vs untiled {untiled_peak / MiB:.0f} MiB"
    # Nothing but the weights stays allocated (slack: cuBLAS keeps a per-stream workspace once created).
    assert torch.cuda.memory_allocated() - before_tiled <= 64 * MiB
    assert torch.cuda.memory_allocated() - base <= weights + 64 * MiB


@pytest.mark.parametrize("dtype,budget_gib,px", [(torch.float32, 1.0, 2048), (torch.float32, 1.5, 2048),
                                                 (torch.float16, 1.0, 2048), (torch.float32, 0.5, 2048),
                                                 (torch.float32, 1.0, 4096), (torch.float16, 0.75, 4096)])
def test_full_vae_exact_holds_its_budget(dtype, budget_gib, px):
    """The exact decode's estimate leaves the convolutions' extra allocations room (``vae.exact.CUDA_WORK_SHARE``; with
    the whole remainder a 2048 px decode overran its activation budget by up to ~18% in fp32), and the mid-block
    attention runs in bands (``vae.attention_bands``; on the whole map it would hold ~0.9 GiB (fp32) at 2048 px and 3.0
    / 2.0 GiB (fp32 / fp16) at 4096 px whatever the budget: the last three cases). The allocated peak above what was
    allocated before the call (the weights) stays within the budget (the SDXL VAE has the same architecture)."""
    vae = full_vae(CUDA, dtype)
    z = torch.randn(1, 4, px // 8, px // 8, generator=torch.Generator().manual_seed(0))
    budget = int(budget_gib * 2 ** 30)
    tiled_decode(from_module(vae), z[:, :, :64, :64], 0, 64, "exact", budget_bytes=budget, quiet=True)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    tiled_decode(from_module(vae), z, 0, 64, "exact", budget_bytes=budget, quiet=True)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert peak <= budget, f"{peak / 2 ** 30:.3f} GiB allocated above the weights, budget {budget_gib} GiB"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_online_tf32_attention_keeps_half_queries_exact(dtype):
    """``attention_bands._online_attention`` must not scale ``q`` by d^-0.5 in fp32 before its TF32 score matmul: fp16 /
    bf16 queries then no longer fit TF32's 10-bit mantissa and are rounded, with an error that grows with the scores'
    size. Scores in the hundreds with a spread of ~10 per row (a shared offset direction in q and k) put the output
    1.6e-2 (TF32 rounding to nearest) to 2.2e-2 (truncating) off fp64 at values ~3, TF32 emulated on the CPU; with the
    scale in the GEMM's epilogue the half inputs stay exact and the error is 1.4e-3 / 2.3e-3 (what an fp16 attention
    kernel's rounded probabilities give). Reference: fp64 softmax attention of the same (rounded) inputs on the CPU."""
    from leandiffusion.vae.attention_bands import _online_attention

    gen = torch.Generator().manual_seed(0)
    d, n = 512, 2048
    u = torch.randn(d, generator=gen)
    q, k = ((8 * u + 2 * torch.randn(n, d, generator=gen)).to(dtype) for _ in range(2))
    v = (torch.randn(n, d, generator=gen) + 3).to(dtype)
    ref = torch.softmax((q.double() @ k.double().T) * d ** -0.5, dim=-1) @ v.double()
    qc, kc, vc = (t.to(CUDA)[None, None] for t in (q, k, v))
    chunks = [(kc[:, :, a:a + 512], vc[:, :, a:a + 512]) for a in range(0, n, 512)]
    got = _online_attention(qc, chunks, True)[0, 0].double().cpu()
    assert (got - ref).abs().max().item() <= 5e-3

"""GPU paths of exact tiling: CUDA streams, pinned host stores, fp16/bf16, and the full-size SD VAE.

Guards the promises the CPU cannot check: asynchronous host<->device band copies ordered correctly (a race shows
up as a mismatch against the untiled decode), and bounded peak memory on the real architecture.
"""
import pytest
import torch

from leandiffusion.bench.models import full_vae
from leandiffusion.tests.kit import tiny_components
from leandiffusion.vae.targets import from_module
from leandiffusion.vae.tiled import tiled_decode, tiled_encode

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
# TF32 convolutions (PyTorch's default for cuDNN) on both sides make fp32 differ at ~1e-3.
TOL = {torch.float32: 2e-3, torch.float16: 2 / 255, torch.bfloat16: 4 / 255}


def _img(x):
    return (x.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("budget", [None, 3 * 2**20], ids=["device-stores", "host-stores"])
def test_exact_decode_cuda(dtype, budget):
    vae = tiny_components("sd1")["vae"].to(CUDA, dtype)
    z = torch.randn(2, 4, 41, 29)
    with torch.no_grad():
        ref = _img(vae.decode(z.to(CUDA, dtype)).sample)
    out = tiled_decode(from_module(vae), z, tile_size=128, overlap=32, budget_bytes=budget, quiet=True)
    assert (out - ref).abs().max().item() <= TOL[dtype]


@pytest.mark.parametrize("budget", [None, 2 * 2**20], ids=["device-stores", "host-stores"])
def test_exact_encode_cuda(budget):
    vae = tiny_components("sd1")["vae"].to(CUDA, torch.float16)
    pixels = torch.rand(1, 328, 232, 3)
    with torch.no_grad():
        ref = vae.encode(pixels.permute(0, 3, 1, 2).to(CUDA, torch.float16) * 2 - 1).latent_dist.mean.float().cpu()
    out = tiled_encode(from_module(vae), pixels, tile_size=128, overlap=32, budget_bytes=budget, quiet=True)
    assert (out - ref).abs().max().item() <= 0.02 * ref.abs().max().item()


def test_full_sd_vae_1024_fp16_exact_bounded():
    vae = full_vae(CUDA, torch.float16)
    z = torch.randn(1, 4, 128, 128)
    with torch.no_grad():
        torch.cuda.reset_peak_memory_stats()
        ref = _img(vae.decode(z.to(CUDA, torch.float16)).sample)
        untiled_peak = torch.cuda.max_memory_allocated()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    out = tiled_decode(from_module(vae), z, 0, 64, "exact", budget_bytes=256 * 2**20, quiet=True)
    peak = torch.cuda.max_memory_allocated()
    assert (out - ref).abs().max().item() <= 2 / 255
    assert peak < 0.5 * untiled_peak
    assert torch.cuda.memory_allocated() < 400 * 2**20  # nothing but the weights stays allocated

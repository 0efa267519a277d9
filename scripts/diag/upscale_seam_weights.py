"""Cost and effect of where the ESRGAN tiler applies its seam weights (``upscale.runner``).

Per model (RRDB x4plus and SRVGGNetCompact 64x16 x4, random weights), dtype (fp16, bf16) and tiling (``tile_size``
256 / overlap 32: many seams; auto: the default plan), ms per 1024 px image for four ways of weighting:
- ``device_fp32``: this code (session 24: ``runner.weighted_fp32`` on the GPU, the fp32 tile downloaded, the host
  adds fp32 to fp32);
- ``host_fp32``: session 23's way, emulated (the tile downloaded in the model's dtype, ``out.addcmul_(tile, w)``
  on the host with host-built fp32 weights);
- ``device_lowp``: the way before session 23, emulated (the weight multiplied on the device in the model's dtype,
  downloaded in that dtype, then a plain add on the host);
- ``none``: no weighting at all, downloaded in the model's dtype (a wrong image; the floor the others are measured
  against).
Plus the seam error of each way with a pointwise (nearest x4) model: max |tiled - one tile| in 8-bit levels.
Usage (device machine, repository root, pack importable as ``leandiffusion``):
python scripts/diag/upscale_seam_weights.py; writes $OUT/upscale_seam_weights.json. About three minutes on an H100.
"""
import os
import statistics
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
CURRENT, SEAM_WEIGHT = runner._CudaStager, runner.seam_weight


class _LowpDownload(CURRENT):
    """Downloads in the model's dtype and accumulates on the host with ``_accumulate`` (session 23's stager)."""

    def __init__(self, device, in_numel, out_numel):
        super().__init__(device, in_numel, out_numel)
        self.out_numel, self.outbufs = out_numel, None

    def _drain(self, slot):
        item = self.pending[slot]
        if item is not None:
            event, buf, dst, accumulate, weight = item
            event.synchronize()
            runner._accumulate(dst, buf, accumulate, weight)
            self.pending[slot] = None

    def _send(self, tile_hwc, dst, accumulate, weight):
        if self.outbufs is None:
            self.outbufs = [torch.empty(self.out_numel, dtype=tile_hwc.dtype, pin_memory=True) for _ in range(2)]
        buf = self.outbufs[self.slot][: tile_hwc.numel()].view(tile_hwc.shape)
        buf.copy_(tile_hwc, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.pending[self.slot] = (event, buf, dst, accumulate, weight)
        self.slot ^= 1
        self._drain(self.slot)


class _HostFp32(_LowpDownload):
    """Its weights are built on the host (``run`` swaps ``runner.seam_weight`` for it), as session 23's code did."""

    def download(self, tile_hwc, dst, accumulate=True, weight=None):
        self._send(tile_hwc, dst, accumulate, weight)


class _DeviceLowp(_LowpDownload):
    def download(self, tile_hwc, dst, accumulate=True, weight=None):
        if weight is not None:
            tile_hwc = tile_hwc * weight.to(tile_hwc.dtype)
        self._send(tile_hwc, dst, accumulate, None)


class _NoWeights(_LowpDownload):
    def download(self, tile_hwc, dst, accumulate=True, weight=None):
        self._send(tile_hwc, dst, accumulate, None)


WAYS = {"device_fp32": CURRENT, "host_fp32": _HostFp32, "device_lowp": _DeviceLowp, "none": _NoWeights}


class Nearest(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.interpolate(x, scale_factor=4, mode="nearest")


def _host_seam_weight(r, c, scale, device):
    return SEAM_WEIGHT(r, c, scale, torch.device("cpu"))


def run(up, img, prec, tile, way):
    runner._CudaStager = WAYS[way]
    runner.seam_weight = _host_seam_weight if way == "host_fp32" else SEAM_WEIGHT
    try:
        return runner.upscale_images(up, img, device="gpu", tile_size=tile, tile_overlap=32, precision=prec,
                                     quiet=True)
    finally:
        runner._CudaStager, runner.seam_weight = CURRENT, SEAM_WEIGHT


def timed(up, img, prec, tile, reps, rounds=3):
    """{way: median over ``rounds`` of the mean ms of ``reps`` runs}; the ways interleave within each round, so a
    drift of the clock or the host touches them alike."""
    for way in WAYS:
        run(up, img, prec, tile, way)  # warm-up (cuDNN plans, pinned buffers)
    samples = {way: [] for way in WAYS}
    for _ in range(rounds):
        for way in WAYS:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(reps):
                run(up, img, prec, tile, way)
            torch.cuda.synchronize()
            samples[way].append((time.perf_counter() - t0) / reps * 1000)
    return {way: round(statistics.median(v), 1) for way, v in samples.items()}


@torch.no_grad()
def main():
    gen = torch.Generator().manual_seed(0)
    img = torch.rand(1, 1024, 1024, 3, generator=gen)
    bright = 0.75 + 0.25 * torch.rand(1, 256, 256, 3, generator=gen)
    point = Upscaler(Nearest(), "generic", 4, context=None)
    for prec in ("fp16", "bf16"):
        one = run(point, bright, prec, 0, "device_fp32")
        for way in WAYS:
            tiled = run(point, bright, prec, 64, way)
            rec(f"seam_error_levels_{prec}_{way}", round(float((tiled - one).abs().max()) * 255, 4))
    models = {"rrdb_x4plus": H.random_rrdb(64, 23, 32), "compact_64x16": H.random_compact(64, 16, 4)}
    for name, sd in models.items():
        up = build_upscaler(sd)
        for prec in ("fp16", "bf16"):
            for tile in (256, 0):
                row = timed(up, img, prec, tile, 2 if name.startswith("rrdb") else 3)
                row["device_fp32_minus_host_fp32"] = round(row["device_fp32"] - row["host_fp32"], 1)
                row["device_fp32_minus_device_lowp"] = round(row["device_fp32"] - row["device_lowp"], 1)
                rec(f"ms_{name}_{prec}_tile{tile or 'auto'}", row)


if __name__ == "__main__":
    main()

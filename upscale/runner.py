"""Tiled ESRGAN inference on the GPU or the CPU, image by image, within a fixed working-memory bound.

Invariants:
- ``images`` ([B, H, W, C] float in 0..1, ComfyUI's IMAGE) and the ``Upscaler`` are never modified; the model
  runs from a private copy when it must change device or dtype.
- Only windows (a tile plus its context, see ``tiling``) ever sit on the GPU, moved by a stager (``staging``: two
  pinned slots per direction, seam weights applied in fp32); the full image and the output live in host memory.
- Device, precision, layout, budget and tile size are chosen by ``options``.
- Out of memory: the tile is halved and the image restarted; below ``MIN_TILE`` a ``RuntimeError`` lists every
  tile size that was tried. Later images of the batch keep the smaller tile, and the progress bar is re-planned
  (it never passes its total). A batch is processed one image at a time, so its peak equals one image's peak.
- Sizes: an image is padded at the bottom/right to the model's smallest accepted side and alignment (spandrel's
  rule, what ComfyUI's own upscale node does: reflection, then edge replication), and the output cropped back.
- Alpha: an RGBA image into an RGB model keeps its alpha. The colour runs through the model; the alpha is resized
  to the output size with the same antialiased bicubic filter as ``output_scale`` (realesrgan-ncnn-vulkan also
  resizes alpha with bicubic; ComfyUI's own upscale node refuses 4 channels with a convolution shape error).
- ``output_scale`` (0 = the model's native scale) resizes the model's output with antialiased bicubic
  interpolation, then clamps to 0..1.
- An exception leaves no tensor of the run pinned by its traceback (``batch.release_frames``).
"""
from __future__ import annotations

import contextlib
import copy
import logging
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from ..batch import BatchProgress, release_frames
from ..bridge import ProgressBar, check_interrupted, soft_empty_cache
from ..memory.host_memory import check_host_bytes
from ..memory.out_of_memory import is_out_of_memory
from .descriptor import Upscaler
from .options import (MIN_TILE, auto_tile, check_options, choose_device, choose_dtype, resolve_layout,
                      work_budget)
from .staging import seam_weight, stager_for
from .tiling import Span, plan

logger = logging.getLogger(__name__)

CUDNN_BENCHMARK = False  # default of upscale_images(cudnn_benchmark=...); bench/suite_upscale.py compares both


@dataclass(frozen=True)
class _Run:
    """What every image of one call shares: the model placed on its device, the dtype, context and layout."""

    upscaler: Upscaler
    module: torch.nn.Module
    device: torch.device
    dtype: torch.dtype
    overlap: int
    layout: str


@dataclass(frozen=True)
class _Sizes:
    """One batch's sizes: the input padded to the model's alignment, the output, and the first tile and budget."""

    padded: tuple[int, int]
    out: tuple[int, int]
    tile: int
    work_bytes: int
    tiles_per_image: int


def _placed_module(upscaler: Upscaler, device: torch.device, dtype: torch.dtype, layout: str) -> torch.nn.Module:
    """The model on ``device`` in ``dtype``: the upscaler's own module when it already is (channels-last inputs
    alone make the CPU convolutions run NHWC), else a private copy whose tensors are cast straight to their place
    (the deepcopy memo maps each parameter/buffer to its cast, so no host-side copy of the weights is made);
    4-D weights channels-last for "nhwc"."""
    module = upscaler.module
    params = list(module.parameters())
    if params and all(p.device == device and p.dtype == dtype for p in params):
        return module
    fmt = torch.channels_last if layout == "nhwc" else torch.preserve_format

    def cast(t: torch.Tensor) -> torch.Tensor:
        extra = {"memory_format": fmt} if t.ndim == 4 else {}
        return t.detach().to(device=device, dtype=dtype if t.is_floating_point() else t.dtype, **extra)

    memo = {id(p): torch.nn.Parameter(cast(p), requires_grad=False) for p in params}
    memo.update({id(b): cast(b) for b in module.buffers()})
    return copy.deepcopy(module, memo).eval()


@contextlib.contextmanager
def _cudnn_benchmark(enabled: bool, device: torch.device):
    """cuDNN autotuning for the duration of one call; only ``cudnn.benchmark`` is written, and put back after it.

    Not ``torch.backends.cudnn.flags``: that writes every cuDNN setting (TF32 through both the legacy and the new
    API), and reading them back for it raises once the user has set TF32 per operator with PyTorch's
    ``fp32_precision`` API (``cudnn.conv.fp32_precision = "ieee"``)."""
    if not enabled or device.type != "cuda":
        yield
        return
    cudnn = torch.backends.cudnn
    before = cudnn.benchmark
    cudnn.benchmark = True
    try:
        yield
    finally:
        cudnn.benchmark = before


# --------------------------------------------------------------------------------------------- one image
def _crop(t: torch.Tensor, r: Span, c: Span, s: int) -> torch.Tensor:
    return t[:, :, (r.keep0 - r.win0) * s:(r.keep1 - r.win0) * s, (c.keep0 - c.win0) * s:(c.keep1 - c.win0) * s]


def _upscale_one(run: _Run, chw: torch.Tensor, tile: int, work_bytes: int, on_tile,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[C, H, W] host image (aligned to ``multiple_of``) -> [H*s, W*s, C_out] float32 host image, written into
    ``out`` when given. One tile is copied in; several are accumulated into a zeroed output."""
    upscaler = run.upscaler
    _, h, w = chw.shape
    s = upscaler.scale
    tiles = plan(h, w, tile, run.overlap, upscaler.multiple_of, upscaler.min_size)
    single = len(tiles) == 1
    if out is None:
        out = torch.empty((h * s, w * s, upscaler.out_channels), dtype=torch.float32)
    if not single:
        out.zero_()
    stager = stager_for(run.device, tiles, chw.shape[0], s, upscaler.out_channels)
    for r, c in tiles:
        check_interrupted()
        x = stager.upload(chw[:, r.win0:r.win1, c.win0:c.win1]).to(run.dtype)
        if run.layout == "nhwc":
            # clone, not .contiguous(): a batch-of-1 view with an odd batch stride passes the contiguity check
            # but not the layout inference of the convolutions, which would then run NCHW
            x = x.clone(memory_format=torch.channels_last)
        y = _crop(upscaler.call(run.module, x, work_bytes), r, c, s)[0]
        del x
        y = y.clamp_(0, 1)
        weight = seam_weight(r, c, s, y.device)  # applied in fp32 (staging: Feathering)
        stager.download(y.permute(1, 2, 0), out[r.keep0 * s:r.keep1 * s, c.keep0 * s:c.keep1 * s], not single,
                        weight)
        del y
        on_tile()
    stager.finish()
    return out


def _upscale_with_retry(run: _Run, chw: torch.Tensor, tile: int, work_bytes: int, progress: BatchProgress,
                        out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, int, int]:
    """``(image, tile, work_bytes)``: the upscaled image and the tile size and work budget it ran with (halved
    after each out-of-memory error; the caller keeps them for the next image)."""
    tried = []
    tile = min(tile, max(chw.shape[1:]))
    while True:
        try:
            y = _upscale_one(run, chw, tile, work_bytes, progress.tick, out)
            progress.image_done()
            return y, tile, work_bytes
        except Exception as exc:  # noqa: BLE001 - only out-of-memory errors (CUDA's or the CPU allocator's) retry
            if not is_out_of_memory(exc):
                raise
            tried.append(tile)
            if tile // 2 < MIN_TILE:
                raise RuntimeError(
                    f"ESRGAN upscale ran out of memory on {run.device} with tile sizes {tried} (overlap "
                    f"{run.overlap}, {run.dtype}, {run.upscaler.arch}); use device='cpu', a smaller tile_overlap, "
                    f"or free memory held by other models") from exc
        # outside the except block, so the failed attempt's tensors (held by the traceback) are gone
        soft_empty_cache()
        logger.warning("ESRGAN upscale: out of memory with tile %d on %s, retrying with tile %d",
                       tile, run.device, tile // 2)
        tile //= 2
        work_bytes //= 2
        progress.restart(_tile_count(run.upscaler, chw.shape[1], chw.shape[2], tile, run.overlap))


def _tile_count(upscaler: Upscaler, h: int, w: int, tile: int, overlap: int) -> int:
    """Tiles of an (already padded) ``h`` x ``w`` image at ``tile`` px: the progress units per image."""
    return len(plan(h, w, min(tile, max(h, w)), overlap, upscaler.multiple_of, upscaler.min_size))


def _pad_to(chw: torch.Tensor, hp: int, wp: int) -> torch.Tensor:
    """Pad [C, H, W] at the bottom/right to [C, hp, wp] as spandrel does: reflection (at most ``side - 1`` rows,
    torch's limit), then edge replication for whatever an image shorter than the alignment still needs."""
    _, h, w = chw.shape
    rh, rw = min(hp - h, h - 1), min(wp - w, w - 1)
    x = F.pad(chw.unsqueeze(0), (0, rw, 0, rh), mode="reflect") if rh or rw else chw.unsqueeze(0)
    if (hp - h - rh) or (wp - w - rw):
        x = F.pad(x, (0, wp - w - rw, 0, hp - h - rh), mode="replicate")
    return x[0]


def _resize(hwc: torch.Tensor, out_h: int, out_w: int) -> torch.Tensor:
    if hwc.shape[0] == out_h and hwc.shape[1] == out_w:
        return hwc
    chw = hwc.permute(2, 0, 1).unsqueeze(0)
    res = F.interpolate(chw, size=(out_h, out_w), mode="bicubic", align_corners=False, antialias=True)
    return res[0].permute(1, 2, 0).clamp_(0, 1)


# --------------------------------------------------------------------------------------------- the batch
def _validate(upscaler, images, output_scale, device, tile_size, tile_overlap, precision) -> None:
    if not isinstance(upscaler, Upscaler):
        raise TypeError(f"upscaler: expected an Upscaler (from load_upscaler), got {type(upscaler).__name__}")
    check_options(images, output_scale, device, tile_size, tile_overlap, precision)
    c = images.shape[-1]
    if c != upscaler.in_channels and not _keeps_alpha(upscaler, c):
        takes = f"{upscaler.in_channels}" + (" (or 4: RGB plus alpha)" if upscaler.in_channels == 3 else "")
        raise ValueError(f"image has {c} channels, {upscaler.arch} takes {takes}; convert the image first")


def _keeps_alpha(upscaler: Upscaler, channels: int) -> bool:
    """An RGBA image into an RGB model: the colour runs through the model, the alpha is resized alongside."""
    return channels == 4 and upscaler.in_channels == 3


def _check_output_fits(upscaler: Upscaler, images: torch.Tensor, output_scale: float) -> None:
    """Refuse, naming ``image``, an output batch the host cannot hold (before the model is placed)."""
    b, h, w, c = images.shape
    scale = output_scale or upscaler.native_output_scale
    oh, ow = max(1, round(h * scale)), max(1, round(w * scale))
    channels = upscaler.out_channels + _keeps_alpha(upscaler, c)
    check_host_bytes(b * oh * ow * channels * 4, "image", f"the upscaled batch ({b} x {ow}x{oh} px, float32)",
                     "upscale fewer or smaller images at a time, or a lower output_scale")


def _sizes(upscaler: Upscaler, device: torch.device, dtype: torch.dtype, h: int, w: int, output_scale: float,
           tile_size: int, overlap: int, work_cap: Optional[int]) -> _Sizes:
    """Padded input, output size, and the first tile size with its work budget (``tile_size`` 0: automatic). Read
    before the model is placed: the budget counts the weights against what is free now."""
    m, least = upscaler.multiple_of, upscaler.min_size
    hp, wp = -(-max(h, least) // m) * m, -(-max(w, least) // m) * m  # padded to the model's minimum and alignment
    budget = work_budget(device, upscaler, dtype)
    if work_cap is not None:
        budget = min(budget, int(work_cap))
    if tile_size:
        tile = tile_size
        win = min(hp, tile + 2 * overlap), min(wp, tile + 2 * overlap)
        work_bytes = max(upscaler.work_bytes(*win, dtype), 1)
    else:
        tile = auto_tile(upscaler, hp, wp, overlap, dtype, budget)
        work_bytes = budget
    scale = output_scale or upscaler.native_output_scale
    out = max(1, round(h * scale)), max(1, round(w * scale))
    return _Sizes((hp, wp), out, tile, work_bytes, _tile_count(upscaler, hp, wp, tile, overlap))


def _upscale_batch(run: _Run, images: torch.Tensor, result: torch.Tensor, sizes: _Sizes,
                   progress: BatchProgress) -> None:
    """Upscale every image of ``images`` into its row of ``result`` (colour channels, then the resized alpha)."""
    upscaler = run.upscaler
    _, h, w, _ = images.shape
    (hp, wp), (out_h, out_w) = sizes.padded, sizes.out
    tile, work_bytes = sizes.tile, sizes.work_bytes
    colour = result[..., :upscaler.out_channels]
    direct = (hp, wp) == (h, w) and (out_h, out_w) == (h * upscaler.scale, w * upscaler.scale)
    for i in range(images.shape[0]):
        chw = images[i, :, :, :upscaler.in_channels].permute(2, 0, 1).to(torch.float32)
        if (hp, wp) != (h, w):
            chw = _pad_to(chw, hp, wp)
        y, tile, work_bytes = _upscale_with_retry(run, chw, tile, work_bytes, progress,
                                                  colour[i] if direct else None)
        if not direct:  # written in place otherwise
            colour[i] = _resize(y[: h * upscaler.scale, : w * upscaler.scale], out_h, out_w)
        del y
        if _keeps_alpha(upscaler, images.shape[-1]):
            result[i, :, :, -1:] = _resize(images[i, :, :, 3:].to(torch.float32), out_h, out_w)


def upscale_images(upscaler: Upscaler, images: torch.Tensor, output_scale: float = 0.0, device: str = "auto",
                   tile_size: int = 0, tile_overlap: int = 32, precision: str = "auto", quiet: bool = False,
                   work_cap: Optional[int] = None, layout: str = "auto",
                   cudnn_benchmark: Optional[bool] = None) -> torch.Tensor:
    """Upscale a [B, H, W, C] image batch; returns a new [B, H', W', C_out] float32 host tensor in 0..1 (plus the
    resized alpha channel when an RGBA image goes into an RGB model).

    ``tile_size`` is the kept core of a tile (0: the largest that fits the working-memory budget, the whole image
    when it fits); ``tile_overlap`` is the context each tile sees beyond its core on every interior side.
    ``work_cap`` lowers the activation budget (bytes) that automatic tiles are sized from and their tail strips
    stay within; with an explicit ``tile_size`` the strips' budget is that window's own estimate. ``layout``:
    "nhwc" runs the convolutions channels-last, "nchw" as written, "auto" (default) channels-last for the
    built-in networks (same numbers, no transpose workspace). ``cudnn_benchmark`` autotunes cuDNN for this call
    only (``None``: ``CUDNN_BENCHMARK``).
    """
    _validate(upscaler, images, output_scale, device, tile_size, tile_overlap, precision)
    _check_output_fits(upscaler, images, output_scale)
    layout = resolve_layout(layout, upscaler)
    dev = choose_device(device, upscaler, tile_overlap)
    dtype = choose_dtype(precision, dev, upscaler)
    b, h, w, c = images.shape
    sizes = _sizes(upscaler, dev, dtype, h, w, output_scale, tile_size, tile_overlap, work_cap)
    logger.info("ESRGAN upscale: %s on %s %s %s, %dx%d x%d, tile %d + %d context (%d tiles/image)",
                upscaler.arch, dev, dtype, layout, w, h, b, sizes.tile, tile_overlap, sizes.tiles_per_image)
    run = _Run(upscaler, _placed_module(upscaler, dev, dtype, layout), dev, dtype, tile_overlap, layout)
    result = torch.empty((b, *sizes.out, upscaler.out_channels + _keeps_alpha(upscaler, c)), dtype=torch.float32)
    benchmark = CUDNN_BENCHMARK if cudnn_benchmark is None else cudnn_benchmark
    try:
        with torch.inference_mode(), _cudnn_benchmark(benchmark, dev), \
                ProgressBar(b * sizes.tiles_per_image, "ESRGAN upscale", quiet) as bar:
            _upscale_batch(run, images, result, sizes, BatchProgress(bar, b, sizes.tiles_per_image))
    except BaseException as exc:  # re-raised: only releases memory the traceback would otherwise pin
        run = result = None  # this frame is still running, so release_frames cannot clear it
        release_frames(exc)
        raise
    return result

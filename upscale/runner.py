"""Tiled ESRGAN inference on the GPU or the CPU, image by image, within a fixed working-memory bound.

Invariants:
- ``images`` ([B, H, W, C] float in 0..1, ComfyUI's IMAGE) and the ``Upscaler`` are never modified; the model
  runs from a private copy when it must change device or dtype.
- Only windows (a tile plus its context, see ``tiling``) ever sit on the GPU; each window is copied into a pinned
  host buffer and sent asynchronously, and each kept result comes back (widened to fp32 on the GPU) through a
  second pinned buffer. Two slots alternate, so the CPU accumulates tile k-1 while the GPU runs tile k. The full
  image and the output live in host memory.
- Feathering: a tile's seam weights (``tiling.axis_weights``) are applied in fp32 (``out += fp32(y) * w``): on the
  GPU before the download there, by the accumulation itself on the CPU. Where the tiles agree the blend gives back
  the model's output up to fp32 rounding, as ComfyUI's ``tiled_scale`` (fp32 masks) does. Applied in fp16/bf16,
  the rounded weights and products did not sum to 1: up to 1.2 8-bit levels off across the seams in bf16 (0.15 in
  fp16) with a pointwise model, 4.5% of the output's 8-bit values changed (session 23). Weighting on the GPU
  (session 24) rather than on the host (session 23) spares the host: an ``addcmul`` that widens a half tile took
  2.5-6.4 ms per 1024x1024x3 tile on a 2-core host, the fp32 add 0.2-0.6 ms (``scripts/diag/
  upscale_host_accumulate.py``), i.e. ~80 ms per 4096 px output against the compact model's 48 ms on an H100. The
  price: fp32 pinned slots and downloads, twice the bytes (H100 times within run-to-run noise of the host way:
  ``docs/bench/upscale-seams-s24/``).
- ``device="cpu"`` never calls into CUDA. ``"auto"`` uses the GPU when torch sees one and (after asking ComfyUI
  to unload its own models) it has room for the weights and a minimal window; otherwise the CPU.
- Out of memory: the tile is halved and the image restarted; below ``MIN_TILE`` a ``RuntimeError`` lists every
  tile size that was tried. Later images of the batch keep the smaller tile, and the progress bar is re-planned
  (it never passes its total). A batch is processed one image at a time, so its peak equals one image's peak.
- Sizes: an image is padded at the bottom/right to the model's smallest accepted side and alignment (spandrel's
  rule, what ComfyUI's own upscale node does: reflection, then edge replication), and the output cropped back.
- Alpha: an RGBA image into an RGB model keeps its alpha. The colour runs through the model; the alpha is resized
  to the output size with the same antialiased bicubic filter as ``output_scale`` (realesrgan-ncnn-vulkan also
  resizes alpha with bicubic; ComfyUI's own upscale node refuses 4 channels with a convolution shape error).
- Layout: ``layout="auto"`` runs the built-in networks channels-last (model copy and windows in NHWC). Same
  arithmetic, other summation order inside the convolutions: equal to NCHW within float rounding (tested). On
  cuDNN fp16 NHWC avoids the transposes (and their workspace) that NCHW half-precision convolutions need for
  tensor cores; on the CPU oneDNN avoids a reorder per layer.
- ``output_scale`` (0 = the model's native scale) resizes the model's output with antialiased bicubic
  interpolation, then clamps to 0..1.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import math
from typing import Optional

import torch
import torch.nn.functional as F

from ..batch import BatchProgress, release_frames
from ..bridge import ProgressBar, check_interrupted, default_device, free_comfy_memory, soft_empty_cache
from .descriptor import Upscaler
from .tiling import Span, axis_weights, largest_keep, largest_window, plan

logger = logging.getLogger(__name__)

DEVICES = ("auto", "gpu", "cpu")
PRECISIONS = ("auto", "fp16", "bf16", "fp32")
MIN_TILE = 32
MAX_TILE = 2048
MAX_OVERLAP = 256
WORK_CAP_GPU = int(1.25 * 2 ** 30)  # activation budget per window on the GPU (weights and staging come on top)
WORK_CAP_CPU = 2 * 2 ** 30
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


# --------------------------------------------------------------------------------------------- choices
def _check_choice(name: str, value, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r}: expected one of {choices}")


def choose_device(device: str, upscaler: Upscaler, overlap: int = 32) -> torch.device:
    """The device for ``device`` in ("auto", "gpu", "cpu"); "cpu" never touches CUDA, and neither does "auto" when
    ComfyUI runs on the CPU (``--cpu``; ``bridge.default_device``)."""
    _check_choice("device", device, DEVICES)
    if device == "cpu" or (device == "auto" and default_device().type == "cpu"):  # auto follows ComfyUI's --cpu
        return torch.device("cpu")
    if not torch.cuda.is_available():
        if device == "gpu":
            raise ValueError("device='gpu' but torch sees no CUDA device; choose 'cpu' or 'auto'")
        return torch.device("cpu")
    dev = torch.device("cuda", torch.cuda.current_device())
    side = MIN_TILE + 2 * overlap
    need = upscaler.weight_bytes(torch.float16) + upscaler.work_bytes(side, side, torch.float16)
    free_comfy_memory(max(need, WORK_CAP_GPU), dev)
    if device == "gpu":
        return dev
    free, _ = torch.cuda.mem_get_info(dev)
    if free >= need:
        return dev
    logger.info("ESRGAN upscale: %.0f MiB free on %s, %.0f MiB needed; running on the CPU",
                free / 2 ** 20, dev, need / 2 ** 20)
    return torch.device("cpu")


def choose_dtype(precision: str, device: torch.device, upscaler: Upscaler) -> torch.dtype:
    """fp16 on the GPU where the architecture allows it (else bf16, else fp32), fp32 on the CPU."""
    _check_choice("precision", precision, PRECISIONS)
    if precision == "auto":
        if device.type == "cpu":
            return torch.float32
        if upscaler.supports_half:
            return torch.float16
        if upscaler.supports_bf16 and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    if precision == "fp16" and not upscaler.supports_half:
        raise ValueError(f"precision='fp16': {upscaler.arch} does not run correctly in fp16; use 'bf16' or 'fp32'")
    if precision == "bf16" and not upscaler.supports_bf16:
        raise ValueError(f"precision='bf16': {upscaler.arch} does not run correctly in bf16; use 'fp32'")
    return _DTYPES[precision]


def work_budget(device: torch.device, upscaler: Upscaler, dtype: torch.dtype) -> int:
    """Activation bytes one window may use: a fixed cap, lowered to 70% of what is free on the GPU."""
    if device.type != "cuda":
        return WORK_CAP_CPU
    free, _ = torch.cuda.mem_get_info(device)
    return int(max(0, min(WORK_CAP_GPU, 0.7 * (free - upscaler.weight_bytes(dtype)))))


def auto_tile(upscaler: Upscaler, height: int, width: int, overlap: int, dtype: torch.dtype, budget: int) -> int:
    """Largest core size whose window (core + 2*overlap) fits ``budget``; the whole image when it fits."""
    if upscaler.work_bytes(height, width, dtype) <= budget:
        return max(height, width)
    per_px = max(upscaler.work_bytes(1, 1, dtype), 1)
    side = int(math.sqrt(budget / per_px)) - 2 * overlap
    return max(MIN_TILE, min(MAX_TILE, side // 8 * 8))


LAYOUTS = ("auto", "nchw", "nhwc")
CUDNN_BENCHMARK = False  # default of upscale_images(cudnn_benchmark=...); see bench/suite_upscale.py


def resolve_layout(layout: str, upscaler: Upscaler) -> str:
    """"auto" -> "nhwc" for networks marked ``channels_last`` (the built-in RRDBNet and SRVGGNetCompact), else
    "nchw" (architectures loaded through spandrel keep the layout they were written for)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: expected one of {LAYOUTS}")
    if layout == "auto":
        return "nhwc" if upscaler.channels_last else "nchw"
    return layout


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


# --------------------------------------------------------------------------------------------- staging
def seam_weight(r: Span, c: Span, scale: int, device: torch.device) -> Optional[torch.Tensor]:
    """[h, w, 1] fp32 feather weights of the tile ``(r, c)``'s kept part on ``device``; None for a tile without
    seams (its weights would all be 1)."""
    if not (r.band_lo or r.band_hi or c.band_lo or c.band_hi):
        return None
    return (axis_weights(r, scale, device)[:, None] * axis_weights(c, scale, device)[None, :]).unsqueeze(-1)


def weighted_fp32(tile_hwc: torch.Tensor, weight: Optional[torch.Tensor]) -> torch.Tensor:
    """A new contiguous fp32 tensor ``fp32(tile_hwc) * weight`` (``weight`` None: just widened), on the tile's
    device: the weight and the product are never rounded to the model's dtype."""
    staged = torch.empty(tile_hwc.shape, dtype=torch.float32, device=tile_hwc.device)
    if weight is None:
        return staged.copy_(tile_hwc)
    return torch.mul(tile_hwc, weight, out=staged)


def _accumulate(dst: torch.Tensor, src: torch.Tensor, accumulate: bool, weight: Optional[torch.Tensor]) -> None:
    """``dst = src`` (one tile: no seams), else ``dst += src * weight`` computed in ``dst``'s dtype (fp32): ``src``
    (the model's dtype) is widened, never the weight or the product rounded to it. ``weight``: [h, w, 1] fp32
    seam weights on the host, or None (a tile without seams, or weighted already)."""
    if not accumulate:
        dst.copy_(src)
    elif weight is None:
        dst.add_(src)
    else:
        dst.addcmul_(src, weight)


class _CpuStager:
    """Plain path: windows are views of the host image, results are added straight into the output."""

    def __init__(self, device: torch.device):
        self.device = device

    def upload(self, window_chw: torch.Tensor) -> torch.Tensor:
        return window_chw.unsqueeze(0).to(self.device)

    def download(self, tile_hwc: torch.Tensor, dst: torch.Tensor, accumulate: bool = True,
                 weight: Optional[torch.Tensor] = None) -> None:
        _accumulate(dst, tile_hwc.to(dst.device), accumulate, weight)

    def finish(self) -> None:
        pass


class _CudaStager:
    """Two pinned slots per direction; the host accumulates tile k-1 while the GPU runs tile k. Tiles are widened
    to fp32 and seam-weighted on the GPU (``weighted_fp32``), so the host only adds fp32 to fp32."""

    def __init__(self, device: torch.device, in_numel: int, out_numel: int):
        self.device = device
        self.inbufs = [torch.empty(in_numel, dtype=torch.float32, pin_memory=True) for _ in range(2)]
        self.outbufs = [torch.empty(out_numel, dtype=torch.float32, pin_memory=True) for _ in range(2)]
        self.pending: list = [None, None]
        self.slot = 0

    def _drain(self, slot: int) -> None:
        item = self.pending[slot]
        if item is not None:
            event, buf, dst, accumulate = item
            event.synchronize()
            _accumulate(dst, buf, accumulate, None)
            self.pending[slot] = None

    def upload(self, window_chw: torch.Tensor) -> torch.Tensor:
        self._drain(self.slot)
        buf = self.inbufs[self.slot][: window_chw.numel()].view(window_chw.shape)
        buf.copy_(window_chw)
        return buf.unsqueeze(0).to(self.device, non_blocking=True)

    def download(self, tile_hwc: torch.Tensor, dst: torch.Tensor, accumulate: bool = True,
                 weight: Optional[torch.Tensor] = None) -> None:
        buf = self.outbufs[self.slot][: tile_hwc.numel()].view(tile_hwc.shape)
        # the fp32 tile is freed on return: the caching allocator reuses it only for later work on this stream
        buf.copy_(weighted_fp32(tile_hwc, weight), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.pending[self.slot] = (event, buf, dst, accumulate)
        self.slot ^= 1
        self._drain(self.slot)  # the previous tile, finished before this one started on the GPU

    def finish(self) -> None:
        self._drain(self.slot)
        self._drain(self.slot ^ 1)


# --------------------------------------------------------------------------------------------- one image
def _crop(t: torch.Tensor, r: Span, c: Span, s: int) -> torch.Tensor:
    return t[:, :, (r.keep0 - r.win0) * s:(r.keep1 - r.win0) * s, (c.keep0 - c.win0) * s:(c.keep1 - c.win0) * s]


def _upscale_one(upscaler: Upscaler, module, chw: torch.Tensor, device: torch.device, dtype: torch.dtype,
                 tile: int, overlap: int, work_bytes: int, on_tile, layout: str = "nchw",
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[C, H, W] host image (aligned to ``multiple_of``) -> [H*s, W*s, C_out] float32 host image, written into
    ``out`` when given. One tile is copied in; several are accumulated into a zeroed output."""
    _, h, w = chw.shape
    s = upscaler.scale
    tiles = plan(h, w, tile, overlap, upscaler.multiple_of, upscaler.min_size)
    single = len(tiles) == 1
    if out is None:
        out = torch.empty((h * s, w * s, upscaler.out_channels), dtype=torch.float32)
    if not single:
        out.zero_()
    if device.type == "cuda":
        wh, ww = largest_window(tiles)
        kh, kw = largest_keep(tiles)
        stager = _CudaStager(device, chw.shape[0] * wh * ww, kh * kw * s * s * upscaler.out_channels)
    else:
        stager = _CpuStager(device)
    for r, c in tiles:
        check_interrupted()
        x = stager.upload(chw[:, r.win0:r.win1, c.win0:c.win1]).to(dtype)
        if layout == "nhwc":
            # clone, not .contiguous(): a batch-of-1 view with an odd batch stride passes the contiguity check
            # but not the layout inference of the convolutions, which would then run NCHW
            x = x.clone(memory_format=torch.channels_last)
        y = _crop(upscaler.call(module, x, work_bytes), r, c, s)[0]
        del x
        y = y.clamp_(0, 1)
        weight = seam_weight(r, c, s, y.device)  # applied in fp32 (module docstring: Feathering)
        stager.download(y.permute(1, 2, 0), out[r.keep0 * s:r.keep1 * s, c.keep0 * s:c.keep1 * s], not single,
                        weight)
        del y
        on_tile()
    stager.finish()
    return out


def _upscale_with_retry(upscaler: Upscaler, module, chw: torch.Tensor, device: torch.device, dtype: torch.dtype,
                        tile: int, overlap: int, work_bytes: int, progress: BatchProgress, layout: str,
                        out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, int, int]:
    """``(image, tile, work_bytes)``: the upscaled image and the tile size and work budget it ran with (halved
    after each out-of-memory error; the caller keeps them for the next image)."""
    tried = []
    tile = min(tile, max(chw.shape[1:]))
    while True:
        try:
            y = _upscale_one(upscaler, module, chw, device, dtype, tile, overlap, work_bytes, progress.tick, layout,
                             out)
            progress.image_done()
            return y, tile, work_bytes
        except torch.OutOfMemoryError as exc:
            tried.append(tile)
            if tile // 2 < MIN_TILE:
                raise RuntimeError(
                    f"ESRGAN upscale ran out of memory on {device} with tile sizes {tried} (overlap {overlap}, "
                    f"{dtype}, {upscaler.arch}); use device='cpu', a smaller tile_overlap, or free memory held "
                    f"by other models") from exc
        # outside the except block, so the failed attempt's tensors (held by the traceback) are gone
        soft_empty_cache()
        logger.warning("ESRGAN upscale: out of memory with tile %d on %s, retrying with tile %d",
                       tile, device, tile // 2)
        tile //= 2
        work_bytes //= 2
        progress.restart(_tile_count(upscaler, chw.shape[1], chw.shape[2], tile, overlap))


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


# --------------------------------------------------------------------------------------------- entry point
def check_options(images, output_scale, device: str, tile_size, tile_overlap, precision: str) -> None:
    """Every check that needs no model: the node runs it before reading the model file."""
    if not isinstance(images, torch.Tensor) or images.ndim != 4 or not images.is_floating_point():
        raise TypeError(f"image: expected a float tensor [B, H, W, C] (ComfyUI IMAGE), got "
                        f"{type(images).__name__} {tuple(getattr(images, 'shape', ()))}")
    if images.shape[0] == 0:
        raise ValueError("image: the batch is empty")
    for name, value, kind in (("output_scale", output_scale, (int, float)), ("tile_size", tile_size, int),
                              ("tile_overlap", tile_overlap, int)):
        if isinstance(value, bool) or not isinstance(value, kind):
            raise TypeError(f"{name}={value!r}: expected {'a number' if kind is not int else 'an int'} "
                            f"(see the node's {name} input)")
    if not (output_scale == 0 or 0.25 <= output_scale <= 16):
        raise ValueError(f"output_scale={output_scale}: use 0 (the model's native scale) or 0.25..16")
    if not (tile_size == 0 or MIN_TILE <= tile_size <= MAX_TILE):
        raise ValueError(f"tile_size={tile_size}: use 0 (automatic) or {MIN_TILE}..{MAX_TILE}")
    if not 0 <= tile_overlap <= MAX_OVERLAP:
        raise ValueError(f"tile_overlap={tile_overlap}: use 0..{MAX_OVERLAP} pixels of context")
    _check_choice("device", device, DEVICES)
    _check_choice("precision", precision, PRECISIONS)


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
    built-in networks (same numbers, faster on cuDNN and oneDNN, no transpose workspace). ``cudnn_benchmark``
    autotunes cuDNN for this call only (``None``: ``CUDNN_BENCHMARK``). Both defaults come from
    bench/suite_upscale.py measurements.
    """
    _validate(upscaler, images, output_scale, device, tile_size, tile_overlap, precision)
    layout = resolve_layout(layout, upscaler)
    if cudnn_benchmark is None:
        cudnn_benchmark = CUDNN_BENCHMARK
    dev = choose_device(device, upscaler, tile_overlap)
    dtype = choose_dtype(precision, dev, upscaler)
    b, h, w, c = images.shape
    alpha = _keeps_alpha(upscaler, c)
    m, least = upscaler.multiple_of, upscaler.min_size
    hp, wp = -(-max(h, least) // m) * m, -(-max(w, least) // m) * m  # padded to the model's minimum and alignment
    budget = work_budget(dev, upscaler, dtype)
    if work_cap is not None:
        budget = min(budget, int(work_cap))
    if tile_size:
        tile = tile_size
        win = min(hp, tile + 2 * tile_overlap), min(wp, tile + 2 * tile_overlap)
        work_bytes = max(upscaler.work_bytes(*win, dtype), 1)
    else:
        tile = auto_tile(upscaler, hp, wp, tile_overlap, dtype, budget)
        work_bytes = budget
    scale = output_scale or upscaler.native_output_scale
    out_h, out_w = max(1, round(h * scale)), max(1, round(w * scale))
    n_tiles = _tile_count(upscaler, hp, wp, tile, tile_overlap)
    logger.info("ESRGAN upscale: %s on %s %s %s, %dx%d x%d, tile %d + %d context (%d tiles/image)",
                upscaler.arch, dev, dtype, layout, w, h, b, tile, tile_overlap, n_tiles)
    module = _placed_module(upscaler, dev, dtype, layout)
    result = torch.empty((b, out_h, out_w, upscaler.out_channels + alpha), dtype=torch.float32)
    colour = result[..., :upscaler.out_channels]
    try:
        with torch.inference_mode(), _cudnn_benchmark(cudnn_benchmark, dev), \
                ProgressBar(b * n_tiles, "ESRGAN upscale", quiet) as bar:
            progress = BatchProgress(bar, b, n_tiles)
            for i in range(b):
                chw = images[i, :, :, :upscaler.in_channels].permute(2, 0, 1).to(torch.float32)
                if (hp, wp) != (h, w):
                    chw = _pad_to(chw, hp, wp)
                direct = (hp, wp) == (h, w) and (out_h, out_w) == (h * upscaler.scale, w * upscaler.scale)
                y, tile, work_bytes = _upscale_with_retry(upscaler, module, chw, dev, dtype, tile, tile_overlap,
                                                          work_bytes, progress, layout, colour[i] if direct else None)
                if not direct:  # written in place otherwise
                    colour[i] = _resize(y[: h * upscaler.scale, : w * upscaler.scale], out_h, out_w)
                del y
                if alpha:
                    result[i, :, :, -1:] = _resize(images[i, :, :, 3:].to(torch.float32), out_h, out_w)
    except BaseException as exc:  # re-raised: only releases memory the traceback would otherwise pin
        module = result = colour = None  # this frame is still running, so release_frames cannot clear it
        release_frames(exc)
        raise
    return result

"""The ESRGAN upscale's options: their validation, and the automatic choices of device, precision, layout,
working-memory budget and tile size.

Invariants:
- ``check_options`` needs no model, so the node runs it before it reads the model file; every error names the
  input, the bad value and the range.
- ``device="cpu"`` never calls into CUDA, and neither does ``"auto"`` when ComfyUI runs on the CPU. ``"auto"``
  uses the GPU when torch sees one and (after asking ComfyUI to unload its own models) it has room for the weights
  and a minimal window; otherwise the CPU.
- Layout: ``"auto"`` runs the built-in networks channels-last (model copy and windows in NHWC). Same arithmetic,
  other summation order inside the convolutions: equal to NCHW within float rounding. On cuDNN fp16 NHWC avoids
  the transposes (and their workspace) that NCHW half-precision convolutions need for tensor cores; on the CPU
  oneDNN avoids a reorder per layer.
- A window's activations stay within the work budget: a fixed cap, on the GPU lowered to 70% of what is free
  once the weights are placed.
- "Free" on the GPU is ``memory.free_vram.free_bytes``, as for the loader, the Stream Scheduler and the tiled VAE:
  the driver's free memory plus this process's cached-but-unused blocks (the allocator hands those out first).
"""
from __future__ import annotations

import logging
import math

import torch

from ..bridge import default_device, free_comfy_memory
from ..memory.finite import refuse_non_finite_input
from ..memory.free_vram import free_bytes
from .descriptor import Upscaler

logger = logging.getLogger(__name__)

DEVICES = ("auto", "gpu", "cpu")
PRECISIONS = ("auto", "fp16", "bf16", "fp32")
LAYOUTS = ("auto", "nchw", "nhwc")
MIN_TILE = 32
MAX_TILE = 2048
MAX_OVERLAP = 256
WORK_CAP_GPU = int(1.25 * 2 ** 30)  # activation budget per window on the GPU (weights and staging come on top)
WORK_CAP_CPU = 2 * 2 ** 30
PIXEL_TOLERANCE = 0.5  # resamplers without a clamp (bicubic, lanczos) overshoot 0..1 a little; 0..255 is far out
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def _check_choice(name: str, value, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r}: expected one of {choices}")


def check_options(images, output_scale, device: str, tile_size, tile_overlap, precision: str) -> None:
    """Every check that needs no model: the node runs it before reading the model file."""
    if not isinstance(images, torch.Tensor) or images.ndim != 4 or not images.is_floating_point():
        raise TypeError(f"image: expected a float tensor [B, H, W, C] (ComfyUI IMAGE), got "
                        f"{type(images).__name__} {tuple(getattr(images, 'shape', ()))}")
    if images.shape[0] == 0:
        raise ValueError("image: the batch is empty")
    if images.shape[1] == 0 or images.shape[2] == 0 or images.shape[3] == 0:
        raise ValueError(f"image: shape {tuple(images.shape)} has no pixels (height, width or channels is 0); "
                         f"connect an IMAGE of at least 1x1 pixels [B, H, W, C]")
    low, high = (float(v) for v in torch.aminmax(images))  # one fused reduction: IMAGE is 0..1; NaN propagates
    if not (math.isfinite(low) and math.isfinite(high)):
        refuse_non_finite_input(images, "image", "find the node upstream that produced them")
    if low < -PIXEL_TOLERANCE or high > 1 + PIXEL_TOLERANCE:
        raise ValueError(f"image: values range over {low:g}..{high:g}, but a ComfyUI IMAGE holds 0..1; divide "
                         f"8-bit (0..255) pixels by 255 before connecting them")
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
    free = free_bytes(dev)
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


def resolve_layout(layout: str, upscaler: Upscaler) -> str:
    """"auto" -> "nhwc" for networks marked ``channels_last`` (the built-in RRDBNet and SRVGGNetCompact), else
    "nchw" (architectures loaded through spandrel keep the layout they were written for)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: expected one of {LAYOUTS}")
    if layout == "auto":
        return "nhwc" if upscaler.channels_last else "nchw"
    return layout


def work_budget(device: torch.device, upscaler: Upscaler, dtype: torch.dtype) -> int:
    """Activation bytes one window may use: a fixed cap, lowered to 70% of what is free on the GPU
    (``free_vram.free_bytes``: cached-but-unused blocks count)."""
    if device.type != "cuda":
        return WORK_CAP_CPU
    free = free_bytes(device)
    return int(max(0, min(WORK_CAP_GPU, 0.7 * (free - upscaler.weight_bytes(dtype)))))


def auto_tile(upscaler: Upscaler, height: int, width: int, overlap: int, dtype: torch.dtype, budget: int) -> int:
    """Largest core size whose window (core + 2*overlap) fits ``budget``; the whole image when it fits."""
    if upscaler.work_bytes(height, width, dtype) <= budget:
        return max(height, width)
    per_px = max(upscaler.work_bytes(1, 1, dtype), 1)
    side = int(math.sqrt(budget / per_px)) - 2 * overlap
    return max(MIN_TILE, min(MAX_TILE, side // 8 * 8))

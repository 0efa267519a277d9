"""Public entry points: tiled VAE decode and encode in ``exact`` or ``blend`` mode, with OOM fallback.

Invariants
- IMAGE / LATENT conventions (GUIDE section 6): ``tiled_decode`` takes raw latents ``[B, C, h, w]`` and returns
  ``[B, 8h, 8w, 3]`` float32 in 0..1 on the CPU; ``tiled_encode`` takes an IMAGE ``[B, H, W, 3]`` (cropped to
  multiples of 8 about the centre, as ComfyUI's VAEEncode does) and returns the latent distribution's mean
  ``[B, C, H/8, W/8]`` float32 on the CPU, in the raw latent space. 8 is the SD VAEs' factor; an autoencoder with
  another number of 2x resamplers (4x, 16x) uses its own (``Program.factor``).
- ``exact``: tiled == untiled up to floating-point error (``exact.py``). ``blend``: the same seamless bands, but the
  GroupNorm after each stage's inner convolution (a ResNet block's norm2) takes whole-image statistics estimated in
  a cheaper pass (``estimated_stats.py``: exact means, variances from a subset of the columns) instead of exact's
  full statistics pass: 0.79-0.88x ``exact``'s FLOPs on the test kit's VAEs, a small diffuse error (mean 0.001-0.002
  of the 0..1 range there) and no seams or tone shifts (tiles with per-tile statistics, cross-faded, were 0.04-0.06
  off on average and cost more than ``exact`` at small tiles: ``docs/vae.md``).
- Memory: tiles are bounded by ``tile_size`` (image pixels; 0 = auto from the free VRAM and, under the loader's
  hard budget, from what the budget leaves: ``activation_budget``).
  On out-of-memory the tile (and the activation budget) is halved and the sample retried, down to 128 px; below
  that a ``torch.OutOfMemoryError`` says what was tried. The batch's later images start from the tile and budget
  that worked. Nothing stays allocated after a failure, and an error (interruption included) returns nothing and
  leaves neither the half-filled batch output nor the failed image's stores referenced by the exception.
- ``overlap`` is validated and ignored: both modes compute their own halo (it was ``blend``'s cross-fade width when
  ``blend`` cross-faded tiles; the input stays so saved workflows load).
- Progress: one bar over the batch, one unit per stage of the VAE per image. A retry
  re-plans it (back to the finished images, out of the new tile's units for the rest), so it never passes its
  total and ends at it.
- The module is never changed; weights are placed by the caller's session (engine) or ComfyUI's loader.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Optional

import torch

from .. import bridge
from ..batch import BatchProgress, release_frames
from ..memory.free_vram import usable_free_bytes
from ..memory.finite import refuse_non_finite_input
from ..memory.host_memory import check_host_bytes
from ..memory.out_of_memory import is_out_of_memory
from .adapters import decoder_program, encoder_program
from .exact import ExactConfig, run_exact
from .program import Op, Program
from .targets import VaeTarget

logger = logging.getLogger(__name__)

SEAM_MODES = ("exact", "blend")
MIN_TILE = 128
MAX_TILE = 4096
_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
_CPU_BUDGET = 4 * 2**30
MIN_ACTIVATION_BYTES = 64 * 2**20
# Device memory an exact tiled decode takes per byte of its activation budget: it allocates about 1.4x its
# estimate, and the bands' and convolutions' buffers differ in size, so freed blocks are not always reusable. Under
# a hard budget the allocator cap (``memory.cap``) returns cached blocks to the driver before the process would
# hold more than the budget, so the factor covers what is allocated with room for the blocks that stay split.
DECODE_RESERVED_FACTOR = 2.2
# Share of the free VRAM (``memory.free_vram.free_bytes``: cached blocks included) a tiled run takes for its
# activations when neither the caller nor a hard budget sizes them.
FREE_SHARE = 0.8


def validate_tiling(tile_size: int, overlap: int, seam_mode: str) -> None:
    """Check the node's tiling inputs; raises ValueError naming the input, the value and the fix."""
    if seam_mode not in SEAM_MODES:
        raise ValueError(f"seam_mode={seam_mode!r}: expected one of {SEAM_MODES}")
    if not isinstance(tile_size, int) or isinstance(tile_size, bool) or tile_size < 0:
        raise ValueError(f"tile_size={tile_size!r}: expected 0 (auto) or an integer number of pixels >= {MIN_TILE}")
    if not isinstance(overlap, int) or isinstance(overlap, bool) or not 0 <= overlap <= 512:
        raise ValueError(f"overlap={overlap!r}: expected an integer number of pixels in 0..512")
    if tile_size and tile_size < MIN_TILE:
        raise ValueError(f"tile_size={tile_size} is below the minimum {MIN_TILE} px; use 0 (auto) or >= {MIN_TILE}")


def activation_budget(target: VaeTarget, budget_bytes: Optional[int] = None) -> int:
    """Device bytes the tiled run may use for activations: the caller's value, else ``FREE_SHARE`` of the free VRAM
    (cached blocks included), and under the loader's hard budget at most what the budget leaves now
    (``target.room``) over ``DECODE_RESERVED_FACTOR`` (at least ``MIN_ACTIVATION_BYTES``). Call inside the
    target's stage (its weights placed)."""
    if budget_bytes is not None:
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes={budget_bytes}: expected a positive number of bytes")
        return int(budget_bytes)
    dev = target.device
    if dev.type != "cuda":
        return _CPU_BUDGET
    budget = usable_free_bytes(dev, FREE_SHARE)
    room = target.room() if target.room is not None else None
    if room is not None:
        budget = min(budget, max(int(room / DECODE_RESERVED_FACTOR), MIN_ACTIVATION_BYTES))
    return budget


def _free_after_oom(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    bridge.soft_empty_cache()


def _run_with_retry(run, tile: int, budget: int, device: torch.device, what: str, on_retry):
    """``(run(tile, budget), tile, budget)``: on out-of-memory the tile and the budget are halved, ``on_retry(tile)``
    is told and the run repeated, down to ``MIN_TILE``; returns the tile and budget that worked (the batch's later
    images start from them)."""
    tried = []
    while True:
        try:
            return run(tile, budget), tile, budget
        except Exception as exc:  # noqa: BLE001 - only out-of-memory errors (CUDA's or the CPU allocator's) retry
            if not is_out_of_memory(exc):
                raise
            tried.append(tile)
            error = str(exc)  # the text only: the exception's traceback would keep the failed attempt's tensors
        _free_after_oom(device)  # outside the except block, so the failed frames' tensors are released
        if tile <= MIN_TILE:
            raise _OOM(f"{what}: out of memory even with {MIN_TILE} px tiles (tried {tried} px, activation budget "
                       f"down to {budget / 2**30:.2f} GiB); free VRAM (unload models) or run it on a larger GPU. "
                       f"Last error: {error}")
        tile, budget = max(MIN_TILE, tile // 2), max(budget // 2, MIN_ACTIVATION_BYTES)
        logger.warning("%s: out of memory; retrying with %d px tiles", what, tile)
        on_retry(tile)


def _run_batch(shape: tuple, run_one, units_for, tile: int, budget: int, device: torch.device, what: str,
               quiet: bool) -> torch.Tensor:
    """A new float32 host tensor of ``shape`` with ``out[i] = run_one(i, tile, budget, tick)`` for every image, under
    one progress bar of ``units_for(tile)`` units per image (``batch.BatchProgress``), each image retried with smaller
    tiles on out-of-memory (``_run_with_retry``). On any error, interruption included, nothing is returned and
    neither the half-filled output nor the failed image's tensors stay referenced by the exception."""
    out = torch.empty(shape, dtype=torch.float32)
    b = shape[0]
    try:
        with bridge.ProgressBar(b * units_for(tile), what[:1].upper() + what[1:], quiet) as bar:
            progress = BatchProgress(bar, b, units_for(tile))
            for i in range(b):
                out[i], tile, budget = _run_with_retry(lambda t, bud, i=i: run_one(i, t, bud, progress.tick), tile,
                                                       budget, device, what, lambda t: progress.restart(units_for(t)))
                progress.image_done()
    except BaseException as exc:  # re-raised: only releases what the traceback would otherwise keep alive
        out = None  # this frame is still running, so release_frames cannot clear it
        release_frames(exc)
        raise
    return out


def _to_image(y: torch.Tensor) -> torch.Tensor:
    return ((y.float() + 1.0) / 2.0).clamp_(0.0, 1.0)


# Where LATENTs of a channel count come from, for the error a mismatched one gets (a hint, not a rule: the VAE's own
# ``latent_channels`` decides what it takes).
_LATENT_ORIGINS = {4: "SD1.x / SD2.x / SDXL models",
                   16: "Z-Image models (the 16-channel Flux VAE) or Qwen-Image models (its own 16-channel VAE)"}


def _latent_origin(channels: int) -> str:
    origin = _LATENT_ORIGINS.get(channels)
    return f" (a {channels}-channel LATENT comes from {origin})" if origin else ""


def _check_latents(latents, channels: int) -> torch.Tensor:
    if not isinstance(latents, torch.Tensor) or latents.ndim != 4:
        raise ValueError(f"samples: expected a LATENT tensor [B, C, h, w], got "
                         f"{getattr(latents, 'shape', type(latents).__name__)}")
    if not latents.is_floating_point():
        raise TypeError(f"samples: expected a floating-point LATENT, got a {latents.dtype} tensor; connect a LATENT "
                        f"from a sampler, VAE encode or EmptyLatentImage (or convert it with .float())")
    if latents.shape[1] != channels:
        raise ValueError(f"samples has {latents.shape[1]} channels but this VAE takes {channels}-channel latents"
                         f"{_latent_origin(latents.shape[1])}; decode it with the VAE of the model that made it, or "
                         f"connect a LATENT made for this VAE (from its model's sampler or its VAE Encode)")
    if latents.shape[2] < 1 or latents.shape[3] < 1:
        raise ValueError(f"samples: empty latent of shape {tuple(latents.shape)}")
    refuse_non_finite_input(latents, "samples", "find the node upstream that produced them (a diverged sampler, "
                            "an fp16 VAE overflow)")
    return latents


def _check_pixels(pixels, channels: int) -> torch.Tensor:
    """An IMAGE: a floating-point tensor [B, H, W, C] in 0..1 with ``channels`` colour channels (+ optional alpha)."""
    if not isinstance(pixels, torch.Tensor) or not pixels.is_floating_point():
        got = f"a {pixels.dtype} tensor" if isinstance(pixels, torch.Tensor) else type(pixels).__name__
        raise TypeError(f"pixels: expected an IMAGE (a float tensor [B, H, W, {channels}] in 0..1), got {got}; "
                        f"convert it with a ComfyUI image node (8-bit values must be divided by 255)")
    if pixels.ndim != 4 or pixels.shape[-1] not in (channels, channels + 1):
        got = f"shape {tuple(pixels.shape)}"
        if pixels.ndim == 4:
            got += f" ({pixels.shape[-1]} channel(s)"
            got += "; channels first?)" if pixels.shape[1] in (channels, channels + 1) else ")"
        raise ValueError(f"pixels: expected an IMAGE [B, H, W, {channels}] (or with alpha, {channels + 1} channels), "
                         f"got {got}; pass an RGB(A) image with the channels on the last axis")
    check_unit_range(pixels, "pixels")
    return pixels


PIXEL_TOLERANCE = 0.5  # resamplers without a clamp (bicubic, lanczos) overshoot 0..1 a little; 0..255 is far out


def check_unit_range(pixels: torch.Tensor, input_name: str) -> None:
    """``ValueError`` when an IMAGE's values leave ``[-PIXEL_TOLERANCE, 1 + PIXEL_TOLERANCE]``: IMAGE is 0..1, and
    0..255 pixels would otherwise encode silently to a white blow-out. One fused min/max reduction."""
    if pixels.numel() == 0:
        return
    low, high = (float(v) for v in torch.aminmax(pixels))  # NaN propagates: one reduction decides both checks
    if not (math.isfinite(low) and math.isfinite(high)):
        refuse_non_finite_input(pixels, input_name, "find the node upstream that produced them")
    if low < -PIXEL_TOLERANCE or high > 1 + PIXEL_TOLERANCE:
        raise ValueError(f"{input_name}: values range over {low:g}..{high:g}, but a ComfyUI IMAGE holds 0..1; "
                         f"divide 8-bit (0..255) pixels by 255 before connecting them")


@torch.no_grad()
def tiled_decode(target: VaeTarget, latents: torch.Tensor, tile_size: int = 0, overlap: int = 64,
                 seam_mode: str = "exact", budget_bytes: Optional[int] = None, quiet: bool = False) -> torch.Tensor:
    """Raw latents [B, C, h, w] -> IMAGE [B, 8h, 8w, 3] (see the module docstring)."""
    validate_tiling(tile_size, overlap, seam_mode)
    program = decoder_program(target.ae)
    latents = _check_latents(latents, program.latent_channels)
    b, _, h, w = latents.shape
    f = program.factor
    check_host_bytes(b * f * h * f * w * program.out_channels * 4, "samples",
                     f"the decoded IMAGE ({b} x {f * w}x{f * h} px, float32)",
                     "decode fewer or smaller latents at a time")
    with target.enter():
        budget = activation_budget(target, budget_bytes)
        estimate = seam_mode == "blend"

        def run_one(i, tile, bud, tick):
            cfg = ExactConfig(target.device, target.dtype, bud, tile, estimate_inner_stats=estimate)
            z = latents[i].detach().float().permute(1, 2, 0).contiguous()
            return run_exact(program, z, cfg, _to_image, program.out_channels, tick)
        tile0, units_for = tile_size or max(f * h, f * w), lambda t: len(program.stages)
        return _run_batch((b, f * h, f * w, program.out_channels), run_one, units_for, tile0, budget, target.device,
                          "tiled VAE decode", quiet)


def _with_input_affine(program: Program) -> Program:
    """``program`` whose first op maps a 0..1 IMAGE to the encoder's -1..1 input (no mutation)."""
    first = program.stages[0]
    if first.residual_src is not None:
        raise TypeError("unsupported encoder: its first stage has a residual connection")
    head = dataclasses.replace(first, ops=[Op("affine", args=(2.0, -1.0))] + list(first.ops))
    return dataclasses.replace(program, stages=[head] + list(program.stages[1:]))


def crop_to_multiple(pixels: torch.Tensor, multiple: int = 8) -> torch.Tensor:
    """Centre-crop an IMAGE [B, H, W, C] to multiples of ``multiple`` (ComfyUI's ``vae_encode_crop_pixels``)."""
    h, w = pixels.shape[1], pixels.shape[2]
    nh, nw = (h // multiple) * multiple, (w // multiple) * multiple
    if (nh, nw) == (h, w):
        return pixels
    oy, ox = (h % multiple) // 2, (w % multiple) // 2
    return pixels[:, oy:oy + nh, ox:ox + nw, :]


@torch.no_grad()
def tiled_encode(target: VaeTarget, pixels: torch.Tensor, tile_size: int = 0, overlap: int = 64,
                 seam_mode: str = "exact", budget_bytes: Optional[int] = None, quiet: bool = False) -> torch.Tensor:
    """IMAGE [B, H, W, 3] -> raw latents (distribution mean) [B, C, H/8, W/8] (see the module docstring)."""
    validate_tiling(tile_size, overlap, seam_mode)
    program = encoder_program(target.ae)
    pixels = _check_pixels(pixels, program.in_channels)
    pixels = pixels[..., :program.in_channels]  # an alpha channel is dropped, as ComfyUI's VAE Encode does
    f = program.factor
    if pixels.shape[1] < f or pixels.shape[2] < f:
        raise ValueError(f"pixels: image {pixels.shape[2]}x{pixels.shape[1]} is smaller than {f}x{f} px, the "
                         f"smallest image this VAE encodes (one latent pixel); enlarge it first")
    pixels = crop_to_multiple(pixels, f)
    b, h, w, _ = pixels.shape
    check_host_bytes(2 * h * w * program.in_channels * 4, "pixels", f"encoding a {w}x{h} px image (float32 copies)",
                     "downscale the image before encoding it")
    lat = program.latent_channels
    enc_program = _with_input_affine(program)
    with target.enter():
        budget = activation_budget(target, budget_bytes)
        estimate = seam_mode == "blend"

        def run_one(i, tile, bud, tick):
            cfg = ExactConfig(target.device, target.dtype, bud, tile, estimate_inner_stats=estimate)
            x = pixels[i].detach().float().contiguous()
            return run_exact(enc_program, x, cfg, lambda y: y[:, :lat].float(), lat, tick).permute(2, 0, 1)
        tile0, units_for = tile_size or max(h, w), lambda t: len(program.stages)
        return _run_batch((b, lat, h // f, w // f), run_one, units_for, tile0, budget, target.device,
                          "tiled VAE encode", quiet)

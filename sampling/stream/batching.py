"""How many images the stream scheduler denoises per UNet batch (``max_batch`` 0 = automatic).

Estimate (bytes, in the UNet's dtype), from the loader's own activation model (``memory/plan.py``):
- per image: the UNet activations of one image's guided step, i.e. ``activation_bytes`` of a ``meta`` trace at
  batch 2 (1 without guidance) and the run's latent size, without the fixed workspace (counted once);
- available: on CUDA the usable free VRAM (``memory.free_vram.usable_free_bytes``) less the workspace; under a hard
  budget (the ``stream`` policy) also at most what the budget leaves for activations
  (``placement.budget.activation_room_bytes``) less the workspace; on the CPU 4 GiB;
- reserved for the decode stage, which runs concurrently: one untiled decode (``decode.untiled_decode_bytes``)
  plus the VAE weights when the policy loads them only while used.
Automatic batch = ``clamp(min((available - reserve) // per_image, saturating, ceil(N / MIN_BATCHES)), 1,
AUTO_BATCH_CAP)``, then evened out over the run (``ceil(N / ceil(N / B))``) so the batches have at most two sizes
(fewer CUDA-graph captures). Why these bounds:
- ``saturating = ceil(SATURATION_ROWS_PX / (copies x latent_h x latent_w))``: batching pays while the UNet call is
  too small to fill the GPU and keeps paying, more slowly, well past a "full" GPU; ~256k latent pixel-rows per call
  (SD1.5 512 px: 32 images, capped at 16; SDXL 1024 px: 8 images).
- A DiT (the Qwen-Image edit) counts image tokens instead: ``saturating_dit_batch`` =
  ``ceil(DIT_SATURATION_TOKENS / (copies x image tokens))``, 16k tokens per call. A guided 1024 px edit (2 x 8192
  noise and reference tokens through 3072-wide layers) keeps a large GPU busy on its own, so batching such calls
  adds memory, not speed: it runs one at a time (512 px: 4 per batch).
- ``MIN_BATCHES`` = 1: the pipeline hides a batch's decode behind the next batch's denoising, but an overlapped
  decode takes SMs from the UNet and one larger batch beats several smaller ones. Runs longer than a batch still
  pipeline: the decode of batch k-1 and the encoding of batch k+1 overlap batch k.
- ``AUTO_BATCH_CAP`` = 16 images bounds the memory of a batch whatever the model.

On out-of-memory the scheduler halves the batch and retries the failed batch; ``shrink`` gives the next size.
"""
from __future__ import annotations

import math
import weakref
from typing import Optional

import torch

from ...memory.engine import LeanEngine
from ...memory.free_vram import usable_free_bytes
from ...memory.plan import WORKSPACE_CUDA, activation_bytes
from ...memory.units import trace_units

AUTO_BATCH_CAP = 16
MIN_BATCHES = 1
SATURATION_ROWS_PX = 64 * 64 * 64
DIT_SATURATION_TOKENS = 16 * 1024
CPU_BUDGET = 4 * 2 ** 30

_PER_IMAGE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def per_image_bytes(engine: LeanEngine, latent_h: int, latent_w: int, guided: bool) -> int:
    """UNet activation bytes of one image's step (see the module docstring); cached per model and shape."""
    key = (latent_h, latent_w, guided, engine.dtype)
    table = _PER_IMAGE.setdefault(engine.parts, {})
    if key not in table:
        units = trace_units(engine.parts.unet, (2 if guided else 1, latent_h, latent_w), engine.dtype)
        elem = torch.empty((), dtype=engine.dtype).element_size()
        table[key] = max(1, activation_bytes(units, elem, "cpu"))
    return table[key]


def available_bytes(engine: LeanEngine) -> int:
    """Device bytes the run may use for activations (see the module docstring)."""
    dev = engine.device
    if dev.type != "cuda":
        return CPU_BUDGET
    avail = usable_free_bytes(dev) - WORKSPACE_CUDA
    budget = engine.placement.budget
    if budget.hard:
        avail = min(avail, budget.activation_room_bytes - WORKSPACE_CUDA)
    return avail


def decode_reserve(engine: LeanEngine, untiled_bytes: int) -> int:
    """Device bytes a concurrent untiled decode needs: its activations plus the VAE weights it brings on."""
    return untiled_bytes + engine.placement.budget.entering_bytes("vae")


def saturating_batch(latent_h: int, latent_w: int, guided: bool) -> int:
    """Images per batch at which the UNet call holds ``SATURATION_ROWS_PX`` latent pixel-rows (at least 1)."""
    return max(1, math.ceil(SATURATION_ROWS_PX / ((2 if guided else 1) * latent_h * latent_w)))


def saturating_dit_batch(image_tokens: int, guided: bool) -> int:
    """Images per batch at which a DiT call holds ``DIT_SATURATION_TOKENS`` image tokens (at least 1);
    ``image_tokens``: one image's noise and reference tokens in one row."""
    return max(1, math.ceil(DIT_SATURATION_TOKENS / ((2 if guided else 1) * max(1, image_tokens))))


def auto_batch(n_images: int, per_image: int, available: int, reserve: int, saturating: int = AUTO_BATCH_CAP) -> int:
    """The automatic batch size (module docstring); always at least 1."""
    fit = (available - reserve) // max(per_image, 1)
    b = int(max(1, min(AUTO_BATCH_CAP, saturating, math.ceil(n_images / MIN_BATCHES), fit)))
    return even_out(n_images, b)


def even_out(n_images: int, batch: int) -> int:
    """The smallest batch size that needs as few batches as ``batch`` does."""
    return math.ceil(n_images / math.ceil(n_images / batch))


def shrink(batch: int) -> Optional[int]:
    """Next batch size after an out-of-memory error at ``batch`` (None: nothing smaller to try)."""
    return batch // 2 if batch > 1 else None

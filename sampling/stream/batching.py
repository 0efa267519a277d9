"""How many images the stream scheduler denoises per UNet batch (``max_batch`` 0 = automatic).

Estimate (bytes, in the UNet's dtype), from the loader's own activation model (``memory/plan.py``):
- per image: the UNet activations of one image's guided step, i.e. ``activation_bytes`` of a ``meta`` trace at
  batch 2 (1 without guidance) and the run's latent size, without the fixed workspace (counted once);
- available: on CUDA ``0.9 x (free VRAM + this process's cached-but-unused memory) - workspace``; under the
  ``stream`` policy also at most the loader's budget minus the UNet's resident weights, the loader's headroom and
  the workspace (``budget_left_bytes``; measured on an H100, SDXL 1024 px at 4 GiB: without the headroom and the
  workspace it chose 2 images and the UNet stage held 4.22 GiB, with 1 image 3.66 GiB); on the CPU 4 GiB;
- reserved for the decode stage, which runs concurrently: one untiled decode (``decode.untiled_decode_bytes``)
  plus the VAE weights when the policy loads them only while used.
Automatic batch = ``clamp(min((available - reserve) // per_image, saturating, ceil(N / MIN_BATCHES)), 1,
AUTO_BATCH_CAP)``, then evened out over the run (``ceil(N / ceil(N / B))``) so the batches have at most two sizes
(fewer CUDA-graph captures). Why these bounds:
- ``saturating = ceil(SATURATION_ROWS_PX / (copies x latent_h x latent_w))``: batching pays while the UNet call is
  too small to fill the GPU and stops paying once it is full. Measured on an H200 (fp16, CUDA graphs, 2026-11-22)
  it still pays well past what a "full" GPU suggests: SDXL 1024 px per image-step 41.7 ms at 1 image, 37.2 at 2,
  36.0 at 4, 34.4 at 8; SD1.5 512 px, 16 prompts, throughput 1.94x the prompt-by-prompt path in one batch of 16
  against 1.91x in two of 8. Hence ~256k latent pixel-rows per call (SD1.5 512 px: 32 images, capped at 16; SDXL
  1024 px: 8 images).
- ``MIN_BATCHES`` = 1: the pipeline hides a batch's decode behind the next batch's denoising, but an overlapped
  decode takes SMs from the UNet and the larger batch wins: SDXL 8 prompts x 30 steps ran 1.20x the
  prompt-by-prompt path in one batch of 8, 1.16x as [6, 2], 1.14x as [7, 1] and 1.15x as [2, 2, 2, 2] (same run).
  Runs longer than a batch still pipeline: the decode of batch k-1 and the encoding of batch k+1 overlap batch k.
- ``AUTO_BATCH_CAP`` = 16 images bounds the memory of a batch whatever the model.

On out-of-memory the scheduler halves the batch and retries the failed batch; ``shrink`` gives the next size.
"""
from __future__ import annotations

import math
import weakref
from typing import Optional

import torch

from ...memory.budget import budgeted_plan
from ...memory.engine import LeanEngine
from ...memory.plan import WORKSPACE_CUDA, activation_bytes
from ...memory.policies import HEADROOM
from ...memory.streaming import trace_units

AUTO_BATCH_CAP = 16
MIN_BATCHES = 1
SATURATION_ROWS_PX = 64 * 64 * 64
CPU_BUDGET = 4 * 2 ** 30
FREE_FRACTION = 0.9

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
    free, _ = torch.cuda.mem_get_info(dev)
    cached = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
    avail = int(FREE_FRACTION * (free + cached)) - WORKSPACE_CUDA
    plan = budgeted_plan(engine)
    if plan is not None:
        avail = min(avail, budget_left_bytes(plan) - WORKSPACE_CUDA)
    return avail


def budget_left_bytes(plan) -> int:
    """What a budgeted plan leaves for activations: the budget minus the UNet's resident weights and the loader's
    headroom (``policies.HEADROOM``). The loader sizes the resident weights so that one image's guided step
    (activations + workspace) fits in it; more images per batch fit only where the loader streamed everything."""
    return plan.budget_bytes - unet_resident_bytes(plan) - int(HEADROOM * plan.budget_bytes)


def unet_resident_bytes(plan) -> int:
    """The UNet weights (fixed, resident blocks, staging arena) that stay on the device under ``plan``."""
    return plan.peaks.get("unet", 0) - plan.unet_activation_bytes


def decode_reserve(engine: LeanEngine, untiled_bytes: int) -> int:
    plan = getattr(engine.placement, "plan", None)
    weights = plan.vae_bytes if plan is not None and getattr(plan, "vae_mode", "") == "while used" else 0
    return untiled_bytes + weights


def saturating_batch(latent_h: int, latent_w: int, guided: bool) -> int:
    """Images per batch at which the UNet call holds ``SATURATION_ROWS_PX`` latent pixel-rows (at least 1)."""
    return max(1, math.ceil(SATURATION_ROWS_PX / ((2 if guided else 1) * latent_h * latent_w)))


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

"""VRAM policies: one public ``apply_vram_policy`` -> the engine's ``placement`` (GUIDE convention 5).

Policies (what lives on the device, per stage):
- ``full``: every module resident.
- ``balanced``: UNet resident; text encoders and VAE on the device only while their stage runs.
- ``lowvram``: UNet resident; text encoders on the CPU in fp32 (only embeddings move); VAE on the device only
  while decoding.
- ``stream``: UNet split into a resident set filling ``vram_budget_gb`` minus the activation/workspace estimate
  and a streamed rest (``memory/stream_schedule.py``, ``memory/streaming.py``); text encoders on the device while
  used if they fit next to the UNet's resident set inside the budget, else streamed block by block when they can
  (a Qwen3 encoder, a Qwen2.5-VL's language model and vision tower, ``memory/text_units.py``), else on the CPU; VAE on the device only while used. The budget is a
  hard limit on every stage of every node (``memory/budget.py``).
- ``auto``: the fastest of full > balanced > lowvram > stream whose estimated peak fits the usable free VRAM
  (``memory/free_vram.py``; on the CPU: ``full``).

Invariants
- ``apply_vram_policy`` validates everything and computes the plan (``memory/planner.py``, on the ``meta`` device,
  no allocation) before touching a module; the placement (``memory/placement.py``) then moves the weights and
  exposes the typed budget (``placement.budget``, ``memory/vram_budget.py``) that samplers, VAE and the Stream
  Scheduler read.
- Every policy computes with the same weights in the same dtype, so a UNet call gives the same result under every
  policy (on the CPU, bit-identical).

Why hand-written: accelerate's hooks (behind diffusers' ``enable_model_cpu_offload`` /
``enable_sequential_cpu_offload``) move weights with per-tensor ``.to()`` copies in both directions and keep no
budget across stages; diffusers' group offloading streams layer groups but takes no memory budget (one chooses
group sizes, not bytes). A stage entry here is one flat pinned copy, an exit a pointer swap, and one budget holds
every stage.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .. import bridge
from .engine import ModelParts
from .families import family_defaults
from .placement import ModelPlacement
from .plan import GiB
from .planner import plan_placement, working_minimum_bytes
from .policy_config import DTYPES, PolicyConfig, VramPolicy


def check_policy_args(policy: str | VramPolicy, vram_budget_gb: float) -> VramPolicy:
    """The policy named by ``policy``; ``ValueError`` naming the input when it or ``vram_budget_gb`` is unusable.
    Needs no model, so the loader calls it before reading a checkpoint (a typo must not cost a multi-GB read)."""
    try:
        requested = VramPolicy(policy)
    except ValueError as exc:
        raise ValueError(f"vram_policy={policy!r}: expected one of {[p.value for p in VramPolicy]}") from exc
    if isinstance(vram_budget_gb, bool) or not isinstance(vram_budget_gb, (int, float)) or not vram_budget_gb > 0 \
            or not math.isfinite(vram_budget_gb):
        raise ValueError(f"vram_budget_gb={vram_budget_gb!r}: expected a positive number of GB")
    return requested


def default_dtype(family: str, device: torch.device) -> torch.dtype:
    """The weight dtype ``auto`` means: fp32 on the CPU; on CUDA the family's ``default_dtype`` (bf16 for the DiTs,
    whose activations overflow fp16), else fp16."""
    if torch.device(device).type != "cuda":
        return torch.float32
    return DTYPES[family_defaults(family).get("default_dtype", "fp16")]


def default_working_shape(parts: ModelParts) -> tuple[int, int, int]:
    """(batch, latent_h, latent_w) the activation estimate assumes: batch 2 (guidance) at the family's native
    size (a UNet's ``sample_size``; a DiT's ``native_px / 8``)."""
    size = getattr(parts.unet.config, "sample_size", None)
    if size is None:
        size = family_defaults(parts.family)["native_px"] // 8
    return (2, int(size), int(size))


def apply_vram_policy(parts: ModelParts, policy: str | VramPolicy = "auto", *, device=None,
                      vram_budget_gb: float = 4.0, dtype: Optional[torch.dtype] = None,
                      vae_dtype: Optional[torch.dtype] = None, working_shape: Optional[tuple] = None,
                      free_vram_bytes: Optional[int] = None, name: str = "") -> "ModelPlacement":
    """Place ``parts`` on ``device`` under ``policy`` and return the placement (the engine's ``placement``).

    ``dtype``: UNet/text weights (default fp16 on CUDA, fp32 on the CPU); ``vae_dtype``: default fp32 where the
    family's VAE overflows in fp16 (SDXL) or on the CPU, else ``dtype``. ``working_shape``: (batch, latent_h,
    latent_w) the activation estimate assumes (default: batch 2 at the UNet's native ``sample_size``).
    ``free_vram_bytes``: the free memory ``auto`` plans against (default: ``free_vram.free_bytes`` of the device).
    """
    if not isinstance(parts, ModelParts):
        raise TypeError(f"parts: expected a ModelParts, got {type(parts).__name__}")
    requested = check_policy_args(policy, vram_budget_gb)
    dev = torch.device(device) if device is not None else bridge.default_device()
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: CUDA is not available in this process; use device='cpu'")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    for arg, value in (("dtype", dtype), ("vae_dtype", vae_dtype)):
        if value is not None and value not in DTYPES.values():
            raise ValueError(f"{arg}={value!r}: expected torch.float16, torch.bfloat16 or torch.float32")
    dtype = dtype or default_dtype(parts.family, dev)
    if vae_dtype is None:
        overflows = family_defaults(parts.family)["vae_fp16_overflows"]
        vae_dtype = torch.float32 if (dev.type == "cpu" or (overflows and dtype == torch.float16)) else dtype
    if working_shape is None:
        working_shape = default_working_shape(parts)
    if len(working_shape) != 3 or any(int(v) < 1 for v in working_shape):
        raise ValueError(f"working_shape={working_shape!r}: expected (batch, latent_h, latent_w) of positive ints")
    config = PolicyConfig(requested if requested != VramPolicy.AUTO else VramPolicy.FULL, requested, dev, dtype,
                          dtype, vae_dtype, int(vram_budget_gb * GiB), tuple(int(v) for v in working_shape))
    planned = plan_placement(parts, config, free_vram_bytes, name or parts.name)
    return ModelPlacement(parts, planned.config, planned.plan, planned.budget, planned.schedule, planned.text_schedule,
                          planned.vision_schedule)


def stream_working_minimum_gb(parts: ModelParts, device=None, dtype: Optional[torch.dtype] = None,
                              working_shape: Optional[tuple] = None) -> float:
    """The smallest ``vram_budget_gb`` the ``stream`` policy accepts for ``parts`` (same estimate as the plan)."""
    dev = torch.device(device) if device is not None else bridge.default_device()
    dtype = dtype or default_dtype(parts.family, dev)
    if working_shape is None:
        working_shape = default_working_shape(parts)
    return working_minimum_bytes(parts, dev, dtype, tuple(working_shape)) / GiB

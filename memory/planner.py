"""Planning a VRAM policy before any weight moves: where each stage's weights live, the estimated peak per stage,
the streaming schedule (``stream``) and the typed budget the placement exposes.

Per policy (``T``, ``U``, ``V``: text, UNet, VAE weight bytes; ``act``: the UNet activation estimate, ``plan.py``):
- ``full``: everything resident; peak ``T + U + V + act``.
- ``balanced``: UNet resident, text and VAE on the device while used; peaks ``U + T``, ``U + act``, ``U + V``.
- ``lowvram``: as ``balanced`` with the text encoders on the CPU in fp32.
- ``stream``: the UNet's resident set fills ``budget - act - always-resident - headroom`` (``stream_schedule.py``),
  the rest streams; text encoders on the device while used when they fit beside the resident set, else on the CPU.
  A budget below the working minimum (``stream_minimum_bytes``) is refused with that number.
- ``auto``: the first of full > balanced > lowvram whose peak fits ``free_vram.usable_free_bytes``, else ``stream``
  at that many bytes (on the CPU: ``full``).

Planning runs on the ``meta`` device (``unet_units.trace_units``): it allocates nothing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import torch

from .engine import ModelParts, modules_of_stage
from .fp8_weights import storage_name
from .free_vram import FREE_FRACTION, usable_free_bytes
from .plan import GiB, MemoryPlan, activation_bytes, gb, module_bytes
from .policy_config import PolicyConfig, VramPolicy, dtype_name
from .stream_schedule import StreamSchedule, minimum_arena_bytes, plan_schedule
from .units import trace_units
from .vram_budget import HEADROOM, StageMode, VramBudget


@dataclass(frozen=True)
class PolicyPlan:
    """What ``apply_vram_policy`` places from: the resolved config, the report, the typed budget, the schedule."""

    config: PolicyConfig
    plan: MemoryPlan
    budget: VramBudget
    schedule: Optional[StreamSchedule]


def plan_placement(parts: ModelParts, config: PolicyConfig, free: Optional[int], name: str) -> PolicyPlan:
    """Trace the UNet at the working shape, resolve ``auto`` against ``free`` bytes (default: the device's usable
    free memory) and plan the resolved policy."""
    units = trace_units(parts.unet, config.working_shape, config.dtype)
    elem = torch.empty((), dtype=config.dtype).element_size()
    act = activation_bytes(units, elem, config.device.type)
    sizes = dict(text=sum(module_bytes(m, config.dtype) for m in modules_of_stage(parts, "text")),
                 unet=module_bytes(parts.unet, config.dtype), vae=module_bytes(parts.vae, config.vae_dtype))
    if config.requested == VramPolicy.AUTO:
        config = _resolve_auto(parts, config, units, act, sizes, free)
    return plan_policy(parts, config, units, act, sizes, name)


def _resolve_auto(parts, config: PolicyConfig, units, act: int, sizes: dict, free: Optional[int]) -> PolicyConfig:
    if config.device.type != "cuda":
        return replace(config, policy=VramPolicy.FULL)
    usable = usable_free_bytes(config.device) if free is None else int(free * FREE_FRACTION)
    for pol in (VramPolicy.FULL, VramPolicy.BALANCED, VramPolicy.LOWVRAM):
        cand = replace(config, policy=pol)
        if plan_policy(parts, cand, units, act, sizes, "").plan.peak_bytes <= usable:
            return cand
    return replace(config, policy=VramPolicy.STREAM, budget_bytes=min(config.budget_bytes, usable))


def plan_policy(parts, config: PolicyConfig, units, act: int, sizes: dict, name: str) -> PolicyPlan:
    """The plan of ``config.policy`` (never AUTO) from the traced ``units``, the activation estimate ``act`` and
    the stages' weight ``sizes`` (module docstring)."""
    T, U, V = sizes["text"], sizes["unet"], sizes["vae"]
    pol = config.policy
    text_dtype = config.dtype
    schedule, stream_fields = None, {}
    if pol == VramPolicy.FULL:
        text, vae, resident = StageMode.RESIDENT, StageMode.RESIDENT, T + U + V
        peaks = {"text": T + U + V, "unet": T + U + V + act, "vae": T + U + V}
    elif pol == VramPolicy.BALANCED:
        text, vae, resident = StageMode.WHILE_USED, StageMode.WHILE_USED, U
        peaks = {"text": U + T, "unet": U + act, "vae": U + V}
    elif pol == VramPolicy.LOWVRAM:
        text, vae, resident = StageMode.CPU, StageMode.WHILE_USED, U
        peaks = {"text": U, "unet": U + act, "vae": U + V}
    else:
        schedule, resident, stream_fields = _stream_schedule(config, units, act, U)
        text = StageMode.WHILE_USED if resident + T <= config.budget_bytes else StageMode.CPU
        vae = StageMode.WHILE_USED
        peaks = {"text": resident + (T if text is StageMode.WHILE_USED else 0), "unet": resident + act,
                 "vae": resident + V}
    if text is StageMode.CPU:
        text_dtype = torch.float32
    stream = pol == VramPolicy.STREAM
    unet = StageMode.STREAM if stream else StageMode.RESIDENT
    plan = MemoryPlan(policy=pol.value, requested=config.requested.value, device=str(config.device), model=name,
                      family=parts.family, dtype=dtype_name(config.dtype), vae_dtype=dtype_name(config.vae_dtype),
                      text_dtype=dtype_name(text_dtype), budget_bytes=config.budget_bytes,
                      working_shape=config.working_shape, text_mode=text.value, vae_mode=vae.value,
                      unet_mode=unet.value, text_bytes=T, unet_bytes=U, vae_bytes=V, unet_activation_bytes=act,
                      total_units=len(units), peaks=peaks,
                      unet_storage=storage_name(getattr(parts, "unet", None)) or "", **stream_fields)
    budget = VramBudget(limit_bytes=config.budget_bytes if stream else None,
                        headroom_bytes=int(HEADROOM * config.budget_bytes) if stream else 0,
                        resident_bytes=resident, streamed_bytes=schedule.streamed_bytes if schedule else 0,
                        activation_bytes=act, text_bytes=T, vae_bytes=V, text=text, vae=vae, unet=unet)
    return PolicyPlan(config, plan, budget, schedule)


def _stream_schedule(config: PolicyConfig, units, act: int, unet_bytes: int) -> tuple:
    """(schedule, UNet bytes resident on the device, the plan's stream fields) under ``config.budget_bytes``."""
    fixed = unet_bytes - sum(u.nbytes for u in units)
    minimum = stream_minimum_bytes(units, act, unet_bytes)
    if config.budget_bytes < minimum:
        raise ValueError(
            f"vram_budget_gb={config.budget_bytes / GiB:.4g} is below the working minimum of "
            f"{ceil_gb(minimum)} GB for this model under 'stream' (activations+workspace {gb(act)}, always-"
            f"resident weights {gb(fixed)}, staging {gb(minimum_arena_bytes(units))} at latent "
            f"{config.working_shape[1]}x{config.working_shape[2]}, batch {config.working_shape[0]}); raise "
            f"vram_budget_gb to at least {ceil_gb(minimum)}")
    schedule = plan_schedule(units, config.budget_bytes - act - fixed - int(HEADROOM * config.budget_bytes))
    resident = fixed + schedule.resident_unit_bytes + schedule.arena_bytes
    notes = () if schedule.streamed else ("the whole UNet fits the budget: nothing streams",)
    est = schedule.est_step_s * 1e3 if config.device.type == "cuda" else None
    fields = dict(unet_fixed_bytes=fixed, unet_resident_bytes=schedule.resident_unit_bytes,
                  unet_streamed_bytes=schedule.streamed_bytes, arena_bytes=schedule.arena_bytes,
                  streamed_units=len(schedule.streamed), est_step_ms=est,
                  est_compute_ms=schedule.est_compute_s * 1e3 if est is not None else None, notes=notes)
    return schedule, resident, fields


def stream_minimum_bytes(units, act: int, unet_bytes: int) -> int:
    """The smallest budget ``stream`` accepts: activations + always-resident weights + the minimum staging arena,
    over ``1 - HEADROOM``."""
    fixed = unet_bytes - sum(u.nbytes for u in units)
    return int((act + fixed + minimum_arena_bytes(units)) / (1 - HEADROOM)) + 1


def ceil_gb(n: int) -> str:
    """``n`` bytes in GB, rounded *up* at 4 significant digits (so the number quoted is enough)."""
    v = n / GiB
    digits = 4 - int(math.floor(math.log10(v))) - 1 if v > 0 else 4
    return f"{math.ceil(v * 10 ** digits) / 10 ** digits:.{max(digits, 0)}f}"

"""Planning a VRAM policy before any weight moves: where each stage's weights live, the estimated peak per stage,
the streaming schedules (``stream``) and the typed budget the placement exposes.

Per policy (``T``, ``U``, ``V``: text, UNet, VAE weight bytes; ``act``: the UNet activation estimate, ``plan.py``;
``ta``: a streamable text encoder's activation estimate, ``text_units.py``, else 0):
- ``full``: everything resident; peaks ``T + U + V + ta``, ``T + U + V + act``, ``T + U + V``.
- ``balanced``: UNet resident, text and VAE on the device while used; peaks ``U + T + ta``, ``U + act``, ``U + V``.
- ``lowvram``: as ``balanced`` with the text encoders on the CPU in fp32.
- ``stream``: the UNet's resident set fills ``budget - room - always-resident - headroom`` (``stream_schedule.py``),
  the rest streams; ``room`` is what the other stages need beside it. First ``room = act``: the text encoders go on
  the device while used when ``resident + T + ta`` fits the budget. Otherwise a text encoder that streams
  (``text_units.py``: Qwen3, Qwen2.5-VL's language model; a Qwen2.5-VL's vision tower through a smallest ring of its
  own, ``vision_units.py``) streams block by block through a ring held only while its stage runs, the UNet planned
  again with ``room = max(act, text ring + ta)`` and the encoder's norm always resident (or, where that costs the
  UNet less, stays whole with ``room = T + ta``); encoders that cannot stream (CLIP) run on the CPU. With bf16
  weights on CUDA the rings of stages whose steps wait on their copies (``stream_schedule.copy_bound``) carry
  packed staging slots (``packed_weights.py``): their streamed weights cross packed, losslessly.
  A budget below the working minimum (``stream_minimum_bytes``) is refused with that number.
- ``auto``: the first of full > balanced > lowvram whose peak fits ``free_vram.usable_free_bytes``, else ``stream``
  at that many bytes (on the CPU: ``full``).
A family whose ``families.json`` row lists ``vram_policies`` is refused under any other (``check_family_policy``),
requested or chosen by ``auto``, before anything is placed. Its ``reference_images`` and ``text_tokens`` widen the
working shapes the estimates assume (``plan_inputs``).

Planning runs on the ``meta`` device (``unet_units.trace_units``): it allocates nothing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import torch

from .engine import ModelParts, modules_of_stage
from .families import family_defaults
from .fp8_weights import storage_name
from .free_vram import FREE_FRACTION, usable_free_bytes
from .packed_weights import slot_bytes_for, slot_fraction
from .plan import GiB, MemoryPlan, activation_bytes, gb, module_bytes
from .policy_config import PolicyConfig, VramPolicy, dtype_name
from .stream_schedule import StreamSchedule, copy_bound, minimum_arena_bytes, plan_all_streamed, plan_schedule
from .text_units import TEXT_TOKENS, TextStream, text_stream
from .units import trace_units
from .vram_budget import HEADROOM, StageMode, VramBudget


@dataclass(frozen=True)
class PolicyPlan:
    """What ``apply_vram_policy`` places from: the resolved config, the report, the typed budget, the schedules."""

    config: PolicyConfig
    plan: MemoryPlan
    budget: VramBudget
    schedule: Optional[StreamSchedule]
    text_schedule: Optional[StreamSchedule] = None  # a streamed text encoder's (``stream``), else None
    vision_schedule: Optional[StreamSchedule] = None  # its vision tower's, when it has one (``vision_units.py``)


@dataclass(frozen=True)
class _Stream:
    schedule: StreamSchedule
    text_schedule: Optional[StreamSchedule]
    vision_schedule: Optional[StreamSchedule]
    resident: int
    text: StageMode
    peaks: dict
    fields: dict


def plan_inputs(parts: ModelParts, dtype: torch.dtype, vae_dtype: torch.dtype, device_type: str,
                working_shape: tuple) -> tuple:
    """(units, act, sizes, text): the UNet's units and activation estimate at ``working_shape``, the stages' weight
    bytes, and the text stage's streaming numbers (``None`` when its encoders cannot stream). The family's
    ``families.json`` row may widen both working shapes: ``reference_images`` (reference latents an edit family
    packs beside the image tokens, ``qwen_units.py``), ``dit_text_tokens`` (the prompt rows a DiT call sees, when
    not the denoiser's default) and ``text_tokens`` (the longest prompt its sampler encodes, template included;
    default ``text_units.TEXT_TOKENS``)."""
    defaults = family_defaults(parts.family)
    units = trace_units(parts.unet, working_shape, dtype, int(defaults.get("reference_images", 0)),
                        defaults.get("dit_text_tokens"))
    act = activation_bytes(units, torch.empty((), dtype=dtype).element_size(), device_type)
    encoders = modules_of_stage(parts, "text")
    sizes = dict(text=sum(module_bytes(m, dtype) for m in encoders), unet=module_bytes(parts.unet, dtype),
                 vae=module_bytes(parts.vae, vae_dtype))
    tokens = int(defaults.get("text_tokens", TEXT_TOKENS))
    return units, act, sizes, text_stream(encoders, dtype, int(working_shape[0]), device_type, tokens)


def plan_placement(parts: ModelParts, config: PolicyConfig, free: Optional[int], name: str) -> PolicyPlan:
    """Trace the UNet at the working shape, resolve ``auto`` against ``free`` bytes (default: the device's usable
    free memory) and plan the resolved policy."""
    units, act, sizes, text = plan_inputs(parts, config.dtype, config.vae_dtype, config.device.type,
                                          config.working_shape)
    if config.requested == VramPolicy.AUTO:
        config = _resolve_auto(parts, config, units, act, sizes, free, text)
    check_family_policy(parts.family, config)
    return plan_policy(parts, config, units, act, sizes, name, text)


def check_family_policy(family: str, config: PolicyConfig) -> None:
    """``ValueError`` naming ``vram_policy`` when ``family`` does not run under the (resolved) policy yet (its
    ``vram_policies`` in ``families.json``; every policy when it lists none)."""
    allowed = family_defaults(family).get("vram_policies")
    if allowed is None or config.policy.value in allowed:
        return
    chosen = f"'auto' chose '{config.policy.value}' (too little free VRAM for the others)" \
        if config.requested == VramPolicy.AUTO else f"'{config.policy.value}'"
    raise ValueError(f"vram_policy={config.requested.value!r}: {chosen} is not supported yet for {family}; use "
                     f"one of {', '.join(repr(p) for p in allowed)}")


def _resolve_auto(parts, config: PolicyConfig, units, act: int, sizes: dict, free: Optional[int],
                  text: Optional[TextStream]) -> PolicyConfig:
    if config.device.type != "cuda":
        return replace(config, policy=VramPolicy.FULL)
    usable = usable_free_bytes(config.device) if free is None else int(free * FREE_FRACTION)
    for pol in (VramPolicy.FULL, VramPolicy.BALANCED, VramPolicy.LOWVRAM):
        cand = replace(config, policy=pol)
        if plan_policy(parts, cand, units, act, sizes, "", text).plan.peak_bytes <= usable:
            return cand
    return replace(config, policy=VramPolicy.STREAM, budget_bytes=min(config.budget_bytes, usable))


def plan_policy(parts, config: PolicyConfig, units, act: int, sizes: dict, name: str,
                text: Optional[TextStream] = None) -> PolicyPlan:
    """The plan of ``config.policy`` (never AUTO) from the traced ``units``, the activation estimate ``act``, the
    stages' weight ``sizes`` and the text stage's streaming numbers ``text`` (module docstring)."""
    T, U, V = sizes["text"], sizes["unet"], sizes["vae"]
    ta = text.activation_bytes if text is not None else 0
    pol = config.policy
    planned = None
    if pol == VramPolicy.FULL:
        text_mode, vae, resident = StageMode.RESIDENT, StageMode.RESIDENT, T + U + V
        peaks = {"text": T + U + V + ta, "unet": T + U + V + act, "vae": T + U + V}
    elif pol == VramPolicy.BALANCED:
        text_mode, vae, resident = StageMode.WHILE_USED, StageMode.WHILE_USED, U
        peaks = {"text": U + T + ta, "unet": U + act, "vae": U + V}
    elif pol == VramPolicy.LOWVRAM:
        text_mode, vae, resident = StageMode.CPU, StageMode.WHILE_USED, U
        peaks = {"text": U, "unet": U + act, "vae": U + V}
    else:
        planned = _plan_stream(config, units, act, sizes, text, _slot_fractions(parts, config, units, text))
        text_mode, vae, resident, peaks = planned.text, StageMode.WHILE_USED, planned.resident, planned.peaks
    stream = pol == VramPolicy.STREAM
    text_dtype = torch.float32 if text_mode is StageMode.CPU else config.dtype
    ta = ta if text_mode is not StageMode.CPU else 0
    schedule = planned.schedule if planned else None
    text_schedule = planned.text_schedule if planned else None
    vision_schedule = planned.vision_schedule if planned else None
    text_arena = sum(s.arena_bytes for s in (text_schedule, vision_schedule) if s is not None)
    plan = MemoryPlan(policy=pol.value, requested=config.requested.value, device=str(config.device), model=name,
                      family=parts.family, dtype=dtype_name(config.dtype), vae_dtype=dtype_name(config.vae_dtype),
                      text_dtype=dtype_name(text_dtype), budget_bytes=config.budget_bytes,
                      working_shape=config.working_shape, text_mode=text_mode.value, vae_mode=vae.value,
                      unet_mode=(StageMode.STREAM if stream else StageMode.RESIDENT).value, text_bytes=T,
                      unet_bytes=U, vae_bytes=V, unet_activation_bytes=act, total_units=len(units), peaks=peaks,
                      text_activation_bytes=ta, text_tokens=text.tokens if text is not None else 0,
                      unet_storage=storage_name(getattr(parts, "unet", None)) or "",
                      **(planned.fields if planned else {}))
    budget = VramBudget(limit_bytes=config.budget_bytes if stream else None,
                        headroom_bytes=int(HEADROOM * config.budget_bytes) if stream else 0,
                        resident_bytes=resident, streamed_bytes=schedule.streamed_bytes if schedule else 0,
                        activation_bytes=act, text_bytes=T, vae_bytes=V, text_arena_bytes=text_arena,
                        text_activation_bytes=ta, text=text_mode, vae=vae,
                        unet=StageMode.STREAM if stream else StageMode.RESIDENT)
    return PolicyPlan(config, plan, budget, schedule, text_schedule, vision_schedule)


def _slot_fractions(parts, config: PolicyConfig, units, text: Optional[TextStream]) -> dict:
    """Per streamed stage, the packed staging slot per byte of its largest unit (``packed_weights.slot_fraction``);
    0 for a stage whose weights are stored in fp8 (one byte a weight already: nothing to pack) or whose copies hide
    behind its compute (``copy_bound``; the denoiser at the rows its family's samplers run by default,
    ``default_rows`` in ``families.json``, else the working shape's: the working shape's batch is sized for the
    activations, not the usual run)."""
    modules = {"unet": [getattr(parts, "unet", None)], "text": [getattr(parts, "text_encoder", None),
                                                                 getattr(parts, "text_encoder_2", None)]}
    dtypes = {"unet": config.dtype, "text": config.text_dtype}
    batch = int(config.working_shape[0])
    rows = int(family_defaults(parts.family).get("default_rows", batch))
    waits = {"unet": copy_bound(list(units), rows_scale=rows / batch),
             "text": text is not None and copy_bound(list(text.units))}
    return {stage: slot_fraction(config.device, dtypes[stage])
            if waits[stage] and not any(storage_name(m) for m in mods) else 0.0 for stage, mods in modules.items()}


def _plan_stream(config: PolicyConfig, units, act: int, sizes: dict, text: Optional[TextStream],
                 fractions: Optional[dict] = None) -> _Stream:
    """The ``stream`` plan (module docstring): the UNet's schedule, where the text encoders go, the peaks;
    ``fractions``: the packed slot per stage (``_slot_fractions``; none when not given)."""
    fractions = dict(fractions or {})
    unet_slot = fractions.get("unet", 0.0)
    T, U, V = sizes["text"], sizes["unet"], sizes["vae"]
    budget = config.budget_bytes
    minimum = stream_minimum_bytes(units, act, U, text, T)
    if budget < minimum:
        raise ValueError(_below_minimum(config, units, act, U, text, minimum))
    ta = text.activation_bytes if text is not None else 0
    schedule, resident, fields = _stream_schedule(config, units, act, U, slot=unet_slot)
    text_schedule = vision_schedule = None
    if resident + T + ta <= budget:
        mode, text_peak = StageMode.WHILE_USED, resident + T + ta
    elif text is None:
        mode, text_peak = StageMode.CPU, resident
    elif T + ta <= max(act, text.minimum_stage_bytes) + text.fixed_bytes:  # whole costs the UNet no more room
        schedule, resident, fields = _stream_schedule(config, units, T + ta, U, slot=unet_slot)
        mode, text_peak = StageMode.WHILE_USED, resident + T + ta
    else:
        # room for the text ring's packed slot too, where the budget holds it beside the UNet's minimum
        text_slot = slot_bytes_for(max(u.nbytes for u in text.units), fractions.get("text", 0.0))
        try:
            schedule, resident, fields = _stream_schedule(config, units, max(act, text.minimum_stage_bytes + text_slot),
                                                          U, text.fixed_bytes, slot=unet_slot)
        except ValueError:
            schedule, resident, fields = _stream_schedule(config, units, max(act, text.minimum_stage_bytes), U,
                                                          text.fixed_bytes, slot=unet_slot)
        headroom = int(HEADROOM * budget)
        vision_arena = 0
        if text.vision is not None:  # its smallest ring: its blocks are small, the language model's ring gains
            vision_schedule = plan_all_streamed(list(text.vision.units), text.vision.minimum_arena_bytes)
            vision_arena = vision_schedule.arena_bytes
        text_schedule = plan_all_streamed(list(text.units), budget - resident - ta - vision_arena - headroom,
                                          fractions.get("text", 0.0))
        arenas = text_schedule.arena_bytes + vision_arena
        mode, text_peak = StageMode.STREAM, resident + arenas + ta
        fields.update(text_fixed_bytes=text.fixed_bytes, text_host_bytes=text.host_bytes, text_arena_bytes=arenas,
                      text_packed_slot_bytes=text_schedule.slot_bytes,
                      text_streamed_units=len(text_schedule.streamed) + (
                          len(vision_schedule.streamed) if vision_schedule else 0),
                      text_total_units=len(text.units) + (len(text.vision.units) if text.vision else 0))
    peaks = {"text": text_peak, "unet": resident + act, "vae": resident + V}
    return _Stream(schedule, text_schedule, vision_schedule, resident, mode, peaks, fields)


def _stream_schedule(config: PolicyConfig, units, room: int, unet_bytes: int, extra_fixed: int = 0,
                     slot: float = 0.0) -> tuple:
    """(schedule, bytes resident on the device between stages, the plan's stream fields) when the UNet's resident
    set leaves ``room`` of ``config.budget_bytes`` free beside ``extra_fixed`` other always-resident bytes; ``slot``:
    the packed staging slot's fraction of the largest unit (0: plain copies)."""
    fixed = unet_bytes - sum(u.nbytes for u in units)
    capacity = config.budget_bytes - room - fixed - extra_fixed - int(HEADROOM * config.budget_bytes)
    schedule = plan_schedule(units, capacity, slot)
    resident = fixed + extra_fixed + schedule.resident_unit_bytes + schedule.arena_bytes
    notes = () if schedule.streamed else ("the whole UNet fits the budget: nothing streams",)
    est = schedule.est_step_s * 1e3 if config.device.type == "cuda" else None
    fields = dict(unet_fixed_bytes=fixed, unet_resident_bytes=schedule.resident_unit_bytes,
                  unet_streamed_bytes=schedule.streamed_bytes, arena_bytes=schedule.arena_bytes,
                  packed_slot_bytes=schedule.slot_bytes,
                  streamed_units=len(schedule.streamed), est_step_ms=est,
                  est_compute_ms=schedule.est_compute_s * 1e3 if est is not None else None, notes=notes)
    return schedule, resident, fields


def _below_minimum(config: PolicyConfig, units, act: int, unet_bytes: int, text: Optional[TextStream],
                   minimum: int) -> str:
    fixed = unet_bytes - sum(u.nbytes for u in units)
    shape = config.working_shape
    text_part = "" if text is None else (
        f", text stage: staging {gb(text.minimum_stage_bytes - text.activation_bytes)} + activations "
        f"{gb(text.activation_bytes)} at {text.tokens} tokens")
    return (f"vram_budget_gb={config.budget_bytes / GiB:.4g} is below the working minimum of {ceil_gb(minimum)} GB "
            f"for this model under 'stream' (activations+workspace {gb(act)}, always-resident weights {gb(fixed)}, "
            f"staging {gb(minimum_arena_bytes(units))} at latent {shape[1]}x{shape[2]}, batch {shape[0]}{text_part});"
            f" raise vram_budget_gb to at least {ceil_gb(minimum)}")


def stream_minimum_bytes(units, act: int, unet_bytes: int, text: Optional[TextStream] = None,
                         text_bytes: int = 0) -> int:
    """The smallest budget ``stream`` accepts: always-resident weights + the minimum staging arena + what the
    stages need beside them (the activations; with a streamable text encoder that does not fit in them, the least
    of it whole and it streamed through its minimum ring, its norm resident), over ``1 - HEADROOM``."""
    fixed = unet_bytes - sum(u.nbytes for u in units)
    room = act
    if text is not None and text_bytes + text.activation_bytes > act:
        room = min(text_bytes + text.activation_bytes, max(act, text.minimum_stage_bytes) + text.fixed_bytes)
    return int((room + fixed + minimum_arena_bytes(units)) / (1 - HEADROOM)) + 1


def working_minimum_bytes(parts: ModelParts, device: torch.device, dtype: torch.dtype, working_shape: tuple) -> int:
    """``stream_minimum_bytes`` of ``parts`` run in ``dtype`` on ``device`` at ``working_shape``."""
    units, act, sizes, text = plan_inputs(parts, dtype, dtype, torch.device(device).type, working_shape)
    return stream_minimum_bytes(units, act, sizes["unet"], text, sizes["text"])


def ceil_gb(n: int) -> str:
    """``n`` bytes in GB, rounded *up* at 4 significant digits (so the number quoted is enough)."""
    v = n / GiB
    digits = 4 - int(math.floor(math.log10(v))) - 1 if v > 0 else 4
    return f"{math.ceil(v * 10 ** digits) / 10 ** digits:.{max(digits, 0)}f}"

"""VRAM policies: one public ``apply_vram_policy`` -> the engine's ``placement`` (GUIDE convention 5).

Policies (what lives on the device, per stage):
- ``full``: every module resident.
- ``balanced``: UNet resident; text encoders and VAE on the device only while their stage runs.
- ``lowvram``: UNet resident; text encoders on the CPU in fp32 (only embeddings move); VAE on the device only
  while decoding.
- ``stream``: UNet split into a resident set filling ``vram_budget_gb`` minus the activation/workspace estimate
  (``HEADROOM``) and a streamed rest (``memory/streaming.py``); text encoders on the device while used if they fit next to the
  UNet's resident set inside the budget, else on the CPU; VAE on the device only while used.
- ``auto``: the fastest of full > balanced > lowvram > stream whose estimated peak fits 90% of the free VRAM
  (on the CPU: ``full``).

Invariants
- ``apply_vram_policy`` validates everything and computes the plan (on the ``meta`` device, no allocation) before
  touching a module; if building the placement fails, every module is put back on the CPU and the CUDA cache is
  emptied before the error propagates (nothing stays allocated on the GPU).
- Every policy computes with the same weights in the same dtype, so a UNet call gives the same result under every
  policy (on the CPU, bit-identical).
- Moving weights is a pointer swap to pinned host memory on exit and one flat copy on enter (``memory/hostmem.py``);
  hooks (stream) are named and removed by ``remove()``.
- Under ``stream`` the budget is a hard limit on every stage of every node: each ``enter`` caps the process's
  caching allocator at the budget for the stage and, before a text or VAE stage, releases cached CUDA graphs that
  would leave it no room (``memory/budget.py``); ``exit`` restores the previous cap.
- ComfyUI cooperation (``bridge``): ComfyUI's models are asked to make room before the placement claims VRAM,
  and the placement registers with ComfyUI's memory manager so ``/free`` (or ComfyUI needing VRAM) calls
  ``release()``; a released placement re-places itself on the next ``enter`` and bumps ``epoch`` (device
  addresses changed: a CUDA graph captured before must be recaptured; graph runners key on ``epoch``).

Why hand-written: accelerate's hooks (behind diffusers' ``enable_model_cpu_offload`` /
``enable_sequential_cpu_offload``) move weights with per-tensor ``.to()`` copies in both directions and keep no
budget across stages; diffusers' group offloading streams layer groups but takes no memory budget (one chooses
group sizes, not bytes). A stage entry here is one flat pinned copy, an exit a pointer swap, and one budget holds
every stage.
"""
from __future__ import annotations

import contextlib
import logging
import math
import traceback
from dataclasses import dataclass, replace
from enum import Enum
from typing import Optional

import torch

from .. import bridge
from .budget import release_device_caches, stage_budget
from .engine import ModelParts, modules_of_stage
from .families import family_defaults
from .hostmem import ModuleSwap
from .plan import GiB, MemoryPlan, activation_bytes, gb, module_bytes
from .streaming import BlockStreamer, StreamSchedule, minimum_arena_bytes, plan_schedule, trace_units

logger = logging.getLogger(__name__)

AUTO_FREE_FRACTION = 0.9
# Share of the stream budget kept free beyond the activation/workspace estimate. 0: the estimate carries its own
# margin and the allocator cap (``memory.cap``) holds the budget. Measured (H100, SDXL 1024 px, 4 GiB,
# ``scripts/diag/stream_plan_sweep.py`` + ``budget_node_paths.py``, 2026-11-23): the UNet stage reserves 0.74-0.77 GB
# above its weights and arena against the 0.89 GB estimate, so at 0 the sampler peaks at 3.72-3.77 GiB reserved
# (3.48 GiB allocated) and every node stays under 4 GiB, while the former 5% kept 0.2 GiB idle that the plan can
# use for resident weights instead: 1.97 instead of 2.16 GB streamed per step, a CUDA-graph step of ~48 instead of
# ~52 ms (full residency: 43 ms).
HEADROOM = 0.0


class VramPolicy(str, Enum):
    AUTO = "auto"
    FULL = "full"
    BALANCED = "balanced"
    LOWVRAM = "lowvram"
    STREAM = "stream"


# What an out-of-memory error under each policy suggests instead (each keeps less of the model on the GPU).
_LOWER_VRAM_CHOICES = {
    VramPolicy.FULL: "'balanced' or 'lowvram' (or 'stream' with a vram_budget_gb)",
    VramPolicy.BALANCED: "'lowvram' (or 'stream' with a vram_budget_gb)",
}


@dataclass(frozen=True)
class PolicyConfig:
    policy: VramPolicy  # resolved (never AUTO)
    requested: VramPolicy
    device: torch.device
    dtype: torch.dtype
    text_dtype: torch.dtype
    vae_dtype: torch.dtype
    budget_bytes: int
    working_shape: tuple


DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def _dtype_name(dt: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}.get(dt, str(dt))


# --------------------------------------------------------------------------------------------- public entry
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


def apply_vram_policy(parts: ModelParts, policy: str | VramPolicy = "auto", *, device=None,
                      vram_budget_gb: float = 4.0, dtype: Optional[torch.dtype] = None,
                      vae_dtype: Optional[torch.dtype] = None, working_shape: Optional[tuple] = None,
                      free_vram_bytes: Optional[int] = None, name: str = "") -> "ModelPlacement":
    """Place ``parts`` on ``device`` under ``policy`` and return the placement (the engine's ``placement``).

    ``dtype``: UNet/text weights (default fp16 on CUDA, fp32 on the CPU); ``vae_dtype``: default fp32 where the
    family's VAE overflows in fp16 (SDXL) or on the CPU, else ``dtype``. ``working_shape``: (batch, latent_h,
    latent_w) the activation estimate assumes (default: batch 2 at the UNet's native ``sample_size``).
    ``free_vram_bytes``: what ``auto`` may use (default: the device's free memory).
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
    dtype = dtype or (torch.float16 if dev.type == "cuda" else torch.float32)
    if vae_dtype is None:
        overflows = family_defaults(parts.family)["vae_fp16_overflows"]
        vae_dtype = torch.float32 if (dev.type == "cpu" or (overflows and dtype == torch.float16)) else dtype
    if working_shape is None:
        s = int(parts.unet.config.sample_size)
        working_shape = (2, s, s)
    if len(working_shape) != 3 or any(int(v) < 1 for v in working_shape):
        raise ValueError(f"working_shape={working_shape!r}: expected (batch, latent_h, latent_w) of positive ints")
    config = PolicyConfig(requested if requested != VramPolicy.AUTO else VramPolicy.FULL, requested, dev, dtype,
                          dtype, vae_dtype, int(vram_budget_gb * GiB), tuple(int(v) for v in working_shape))
    plan, schedule, config = _plan(parts, config, free_vram_bytes, name or parts.name)
    return ModelPlacement(parts, config, plan, schedule)


# --------------------------------------------------------------------------------------------- planning
def _plan(parts: ModelParts, config: PolicyConfig, free: Optional[int], name: str):
    units = trace_units(parts.unet, config.working_shape, config.dtype)
    elem = torch.empty((), dtype=config.dtype).element_size()
    act = activation_bytes(units, elem, config.device.type)
    sizes = dict(text=sum(module_bytes(m, config.dtype) for m in modules_of_stage(parts, "text")),
                 unet=module_bytes(parts.unet, config.dtype), vae=module_bytes(parts.vae, config.vae_dtype))
    if config.requested == VramPolicy.AUTO:
        config = _resolve_auto(parts, config, units, act, sizes, free)
    plan, schedule = _plan_for(parts, config, units, act, sizes, name)
    return plan, schedule, config


def _resolve_auto(parts, config, units, act, sizes, free):
    if config.device.type != "cuda":
        return replace(config, policy=VramPolicy.FULL)
    if free is None:
        free = torch.cuda.mem_get_info(config.device)[0]
    usable = int(free * AUTO_FREE_FRACTION)
    for pol in (VramPolicy.FULL, VramPolicy.BALANCED, VramPolicy.LOWVRAM):
        cand = replace(config, policy=pol)
        plan, _ = _plan_for(parts, cand, units, act, sizes, "")
        if plan.peak_bytes <= usable:
            return cand
    return replace(config, policy=VramPolicy.STREAM, budget_bytes=min(config.budget_bytes, usable))


def _plan_for(parts, config: PolicyConfig, units, act, sizes, name):
    T, U, V = sizes["text"], sizes["unet"], sizes["vae"]
    pol = config.policy
    text_dtype = config.dtype
    common = dict(policy=pol.value, requested=config.requested.value, device=str(config.device), model=name,
                  family=parts.family, dtype=_dtype_name(config.dtype), vae_dtype=_dtype_name(config.vae_dtype),
                  budget_bytes=config.budget_bytes, working_shape=config.working_shape, text_bytes=T, unet_bytes=U,
                  vae_bytes=V, unet_activation_bytes=act, total_units=len(units))
    schedule = None
    if pol == VramPolicy.FULL:
        fields = dict(text_mode="resident", vae_mode="resident", unet_mode="resident",
                      peaks={"text": T + U + V, "unet": T + U + V + act, "vae": T + U + V})
    elif pol == VramPolicy.BALANCED:
        fields = dict(text_mode="while used", vae_mode="while used", unet_mode="resident",
                      peaks={"text": U + T, "unet": U + act, "vae": U + V})
    elif pol == VramPolicy.LOWVRAM:
        text_dtype = torch.float32
        fields = dict(text_mode="cpu", vae_mode="while used", unet_mode="resident",
                      peaks={"text": U, "unet": U + act, "vae": U + V})
    else:
        fixed = U - sum(u.nbytes for u in units)
        minimum = int(_stream_minimum(units, act, U) / (1 - HEADROOM)) + 1
        if config.budget_bytes < minimum:
            raise ValueError(
                f"vram_budget_gb={config.budget_bytes / GiB:.4g} is below the working minimum of "
                f"{_ceil_gb(minimum)} GB for this model under 'stream' (activations+workspace {gb(act)}, always-"
                f"resident weights {gb(fixed)}, staging {gb(minimum_arena_bytes(units))} at latent "
                f"{config.working_shape[1]}x{config.working_shape[2]}, batch {config.working_shape[0]}); raise "
                f"vram_budget_gb to at least {_ceil_gb(minimum)}")
        schedule = plan_schedule(units, config.budget_bytes - act - fixed - int(HEADROOM * config.budget_bytes))
        resident = fixed + schedule.resident_unit_bytes + schedule.arena_bytes
        text_mode = "while used" if resident + T <= config.budget_bytes else "cpu"
        if text_mode == "cpu":
            text_dtype = torch.float32
        notes = () if schedule.streamed else ("the whole UNet fits the budget: nothing streams",)
        est = schedule.est_step_s * 1e3 if config.device.type == "cuda" else None
        fields = dict(text_mode=text_mode, vae_mode="while used", unet_mode="stream", unet_fixed_bytes=fixed,
                      unet_resident_bytes=schedule.resident_unit_bytes, unet_streamed_bytes=schedule.streamed_bytes,
                      arena_bytes=schedule.arena_bytes, streamed_units=len(schedule.streamed), est_step_ms=est,
                      est_compute_ms=schedule.est_compute_s * 1e3 if est is not None else None, notes=notes,
                      peaks={"text": resident + (T if text_mode == "while used" else 0), "unet": resident + act,
                             "vae": resident + V})
    plan = MemoryPlan(text_dtype=_dtype_name(text_dtype), **common, **fields)
    return plan, schedule


def _stream_minimum(units, act: int, unet_bytes: int) -> int:
    fixed = unet_bytes - sum(u.nbytes for u in units)
    return act + fixed + minimum_arena_bytes(units)


def _ceil_gb(n: int) -> str:
    """``n`` bytes in GB, rounded *up* at 4 significant digits (so the number quoted is enough)."""
    import math

    v = n / GiB
    digits = 4 - int(math.floor(math.log10(v))) - 1 if v > 0 else 4
    return f"{math.ceil(v * 10 ** digits) / 10 ** digits:.{max(digits, 0)}f}"


def stream_working_minimum_gb(parts: ModelParts, device=None, dtype: Optional[torch.dtype] = None,
                              working_shape: Optional[tuple] = None) -> float:
    """The smallest ``vram_budget_gb`` the ``stream`` policy accepts for ``parts`` (same estimate as the plan)."""
    dev = torch.device(device) if device is not None else bridge.default_device()
    dtype = dtype or (torch.float16 if dev.type == "cuda" else torch.float32)
    if working_shape is None:
        s = int(parts.unet.config.sample_size)
        working_shape = (2, s, s)
    units = trace_units(parts.unet, tuple(working_shape), dtype)
    act = activation_bytes(units, torch.empty((), dtype=dtype).element_size(), dev.type)
    return (int(_stream_minimum(units, act, module_bytes(parts.unet, dtype)) / (1 - HEADROOM)) + 1) / GiB


# --------------------------------------------------------------------------------------------- runtime
class ModelPlacement:
    """The runtime side of a policy (``engine.placement``): see the module docstring."""

    def __init__(self, parts: ModelParts, config: PolicyConfig, plan: MemoryPlan,
                 schedule: Optional[StreamSchedule]):
        self.name = config.policy.value
        self.parts = parts
        self.config = config
        self.plan = plan
        self.schedule = schedule
        self.text_dtype = DTYPES[plan.text_dtype] if plan.text_dtype in DTYPES else config.dtype
        self.measured: dict[str, tuple[int, bool]] = {}
        self.epoch = 0
        self.streamer: Optional[BlockStreamer] = None
        self._swaps: dict[str, list[ModuleSwap]] = {}
        self._live = False
        self._comfy = None
        self._marks: dict[str, int] = {}
        self._scopes: dict[str, list[contextlib.ExitStack]] = {}  # per stage: the open budget scopes (LIFO)
        self.pool = None  # the engine's BufferPool, released with the placement
        self._setup()

    # ----------------------------------------------------------------- placing
    @property
    def device(self) -> torch.device:
        return self.config.device

    def _setup(self) -> None:
        dev, plan = self.device, self.plan
        if dev.type == "cuda":
            bridge.free_comfy_memory(plan.peak_bytes, dev)
        try:
            for te in modules_of_stage(self.parts, "text"):
                self._place(te, "text", plan.text_mode, self.text_dtype)
            if plan.unet_mode == "stream":
                self.streamer = BlockStreamer(self.parts.unet, self.schedule, dev, self.config.dtype)
            else:
                self.parts.unet.to(device=dev, dtype=self.config.dtype)
            self._place(self.parts.vae, "vae", plan.vae_mode, self.config.vae_dtype)
        except BaseException as exc:
            self._teardown()
            traceback.clear_frames(exc.__traceback__)  # frames would keep views of freed device buffers alive
            raise
        self._live = True
        self.epoch += 1
        if dev.type == "cuda":
            self._comfy = bridge.register_memory_owner(self, dev, self.device_bytes, self.release)

    def _place(self, module, stage: str, mode: str, dtype: torch.dtype) -> None:
        if mode == "resident":
            module.to(device=self.device, dtype=dtype)
        elif mode == "cpu":
            module.to(device="cpu", dtype=dtype)
        else:
            self._swaps.setdefault(stage, []).append(ModuleSwap(module, dtype, self.device))

    def _teardown(self) -> None:
        if self.streamer is not None:
            self.streamer.remove()
            self.streamer = None
        for swaps in self._swaps.values():
            for s in swaps:
                s.restore()
        self._swaps.clear()
        for stage in ("text", "unet", "vae"):
            for m in modules_of_stage(self.parts, stage):
                m.to("cpu")
        self._live = False
        if self.device.type == "cuda":
            bridge.soft_empty_cache()

    def device_bytes(self) -> int:
        """Bytes this placement keeps on the device between stages (what ComfyUI's manager sees)."""
        if not self._live:
            return 0
        return self.plan.peaks.get("text", 0) if self.plan.unet_mode != "stream" else (
            self.plan.unet_fixed_bytes + self.plan.unet_resident_bytes + self.plan.arena_bytes)

    # ----------------------------------------------------------------- Placement protocol
    def enter(self, engine, stage: str) -> None:
        if not self._live:
            self._setup()
        scope = contextlib.ExitStack()
        try:
            scope.enter_context(stage_budget(self, stage))  # a hard budget holds for the whole stage (budget.py)
            for swap in self._swaps.get(stage, []):
                swap.onload()
        except BaseException:
            for swap in self._swaps.get(stage, []):
                swap.offload()
            scope.close()
            raise
        self._scopes.setdefault(stage, []).append(scope)
        if self.device.type == "cuda":
            self._marks[stage] = torch.cuda.max_memory_reserved(self.device)

    def exit(self, engine, stage: str) -> None:
        try:
            outermost = len(self._scopes.get(stage) or ()) <= 1  # a nested session exits inside a running forward
            if stage == "unet" and outermost and self.streamer is not None and self.streamer.end_unfinished():
                logger.warning("a UNet forward of %s was cut short inside a streamed block (an interrupt that is "
                               "not an Exception); its weight schedule was closed", self.plan.model)
            for swap in self._swaps.get(stage, []):
                swap.offload()
            if self.device.type == "cuda" and stage in self._marks:
                before = self._marks.pop(stage)
                after = torch.cuda.max_memory_reserved(self.device)
                self.measured[stage] = (after, True) if after > before else (before, False)
        finally:
            scopes = self._scopes.get(stage)
            if scopes:
                scopes.pop().close()

    def out_of_memory_hint(self, stage: str) -> Optional[str]:
        """What to change when a stage runs out of GPU memory: the loader input that trades speed for memory under
        this policy, or the budget that capped it (``None`` on the CPU, where nothing is capped)."""
        if self.device.type != "cuda":
            return None
        policy = self.config.policy
        if policy == VramPolicy.STREAM:
            return (f"The Memory Pool Loader's 'stream' policy holds every stage of this model within vram_budget_gb="
                    f"{self.plan.budget_bytes / GiB:g} GB (this was the {stage} stage): raise vram_budget_gb, or "
                    f"lower the batch size or the image size.")
        lower = _LOWER_VRAM_CHOICES.get(policy, "'stream' with a vram_budget_gb")
        return (f"The GPU ran out of memory in the {stage} stage under the Memory Pool Loader's vram_policy="
                f"'{policy.value}': set vram_policy to {lower}, or lower the batch size or the image size.")

    def stage_device(self, engine, stage: str) -> torch.device:
        if stage == "text" and self.plan.text_mode == "cpu":
            return torch.device("cpu")
        return self.device

    # ----------------------------------------------------------------- lifetime
    def release(self) -> None:
        """Free this placement's device memory now (ComfyUI asked); the next ``enter`` places everything again.

        The model's registered device caches (its captured CUDA graphs, ``memory.budget``) go too: they read the
        weights at their current addresses and the placement's epoch, both replaced by the next ``enter``, so they
        could never be replayed again, while their static buffers and memory pools would stay reserved."""
        release_device_caches(self.parts)
        if self._live:
            logger.info("releasing %s placement of %s", self.name, self.plan.model)
            self._teardown()
        if self.pool is not None:
            self.pool.release()
        self._comfy = None

    def remove(self) -> None:
        """Undo the placement for good: hooks removed, every module back on the CPU, ComfyUI entry dropped."""
        bridge.unregister_memory_owner(self._comfy)
        self._comfy = None
        if self._live:
            self._teardown()

    def report(self) -> str:
        """The memory plan with the peaks measured so far (``max_memory_reserved`` per stage; '<=' when the
        stage did not raise the process-wide peak, so only a bound is known)."""
        return self.plan.render(self.measured)

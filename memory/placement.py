"""The runtime side of a VRAM policy (``engine.placement``): places the planned weights, moves them per stage,
holds the budget, cooperates with ComfyUI's memory manager.

Invariants
- Moving weights is a pointer swap to pinned host memory on exit and one flat copy on enter (``memory/hostmem.py``);
  a streamed UNet's hooks (``memory/streaming.py``) are named and removed by ``remove()``.
- If placing fails, every module is put back on the CPU and the CUDA cache is emptied before the error propagates
  (nothing stays allocated on the GPU).
- Under a hard budget (``budget.hard``: the ``stream`` policy) every ``enter`` caps the process's caching allocator
  at the budget for the stage and, before a text or VAE stage, releases cached CUDA graphs that would leave it no
  room (``memory/budget.py``); ``exit`` restores the previous cap.
- ComfyUI cooperation (``bridge``): ComfyUI's models are asked to make room before the placement claims VRAM, and
  the placement registers with ComfyUI's memory manager so ``/free`` (or ComfyUI needing VRAM) calls ``release()``;
  a released placement re-places itself on the next ``enter`` and bumps ``epoch`` (device addresses changed: a
  CUDA graph captured before must be recaptured; graph runners key on ``epoch``).
"""
from __future__ import annotations

import contextlib
import logging
import traceback
from typing import Optional

import torch

from .. import bridge
from .budget import release_device_caches, stage_budget
from .dit_streaming import denoiser_streamer
from .engine import ModelParts, modules_of_stage
from .hostmem import ModuleSwap
from .plan import GiB, MemoryPlan
from .policy_config import DTYPES, PolicyConfig, VramPolicy
from .stream_schedule import StreamSchedule
from .streaming import BlockStreamer
from .text_streaming import text_streamers
from .vram_budget import StageMode, VramBudget

logger = logging.getLogger(__name__)

# What an out-of-memory error under each policy suggests instead (each keeps less of the model on the GPU).
_LOWER_VRAM_CHOICES = {
    VramPolicy.FULL: "'balanced' or 'lowvram' (or 'stream' with a vram_budget_gb)",
    VramPolicy.BALANCED: "'lowvram' (or 'stream' with a vram_budget_gb)",
}


class ModelPlacement:
    """The runtime side of a policy (``engine.placement``): see the module docstring."""

    def __init__(self, parts: ModelParts, config: PolicyConfig, plan: MemoryPlan, budget: VramBudget,
                 schedule: Optional[StreamSchedule], text_schedule: Optional[StreamSchedule] = None,
                 vision_schedule: Optional[StreamSchedule] = None):
        self.name = config.policy.value
        self.parts = parts
        self.config = config
        self.plan = plan  # the report (``render``)
        self.budget = budget  # what callers read: where the weights live, the hard limit, the room it leaves
        self.schedule = schedule
        self.text_schedule = text_schedule  # a streamed text encoder's (``budget.text`` is STREAM), else None
        self.vision_schedule = vision_schedule  # its vision tower's, when it has one
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
        dev, budget = self.device, self.budget
        if dev.type == "cuda":
            bridge.free_comfy_memory(self.plan.peak_bytes, dev)
        try:
            for te in modules_of_stage(self.parts, "text"):
                self._place(te, "text", budget.text, self.text_dtype)
            if budget.streams_unet:
                self.streamer = denoiser_streamer(self.parts, self.schedule, dev, self.config.dtype)
            else:
                self.parts.unet.to(device=dev, dtype=self.config.dtype)
            self._place(self.parts.vae, "vae", budget.vae, self.config.vae_dtype)
        except BaseException as exc:
            self._teardown()
            traceback.clear_frames(exc.__traceback__)  # frames would keep views of freed device buffers alive
            raise
        self._live = True
        self.epoch += 1
        if dev.type == "cuda":
            self._comfy = bridge.register_memory_owner(self, dev, self.device_bytes, self.release)

    def _place(self, module, stage: str, mode: StageMode, dtype: torch.dtype) -> None:
        if mode is StageMode.RESIDENT:
            module.to(device=self.device, dtype=dtype)
        elif mode is StageMode.CPU:
            module.to(device="cpu", dtype=dtype)
        elif mode is StageMode.STREAM:  # block by block, its ring on the device only while the stage runs
            self._swaps.setdefault(stage, []).extend(
                text_streamers(module, self.text_schedule, self.vision_schedule, self.device, dtype))
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
        return self.budget.resident_bytes if self.budget.streams_unet else self.plan.peaks.get("text", 0)

    # ----------------------------------------------------------------- Placement protocol
    def enter(self, engine, stage: str, text_shape: Optional[tuple[int, int]] = None) -> None:
        if not self._live:
            self._setup()
        scope = contextlib.ExitStack()
        try:
            # a hard budget holds for the whole stage (budget.py)
            scope.enter_context(stage_budget(self, stage, text_shape))
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
                logger.warning("a UNet forward of %s was cut short (an interrupt that is not an Exception, or an "
                               "error between two streamed blocks); its weight schedule was closed", self.plan.model)
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
                    f"{self.budget.limit_bytes / GiB:g} GB (this was the {stage} stage): raise vram_budget_gb, or "
                    f"lower the batch size or the image size.")
        lower = _LOWER_VRAM_CHOICES.get(policy, "'stream' with a vram_budget_gb")
        return (f"The GPU ran out of memory in the {stage} stage under the Memory Pool Loader's vram_policy="
                f"'{policy.value}': set vram_policy to {lower}, or lower the batch size or the image size.")

    def stage_device(self, engine, stage: str) -> torch.device:
        if stage == "text" and not self.budget.text_on_device:
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

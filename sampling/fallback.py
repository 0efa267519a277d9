"""The Fused DDIM Sampler's way down when memory runs out: batched CFG, then sequential CFG, then the batch in
ever smaller chunks of rows; what it tried is in the error when even one row does not fit.

Invariants
- ``attempts(batch, guided, cfg_mode)``: the requested configuration first; a guided batched run next tries
  sequential CFG (two UNet calls of ``batch`` rows instead of one of ``2 * batch``); then chunks of
  ``ceil(chunk / 2)`` rows, down to 1, each with the lower-memory CFG mode.
- Every attempt computes the same latents up to rounding: sequential CFG makes the same two UNet calls as batched
  CFG, UNet rows are independent, and each chunk gets its rows of the conditioning, of the initial latents and of
  the per-step eta noise. A retry restores the generator's state saved before the first attempt, and a chunked
  run draws each step's noise for the whole batch in step order (``ChunkNoise``), so row ``r`` of step ``i`` is
  the same draw in every attempt, as in a run that never ran out of memory.
- Only an out-of-memory error (``memory.out_of_memory.is_out_of_memory``: CUDA's, or a CPU allocation failure)
  starts the next attempt; its frames are released first. Any other error propagates at once.
- The progress bar is re-planned at each retry (back to 0 of ``steps * chunks``), so it never passes its total.
- When the last attempt fails: ``torch.OutOfMemoryError`` naming every configuration tried and the fixes.

Why: a step that does not fit should cost time, not the run; the Stream Scheduler and the tiled VAE already
degrade the same way.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch

from .. import bridge
from ..memory.out_of_memory import is_out_of_memory, release_after_out_of_memory
from .cfg import Conditioning
from .program import STATE_DTYPE
from .settings import CfgMode

logger = logging.getLogger(__name__)

_CUDA_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


@dataclass(frozen=True)
class Attempt:
    """One configuration to try: the CFG mode and how many latent rows run together."""

    cfg_mode: str
    chunk: int

    def chunks(self, batch: int) -> list[tuple[int, int]]:
        """``(start, stop)`` row ranges covering ``batch`` rows."""
        return [(a, min(batch, a + self.chunk)) for a in range(0, batch, self.chunk)]

    def describe(self, batch: int) -> str:
        rows = f"batch {batch}" if self.chunk >= batch else f"chunks of {self.chunk} of {batch} rows"
        return f"{self.cfg_mode} CFG, {rows}"


def attempts(batch: int, guided: bool, cfg_mode: str) -> list[Attempt]:
    """The configurations to try, in order (module docstring)."""
    plan = [Attempt(cfg_mode, batch)]
    lean_mode = CfgMode.SEQUENTIAL.value if guided else cfg_mode
    if lean_mode != cfg_mode:
        plan.append(Attempt(lean_mode, batch))
    chunk = batch
    while chunk > 1:
        chunk = math.ceil(chunk / 2)
        plan.append(Attempt(lean_mode, chunk))
    return plan


def conditioning_rows(conditioning: Conditioning, start: int, stop: int) -> Conditioning:
    """Rows ``start:stop`` of a conditioning repeated to the batch (both sides, pooled and time ids alike)."""
    def rows(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if t is None else t[start:stop]

    def embeds(e):
        return None if e is None else replace(e, context=e.context[start:stop], pooled=rows(e.pooled))

    return replace(conditioning, cond=embeds(conditioning.cond), uncond=embeds(conditioning.uncond),
                   time_ids=rows(conditioning.time_ids), uncond_time_ids=rows(conditioning.uncond_time_ids))


class ChunkNoise:
    """Each step's eta noise drawn once for the whole batch, in step order, from the run's generator; a chunk takes
    its rows."""

    def __init__(self, shape: tuple, steps: int, generator: torch.Generator):
        self.draws = [torch.randn(shape, generator=generator, dtype=STATE_DTYPE) for _ in range(steps)]

    def rows(self, start: int, stop: int) -> Callable[[int], torch.Tensor]:
        return lambda i: self.draws[i][start:stop]


RunAttempt = Callable[[Attempt, "bridge.ProgressBar"], torch.Tensor]


def run_with_fallback(run: RunAttempt, plan: list[Attempt], batch: int, steps: int, device: torch.device,
                      generator: Optional[torch.Generator], quiet: bool = False) -> torch.Tensor:
    """``run(attempt, bar)`` for each attempt of ``plan`` until one fits in memory (module docstring)."""
    state = generator.get_state() if generator is not None else None
    tried: list[str] = []
    error: Optional[BaseException] = None
    with bridge.ProgressBar(steps, desc="Fused DDIM", quiet=quiet) as bar:
        for k, attempt in enumerate(plan):
            if k:
                bar.set(0, steps * len(attempt.chunks(batch)))
                if state is not None:
                    generator.set_state(state)
            try:
                return run(attempt, bar)
            except Exception as exc:  # noqa: BLE001 - only out-of-memory errors are retried; the rest re-raise
                if not is_out_of_memory(exc):
                    raise
                release_after_out_of_memory(exc, device)
                error = exc.with_traceback(None)
            tried.append(attempt.describe(batch))
            if k + 1 < len(plan):
                logger.warning("Fused DDIM Sampler: out of memory with %s (%s); retrying with %s", tried[-1],
                               error, plan[k + 1].describe(batch))
    raise _CUDA_OOM(f"Fused DDIM Sampler: out of memory even with one latent row at a time (tried: "
                    f"{'; '.join(tried)}); lower the resolution or batch_size, choose a lower-VRAM vram_policy in "
                    f"the Memory Pool Loader, or free memory. Last error: {error}") from error

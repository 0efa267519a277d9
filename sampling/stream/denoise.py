"""One batch's DDIM loop for the stream scheduler, composed of the Fused DDIM Sampler's public pieces.

Why not ``sampling.loop.denoise``: that loop owns a progress bar per call (ComfyUI would show one bar per batch,
reset every batch). This module runs the same ``loop.prepare_steps`` (same ``StepProgram``, ``GraphRunner`` and
cache key) and ``loop.run_steps`` (same per-step order), and reports each finished step to the caller, who owns
the single progress bar of the whole run. eta is 0 (the stream sampler has no eta input), CFG is batched.

Invariant: for one image this computes exactly what ``loop.denoise`` computes (same kernels, same buffers, same
key, hence the same cached CUDA graph); a batch of images computes each row as the batch-1 run would, up to the
batched UNet call's floating-point differences.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ...memory.engine import LeanEngine
from .. import ddim
from ..cfg import Conditioning
from ..graph_runner import GraphRunner
from ..loop import prepare_steps, run_steps
from ..settings import CfgMode


@torch.no_grad()
def denoise_batch(engine: LeanEngine, conditioning: Conditioning, x_init: torch.Tensor,
                  schedule: ddim.DDIMSchedule, cfg: float, acceleration: str,
                  on_step: Callable[[int], None], runner: Optional[GraphRunner] = None) -> torch.Tensor:
    """DDIM from ``x_init`` (scaled latents, CPU or device) over ``schedule``; call inside ``engine.session("unet")``.

    Returns the final scaled latents (float32, on ``engine.device``, a new tensor). ``on_step(i)`` runs after
    step ``i`` has been enqueued. ``bridge.check_interrupted()`` runs before every step.
    """
    if schedule.eta != 0:
        raise ValueError("the stream scheduler runs DDIM with eta = 0 only")
    prepared = prepare_steps(engine, conditioning, x_init, schedule, cfg, CfgMode.BATCHED.value, acceleration,
                             runner)
    return run_steps(prepared, None, on_step)

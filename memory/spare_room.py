"""Streamed DiT blocks held on the device for one run, in the activation room that run does not need.

Invariant: inside ``streamed_blocks_held(engine, working)`` the streamed denoiser's forwards compute on the same
bytes as without it (a held block crosses once, in the run's first step, as it would into its ring slice, and is
computed from its held copy after that: ``memory/held_units.py``), so the latent is bit-identical; on exit the held
copies are dropped and the budget is as the plan left it.

Why: the plan reserves activation room for its working shape (``memory.policies.default_working_shape``: two rows,
guidance, at the family's native size). A run with fewer rows (Z-Image-Turbo at cfg 1 computes one) leaves part
of that room idle while its step waits on weight copies; holding a few streamed blocks there removes their copies
from every step.

How much: ``need = WORKSPACE + (plan estimate - WORKSPACE) * rows / plan rows`` (the estimate is linear in the
rows; tokens per row are at most the plan's when the run's latent is no larger than the plan's, the plan counting
the longest caption bucket), and the blocks held fit in what the cap leaves beside the live tensors (the caching
allocator gives cached blocks back before it would go over the cap) less ``need`` and ``MARGIN_BYTES`` (what an
estimate that runs short would use first), read from the allocator's counters: no device sync. A run larger than
the plan's working shape in any dimension holds nothing. Only under a hard budget (``stream``) on CUDA, for runs
that step eagerly (a captured graph would bake the held copies' addresses).
"""
from __future__ import annotations

import contextlib
import logging
from typing import Iterator, Optional

import torch

from .budget import cap_bytes
from .plan import WORKSPACE_CUDA

logger = logging.getLogger(__name__)

MARGIN_BYTES = 256 * 2 ** 20


def run_activation_bytes(plan_estimate: int, plan_shape: tuple, working: tuple) -> Optional[int]:
    """The plan's activation estimate scaled to a run of ``working`` = ``(rows, latent_h, latent_w)`` (module
    docstring); None when the run is larger than ``plan_shape`` in any dimension."""
    if any(int(w) > int(p) for w, p in zip(working, plan_shape)):
        return None
    per_rows = max(0, int(plan_estimate) - WORKSPACE_CUDA)
    return WORKSPACE_CUDA + -(-per_rows * int(working[0]) // int(plan_shape[0]))


@contextlib.contextmanager
def streamed_blocks_held(engine, working: Optional[tuple]) -> Iterator[int]:
    """Hold streamed blocks of ``engine``'s denoiser in the room a run of ``working`` leaves (module docstring);
    yields the bytes held (0 where nothing is held)."""
    placement = engine.placement
    streamer = getattr(placement, "streamer", None)
    budget = placement.budget
    if working is None or streamer is None or not budget.hard or engine.device.type != "cuda":
        yield 0
        return
    need = run_activation_bytes(budget.activation_bytes, placement.plan.working_shape, working)
    room = cap_bytes(placement) - budget.headroom_bytes - torch.cuda.memory_allocated(engine.device)
    held = streamer.hold(room - need - MARGIN_BYTES) if need is not None else 0
    if held:
        logger.info("streamed DiT: %.2f GB of streamed blocks held on the device for this run (its %d rows leave "
                    "that much of the planned activation room free); they cross once, in the first step", held / 1e9,
                    int(working[0]))
    try:
        yield held
    finally:
        streamer.release_held()

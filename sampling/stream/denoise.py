"""One batch's DDIM loop for the stream scheduler, composed of the Fused DDIM Sampler's public pieces.

Why not ``sampling.loop.denoise``: that loop owns a progress bar per call (ComfyUI would show one bar per batch,
reset every batch) and offers no per-step hook. This module runs the same ``StepProgram`` through the same
``GraphRunner`` with the same cache key, and the same per-step order (interruption check, next step's values
into the buffers, run or replay, bounded run-ahead), and reports each finished step to the caller, who owns the
single progress bar of the whole run. eta is 0 (the stream sampler has no eta input), CFG is batched.

Invariant: for one image this computes exactly what ``loop.denoise`` computes (same kernels, same buffers, same
key, hence the same cached CUDA graph); a batch of images computes each row as the batch-1 run would, up to the
batched UNet call's floating-point differences.
"""
from __future__ import annotations

import collections
import logging
from typing import Callable, Optional

import torch

from ... import bridge
from ...memory.engine import LeanEngine
from .. import ddim
from ..cfg import Conditioning, unet_calls
from ..compile import compiled_unet_fn, eager_unet_fn
from ..graph_runner import GraphRunner, default_runner
from ..loop import resolve_acceleration
from ..program import StepProgram, plain_allocator
from ..settings import Acceleration, CfgMode

logger = logging.getLogger(__name__)

RUN_AHEAD = 2  # steps the host may enqueue ahead of the device (as the Fused DDIM loop)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host -> device without blocking the host: a pageable copy would first wait for the stream's queued steps."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _allocator(engine: LeanEngine):
    get = getattr(engine.pool, "get", None) if engine.pool is not None else None
    if callable(get):
        return lambda role, shape, dtype: get(role=role, shape=tuple(shape), dtype=dtype, device=engine.device)
    return plain_allocator(engine.device)


def program_key(shape: tuple, dtype: torch.dtype, copies: int, conditioning: Conditioning, prediction: str,
                calls) -> tuple:
    """The graph-cache key, built exactly as the Fused DDIM loop builds it (so both share captured graphs)."""
    return (shape, dtype, copies, conditioning.guided, False, prediction,
            tuple((tuple(c.context.shape), c.context.dtype,
                   None if c.added is None else tuple((k, tuple(v.shape), v.dtype) for k, v in c.added.items()))
                  for c in calls))


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
    device = engine.device
    n = len(schedule)
    calls, copies = unet_calls(conditioning, CfgMode.BATCHED.value)
    table = torch.empty(n, 6, dtype=torch.float32)
    table[:, 0] = float(cfg)
    table[:, 1:] = schedule.coefficients
    table = to_device(table, device)
    t_table = to_device(torch.tensor(schedule.timesteps, dtype=torch.int64), device)
    shape = tuple(x_init.shape)
    dtype = engine.dtype

    def build(unet_fn) -> StepProgram:
        return StepProgram(unet_fn, shape, dtype, calls, copies, False, conditioning.guided,
                           schedule.prediction_type, _allocator(engine))

    def prepare(program: StepProgram) -> None:
        program.load(calls, x_init.to(device))
        program.set_step(t_table[0], table[0], None)

    mode = resolve_acceleration(engine, acceleration, runner)
    program, advance, unet_fn = None, None, eager_unet_fn(engine)
    if mode != Acceleration.NONE.value:
        runner = runner if runner is not None else default_runner()
        compiled = mode == Acceleration.COMPILE.value
        graph_fn = compiled_unet_fn(engine) if compiled else unet_fn
        key = program_key(shape, dtype, copies, conditioning, schedule.prediction_type, calls)
        try:
            captured = runner.step_for(engine, key, lambda: build(graph_fn), prepare, compiled=compiled)
            program, advance, unet_fn = captured.program, captured.replay, graph_fn
        except torch.cuda.OutOfMemoryError as exc:
            runner.clear(engine)
            logger.warning("capturing the %s step for a batch of %d ran out of GPU memory (%s); dropped this "
                           "model's cached graphs and running this batch eagerly", mode, shape[0], exc)
    if program is None:
        program = build(unet_fn)
        prepare(program)
        advance = program.step

    program.unet_fn = unet_fn  # bound for this run only (a cached program must not keep the engine alive)
    cuda = device.type == "cuda"
    in_flight: collections.deque = collections.deque()
    try:
        for i in range(n):
            bridge.check_interrupted()
            program.set_step(t_table[i], table[i], None)
            advance()
            if cuda:
                event = torch.cuda.Event()
                event.record()
                in_flight.append(event)
                if len(in_flight) > RUN_AHEAD:
                    in_flight.popleft().synchronize()
            on_step(i)
    finally:
        program.unet_fn = None
    return program.sample.clone()

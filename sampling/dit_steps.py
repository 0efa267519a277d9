"""The step loop the DiT samplers share (Z-Image's ``flow/loop.py``, Qwen-Image's ``qwen/loop.py``): a step program
run eagerly or captured once and replayed, then driven through the schedule.

Invariants
- A DiT step program has static buffers, ``set_step(timestep, coeffs)`` (the step's values copied in), ``step()``
  (reads and writes only its buffers, no host synchronisation), ``sample`` (the float32 state) and ``dit_fn`` (the
  transformer call ``step()`` makes). ``none`` runs ``step()``; ``cuda_graph`` and ``compile+cuda_graph`` replay the
  graph the runner captured for the key (``graph_runner.GraphRunner.step_for``), so a cached graph serves every run
  whose key matches and only the buffers' values change. A key whose graph a budgeted stage dropped in an earlier
  run (``GraphRunner.was_released``) runs eagerly instead, the same latent: each run would otherwise capture it
  again (several steps' worth of time) only to lose it at the same stage, while a DiT step is long enough that
  replaying it gains little. Another key (a shorter prompt, another batch) still captures and may keep its graph.
- A DiT whose blocks stream at every step (``streams_weights``) steps eagerly whatever the acceleration, the same
  latent: its step is bound by the weight copies, and on Z-Image at 6 GB with packed copies the replayed graph
  took 1.6 s where the eager steps took 1.4 s (plain copies: equal).
- A run whose DiT call has fewer rows (or a smaller latent) than the plan's working shape holds some streamed
  blocks on the device in the activation room it leaves (``memory.spare_room``), eager steps only; the same
  latent, fewer bytes over PCIe per step. Eager streamed steps also copy the next step's first streamed blocks
  while the current one ends (``memory.stream_prefetch``): the copy engine does not idle between steps.
- ``dit_fn`` is bound for the duration of a run only: a cached program must not keep its engine alive (the cache
  is weak in the model); a real CUDA graph replays without calling it.
- ``bridge.check_interrupted()`` runs before every step, ``on_step(i)`` after step ``i`` was enqueued; on the GPU the
  host enqueues at most two steps ahead of the device (``loop.bound_run_ahead``).
"""
from __future__ import annotations

import collections
import logging
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Optional

import torch

from .. import bridge
from ..memory.engine import LeanEngine
from ..memory.families import is_dit_family
from ..memory.spare_room import streamed_blocks_held
from ..memory.stream_prefetch import next_forward_prefetch
from .graph_runner import GraphRunner, default_runner
from .loop import bound_run_ahead
from .settings import Acceleration

logger = logging.getLogger(__name__)


@dataclass
class PreparedDitSteps:
    program: Any
    advance: Callable[[], None]  # run the step eagerly, or replay its graph
    dit_fn: Callable
    timesteps: torch.Tensor  # [steps] on the device: each step's timestep input
    coeffs: torch.Tensor  # [steps, k] float32 on the device: each step's coefficients
    eager: bool = True  # the steps run eagerly (no captured graph)
    working: Optional[tuple] = None  # (rows, latent_h, latent_w) of the DiT call, for ``streamed_blocks_held``


def streams_weights(engine: LeanEngine) -> bool:
    """Whether the engine's denoiser streams blocks from the host at every step (``stream`` left some out)."""
    streamer = getattr(engine.placement, "streamer", None)
    return streamer is not None and bool(streamer.schedule.streamed)


def eager_while_streaming(engine: LeanEngine, mode: str) -> str:
    """``none`` (logged) for a DiT whose blocks stream at every step (module docstring), else ``mode``."""
    if mode == Acceleration.NONE.value or not is_dit_family(engine.family) or not streams_weights(engine):
        return mode
    logger.info("acceleration=%r: the DiT's weights stream under the VRAM budget, so its steps are bound by the "
                "copies; running them eagerly (the same result; a replayed graph measured slower)", mode)
    return Acceleration.NONE.value


def prepare_dit_steps(engine: LeanEngine, mode: str, key: Hashable, build: Callable[[Callable], Any],
                      prepare: Callable[[Any], None], eager_fn: Callable, compiled_fn: Callable[[], Callable],
                      runner: Optional[GraphRunner], timesteps: torch.Tensor, coeffs: torch.Tensor,
                      working: Optional[tuple] = None) -> PreparedDitSteps:
    """The program for ``mode`` (a resolved acceleration), loaded by ``prepare``: built and run eagerly, or the
    runner's captured one for ``key`` (``compiled_fn()`` gives the compiled transformer call). ``working``: the
    DiT call's (rows, latent_h, latent_w) where the run may hold streamed blocks in its spare activation room."""
    runner = runner if runner is not None else default_runner()
    compiled = mode == Acceleration.COMPILE.value
    mode = eager_while_streaming(engine, mode)
    if mode != Acceleration.NONE.value and runner.was_released(engine, key, compiled):
        logger.info("acceleration=%r: a stage released this step's CUDA graph to fit the VRAM budget in an earlier "
                    "run, so each run would capture it again; running the DiT steps eagerly (the same result)", mode)
        mode = Acceleration.NONE.value
    if mode == Acceleration.NONE.value:
        program = build(eager_fn)
        prepare(program)
        return PreparedDitSteps(program, program.step, eager_fn, timesteps, coeffs, True, working)
    fn = compiled_fn() if compiled else eager_fn
    captured = runner.step_for(engine, key, lambda: build(fn), prepare, compiled=compiled)
    return PreparedDitSteps(captured.program, captured.replay, fn, timesteps, coeffs, False, working)


def run_dit_steps(engine: LeanEngine, prepared: PreparedDitSteps, on_step: Callable[[int], None]) -> torch.Tensor:
    """Every step of ``prepared`` (module docstring); returns the final state (a new tensor on the device)."""
    program = prepared.program
    cuda = engine.device.type == "cuda"
    in_flight: collections.deque = collections.deque()
    program.dit_fn = prepared.dit_fn
    try:
        with streamed_blocks_held(engine, prepared.working if prepared.eager else None), \
                next_forward_prefetch(engine, prepared.eager) as another_follows:
            steps = prepared.timesteps.shape[0]
            for i in range(steps):
                bridge.check_interrupted()
                another_follows(i + 1 < steps)
                program.set_step(prepared.timesteps[i], prepared.coeffs[i])
                prepared.advance()
                if cuda:
                    bound_run_ahead(in_flight)
                on_step(i)
            return program.sample.clone()
    finally:
        program.dit_fn = None

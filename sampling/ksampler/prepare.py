"""Builds the Fused KSampler's denoiser for an engine: the run's conditioning, the family's model call, and the
program eager or captured (cached per shape in the graph runner, as the other samplers' steps are).

Invariants
- Conditioning: the UNet families encode through ``cfg.encode_conditioning`` (prompt strings or ComfyUI
  CONDITIONING, SDXL size conditioning from the latent's pixel size); the flow DiT through ``flow.captions`` with
  static caption buckets, so any prompt of a bucket replays the same graph; Qwen-Image through its own eager
  program (``qwen_call``).
- A captured program is keyed by everything its kernels depend on (``graph_runner.graph_key`` adds placement,
  adapters and weight addresses); cfg lives in a buffer, so changing it never recaptures.
- The model function is bound for this run only; ``release()`` unbinds it (a cached program must not keep its
  engine alive). A capture that runs out of GPU memory drops this model's graphs and runs eagerly. A DiT whose
  blocks stream at every step runs eagerly (``dit_steps.eager_while_streaming``) and, for the run, holds streamed
  blocks in the activation room its rows leave unused (``memory.spare_room``), as the Fused Flow Sampler does.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Optional

import torch

from ...memory.budget import ensure_room
from ...memory.engine import LeanEngine
from ...memory.spare_room import streamed_blocks_held
from ...memory.stream_prefetch import next_forward_prefetch
from ..cfg import encode_conditioning, unet_calls
from ..compile import compiled_unet_fn, eager_unet_fn
from ..dit_steps import eager_while_streaming
from ..flow.accel import compiled_dit_fn, eager_dit_fn
from ..flow.captions import flow_captions
from ..flow.dit_forward import ImageGrid, caption_capacity, caption_layout
from ..graph_runner import GraphRunner, default_runner
from ..loop import program_key, resolve_acceleration, step_allocator, vae_scale_factor
from ..settings import Acceleration
from .denoiser import Denoiser, DenoiserProgram
from ..qwen.loop import is_qwen_image
from .model_calls import DitModelCall, UNetModelCall
from .qwen_call import prepare_qwen_denoiser
from .settings import KSamplerSettings

logger = logging.getLogger(__name__)


def _unet_parts(engine: LeanEngine, s: KSamplerSettings, x: torch.Tensor, positive: Any, negative: Any):
    factor = vae_scale_factor(engine)
    conditioning = encode_conditioning(engine, s.positive_prompt, s.negative_prompt, x.shape[0], s.guided,
                                       x.shape[2] * factor, x.shape[3] * factor, positive_cond=positive,
                                       negative_cond=negative)
    calls, copies = unet_calls(conditioning, "batched")
    key = ("ksampler",) + program_key(tuple(x.shape), engine.dtype, copies, conditioning, False,
                                      engine.parts.prediction_type, calls)

    def model(alloc):
        return UNetModelCall(tuple(x.shape), engine.dtype, calls, copies, s.guided, alloc)

    return key, model, lambda m: m.load(calls), (eager_unet_fn(engine), compiled_unet_fn)


def _dit_parts(engine: LeanEngine, s: KSamplerSettings, x: torch.Tensor, positive: Any, negative: Any):
    dit = engine.parts.unet
    grid = ImageGrid.of(x.shape[2], x.shape[3], int(dit.config.all_patch_size[0]))
    captions = flow_captions(engine, s.positive_prompt, s.negative_prompt, s.guided, x.shape[0], positive, negative)
    capacity = caption_capacity([int(c.shape[0]) for c in captions])
    layout = caption_layout(dit, captions, grid, capacity, engine.dtype, engine.device)
    key = ("ksampler-flow", tuple(x.shape), engine.dtype, s.guided, capacity, str(layout.caption_freqs.dtype))

    def model(alloc):
        return DitModelCall(x.shape[0], x.shape[1], grid, layout, engine.dtype, s.guided, alloc)

    return key, model, lambda m: m.load(layout), (eager_dit_fn(dit), compiled_dit_fn)


def prepare_denoiser(engine: LeanEngine, s: KSamplerSettings, x: torch.Tensor, sigmas: torch.Tensor, positive: Any,
                     negative: Any, sampling, runner: Optional[GraphRunner]) -> tuple[Denoiser, Callable[[], None]]:
    """``(denoiser, release)`` for this run; call inside ``engine.session("unet")`` under ``torch.no_grad()``."""
    if is_qwen_image(engine):
        return prepare_qwen_denoiser(engine, s, x, sigmas, positive, negative)
    flow = engine.parts.is_flow
    key, model_of, load, (eager, compiled_of) = (_dit_parts if flow else _unet_parts)(engine, s, x, positive, negative)
    prediction = "flow" if flow else engine.parts.prediction_type
    log_sigmas = None if flow else sampling.sigmas.float().log()
    cfg = torch.tensor(float(s.cfg), dtype=torch.float32)

    def build(fn) -> DenoiserProgram:
        program = DenoiserProgram(model_of(step_allocator(engine)), tuple(x.shape), prediction, log_sigmas,
                                  step_allocator(engine))
        program.model.fn = fn
        return program

    def prepare(program: DenoiserProgram) -> None:
        load(program.model)
        program.cfg.copy_(cfg)
        program.set_call(x, sigmas[0])

    mode = resolve_acceleration(engine, s.acceleration, runner)
    mode = eager_while_streaming(engine, mode)
    program, advance = None, None
    fn = eager
    if mode != Acceleration.NONE.value:
        runner = runner if runner is not None else default_runner()
        compiled = mode == Acceleration.COMPILE.value
        fn = compiled_of(engine) if compiled else eager
        try:
            captured = runner.step_for(engine, key, lambda: build(fn), prepare, compiled=compiled)
            program, advance = captured.program, captured.replay
        except torch.cuda.OutOfMemoryError as exc:
            runner.clear(engine)
            logger.warning("capturing the %s denoiser ran out of GPU memory (%s); dropped this model's cached graphs "
                           "and running eagerly", mode, exc)
            fn = eager
    eager_run = program is None
    if eager_run:
        if engine.placement.budget.hard:  # cached graphs of other runs must not crowd out an eager run
            ensure_room(engine, engine.placement.budget.activation_bytes, "eager model run")
        program = build(fn)
        prepare(program)
        advance = program.step
    program.model.fn = fn
    held = contextlib.ExitStack()
    if flow and eager_run:
        rows = x.shape[0] * (2 if s.guided else 1)
        held.enter_context(streamed_blocks_held(engine, (rows, *x.shape[2:])))
        held.enter_context(next_forward_prefetch(engine, True))(True)  # the sampler's calls: one model, in turn

    def release() -> None:
        held.close()
        program.model.fn = None

    return Denoiser(program, advance), release

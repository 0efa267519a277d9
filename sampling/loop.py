"""The Fused DDIM Sampler loop: prompts + seed (+ an input latent) -> LATENT, as diffusers' pipelines compute it.

Invariants (what makes the output equal diffusers' ``StableDiffusion(XL)Pipeline`` / ``...Img2ImgPipeline`` with
``DDIMScheduler``, same seed on a CPU generator, ``output_type="latent"`` divided by the VAE scaling factor):
- Schedule: the model's scheduler config as the family's diffusers pipeline runs it (``ddim.pipeline_config``: the
  SD1.x/SD2.x pipelines rewrite ``steps_offset`` to 1 and ``clip_sample`` to False), with the chosen spacing.
- Noise: one ``torch.Generator("cpu").manual_seed(seed)``; the initial noise is drawn first, in float32, for the
  whole batch shape ``[batch, C, h, w]`` (ComfyUI's and diffusers' convention); with eta > 0 every step then draws
  its variance noise of the same shape from the same generator, in step order (as ``DDIMScheduler.step`` does).
  A ``latent_image`` with a ``batch_index`` (ComfyUI's Latent From Batch / Repeat Latent Batch) draws as ComfyUI's
  ``prepare_noise`` does: one ``[1, C, h, w]`` draw per index up to the largest, row ``i`` taking draw
  ``batch_index[i]``, so image 3 of a batch regenerates alone; the output LATENT keeps the ``batch_index``.
- txt2img starts from that noise (DDIM's ``init_noise_sigma`` is 1). img2img (a ``latent_image``, or ``denoise``
  < 1) runs the last ``int(steps * denoise)`` timesteps of the ``steps`` schedule and starts from
  ``add_noise(latent * scaling_factor, noise, first timestep)``. Without a ``latent_image`` an img2img run starts
  from an empty (zero) latent, as ComfyUI's EmptyLatentImage does.
- The UNet works in the scaled latent space; the LATENT in and out is raw VAE space on the CPU in float32
  (ComfyUI's convention, GUIDE section 6).
- Every model call happens inside ``engine.session(...)``; ``bridge.check_interrupted()`` runs before every step
  and the progress bar advances after it. An interruption propagates after the session has been closed, so the
  engine (and any cached CUDA graph) stays valid for the next run.
- On the GPU the host enqueues at most two steps ahead of the device, so progress and interruption track the
  GPU within a step.

Why hand-written rather than calling a diffusers pipeline (which stays the reference in the tests): the fused
CFG+DDIM kernel, CUDA-graph replay, placement sessions and ComfyUI's LATENT/``batch_index``/CONDITIONING
conventions do not fit a pipeline's ``__call__``.
"""
from __future__ import annotations

import collections
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from .. import bridge
from ..kernels.dispatch import triton_unusable_reason
from ..memory.budget import ensure_room
from ..memory.engine import LeanEngine
from . import ddim
from .cfg import Conditioning, encode_conditioning, unet_calls
from .fallback import ChunkNoise, attempts, conditioning_rows, run_with_fallback
from .latent_input import batch_index_of, batch_latents, check_latent, check_latent_size, initial_noise
from .compile import compile_errors, compile_failure, compiled_unet_fn, eager_unet_fn
from .graph_runner import GraphRunner, default_runner
from .program import STATE_DTYPE, StepProgram, plain_allocator
from .settings import Acceleration, SamplerSettings

logger = logging.getLogger(__name__)

_RUN_AHEAD = 2


def vae_scale_factor(engine: LeanEngine) -> int:
    """Pixels per latent cell (8 for every SD VAE): 2 ** (number of VAE levels - 1), as diffusers computes it (for
    Qwen-Image's VAE, ``2 ** len(temperal_downsample)``, as ``QwenImagePipeline`` does)."""
    config = engine.parts.vae.config
    if hasattr(config, "temperal_downsample"):
        return 2 ** len(config.temperal_downsample)
    return 2 ** (len(config.block_out_channels) - 1)


def sample(engine: LeanEngine, settings: SamplerSettings, latent_image: Optional[dict] = None,
           conditioning: Optional[Conditioning] = None, runner: Optional[GraphRunner] = None,
           quiet: bool = False, positive_cond: Any = None, negative_cond: Any = None) -> dict:
    """Run the sampler; returns ``{"samples": raw latents [B, C, h, w] float32 on the CPU}``.

    ``positive_cond`` / ``negative_cond``: ComfyUI CONDITIONING that replaces the prompt string of its side
    (``prompts.encode_for_sampler``); ignored when a precomputed ``conditioning`` is given.
    """
    if not isinstance(engine, LeanEngine):
        raise TypeError(f"lean_model: expected a LEAN_MODEL from the Memory Pool Loader, got {type(engine).__name__}")
    if engine.parts.is_flow:
        raise ValueError(f"lean_model is a {engine.family} model (a flow-matching DiT); the Fused DDIM Sampler runs "
                         f"SD1.x/SD2.x/SDXL: use the Fused Flow Sampler for it")
    s = settings.validated()
    parts = engine.parts
    config = ddim.config_with(ddim.pipeline_config(parts.scheduler_config, parts.is_sdxl),
                              timestep_spacing=s.timestep_spacing)
    scale = parts.vae_scaling_factor
    factor = vae_scale_factor(engine)
    init = None
    batch_index = None
    if latent_image is not None:
        rows = check_latent(engine, latent_image)
        check_latent_size(rows.shape, factor, s.batch_size)
        init = batch_latents(rows.float().cpu(), s.batch_size)
        batch_index = batch_index_of(latent_image, rows.shape[0], init.shape[0])
        height, width = init.shape[2] * factor, init.shape[3] * factor
    else:
        height, width = s.height, s.width
        if s.denoise < 1.0:
            init = torch.zeros(s.batch_size, parts.latent_channels, height // factor, width // factor)
    img2img = init is not None
    schedule = ddim.make_schedule(config, s.steps, s.eta, s.timestep_spacing, s.denoise if img2img else 1.0)
    shape = (s.batch_size, parts.latent_channels, height // factor, width // factor) if init is None \
        else tuple(init.shape)

    generator = torch.Generator(device="cpu").manual_seed(s.seed)
    noise = initial_noise(shape, generator, batch_index)
    x_init = noise if not img2img else ddim.add_noise(config, init * scale, noise, schedule.start_timestep)

    if conditioning is None:
        bridge.check_interrupted()
        conditioning = encode_conditioning(engine, s.positive, s.negative, shape[0], s.guided, height, width,
                                           positive_cond=positive_cond, negative_cond=negative_cond,
                                           syntax=s.prompt_syntax)
    elif conditioning.batch != shape[0] or conditioning.guided != s.guided:
        raise ValueError(f"conditioning has batch {conditioning.batch} (guided={conditioning.guided}); this run "
                         f"needs batch {shape[0]} (guided={s.guided})")
    with engine.session("unet"), torch.no_grad():
        x = _denoise_degrading(engine, conditioning, x_init, schedule, s, generator, runner, quiet)
    out = {"samples": x.float().cpu() / scale}
    if batch_index is not None:
        out["batch_index"] = batch_index
    return out


def _denoise_degrading(engine: LeanEngine, conditioning: Conditioning, x_init: torch.Tensor,
                       schedule: ddim.DDIMSchedule, s: SamplerSettings, generator: torch.Generator,
                       runner: Optional[GraphRunner], quiet: bool) -> torch.Tensor:
    """``denoise``, retried in lower-memory configurations when memory runs out (``sampling.fallback``)."""
    batch = x_init.shape[0]

    def run(attempt, bar) -> torch.Tensor:
        spans = attempt.chunks(batch)
        if len(spans) == 1:
            prepared = prepare_steps(engine, conditioning, x_init, schedule, s.cfg, attempt.cfg_mode, s.acceleration,
                                     runner)
            return run_steps(prepared, generator, lambda i: bar.update(1))
        noise = ChunkNoise(tuple(x_init.shape), len(schedule), generator) if schedule.eta > 0 else None
        finished = []
        for a, b in spans:
            prepared = prepare_steps(engine, conditioning_rows(conditioning, a, b), x_init[a:b], schedule, s.cfg,
                                     attempt.cfg_mode, s.acceleration, runner)
            finished.append(run_steps(prepared, None, lambda i: bar.update(1), noise.rows(a, b) if noise else None))
            prepared = None
        return torch.cat(finished)

    plan = attempts(batch, conditioning.guided, s.cfg_mode)
    return run_with_fallback(run, plan, batch, len(schedule), engine.device, generator, quiet)


def resolve_acceleration(engine: LeanEngine, acceleration: str, runner: Optional[GraphRunner]) -> str:
    """The acceleration that can run here: CUDA graphs need a CUDA device (or a test backend); compile needs a
    placement whose budget allows it (``VramBudget.supports_compile``) and, on a CUDA device, a usable Triton
    (installed, compute capability 7.0+). Fallbacks are logged."""
    if acceleration == Acceleration.NONE.value:
        return acceleration
    cuda_backend = runner is None or getattr(runner.backend, "name", "") == "cuda"
    if engine.device.type != "cuda" and cuda_backend:
        logger.info("acceleration=%r needs a CUDA device; running eagerly on %s", acceleration, engine.device)
        return Acceleration.NONE.value
    placement = engine.placement
    if acceleration == Acceleration.COMPILE.value and not placement.budget.supports_compile:
        logger.info("the %r VRAM policy does not support torch.compile; using cuda_graph without compile",
                    placement.name)
        return Acceleration.CUDA_GRAPH.value
    if acceleration == Acceleration.COMPILE.value and engine.device.type == "cuda":
        reason = triton_unusable_reason(engine.device)
        if reason is not None:  # inductor would fail at the first call ("Cannot find a working triton ...")
            logger.warning("acceleration='compile+cuda_graph' needs Triton for torch.compile on the GPU, but %s; "
                           "using cuda_graph without compile", reason)
            return Acceleration.CUDA_GRAPH.value
    return acceleration


def step_allocator(engine: LeanEngine):
    """The engine's buffer pool as a step program's allocator (plain allocation without a pool)."""
    pool = engine.pool
    get = getattr(pool, "get", None) if pool is not None else None
    if callable(get):
        return lambda role, shape, dtype: get(role=role, shape=tuple(shape), dtype=dtype, device=engine.device)
    return plain_allocator(engine.device)


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host -> device without blocking the host: a pageable copy would first wait for the stream's queued steps."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def program_key(shape: tuple, dtype: torch.dtype, copies: int, conditioning: Conditioning, has_noise: bool,
                prediction: str, calls) -> tuple:
    """The graph-cache key of one step program: every shape, dtype and flag its captured graph depends on."""
    return (shape, dtype, copies, conditioning.guided, has_noise, prediction,
            tuple((tuple(c.context.shape), c.context.dtype,
                   None if c.added is None else tuple((k, tuple(v.shape), v.dtype) for k, v in c.added.items()))
                  for c in calls))


@dataclass
class PreparedSteps:
    """A step program ready to run a schedule: its buffers loaded, its per-step tables on the device."""

    program: StepProgram
    advance: Callable[[], None]  # run one step eagerly, or replay the captured graph
    unet_fn: Callable
    t_table: torch.Tensor
    table: torch.Tensor
    has_noise: bool
    shape: tuple


def prepare_steps(engine: LeanEngine, conditioning: Conditioning, x_init: torch.Tensor, schedule: ddim.DDIMSchedule,
                  cfg: float, cfg_mode: str, acceleration: str, runner: Optional[GraphRunner] = None) -> PreparedSteps:
    """Build (or fetch the cached, captured) step program for this run; call inside ``session("unet")``.

    Every sampler goes through here, so equal shapes share one cached CUDA graph. A capture that runs out of GPU
    memory drops this model's cached graphs and, if there were others, tries once more (their pools may be what it
    lacked: under a hard VRAM budget they count against it); failing that it falls back to eager steps.
    """
    device = engine.device
    calls, copies = unet_calls(conditioning, cfg_mode)
    table = torch.empty(len(schedule), 6, dtype=torch.float32)
    table[:, 0] = float(cfg)
    table[:, 1:] = schedule.coefficients
    table = upload(table, device)
    t_table = upload(torch.tensor(schedule.timesteps, dtype=torch.int64), device)
    has_noise = schedule.eta > 0
    shape = tuple(x_init.shape)
    model_dtype = engine.dtype

    def build(unet_fn) -> StepProgram:
        return StepProgram(unet_fn, shape, model_dtype, calls, copies, has_noise, conditioning.guided,
                           schedule.prediction_type, step_allocator(engine))

    def prepare(program: StepProgram) -> None:
        program.load(calls, x_init.to(device))
        program.set_step(t_table[0], table[0], torch.zeros(shape) if has_noise else None)

    mode = resolve_acceleration(engine, acceleration, runner)
    budget = engine.placement.budget
    if mode == Acceleration.NONE.value and budget.hard:  # cached graphs of other runs must not crowd it out
        ensure_room(engine, budget.activation_bytes, "eager UNet run")
    program = None
    advance = None
    unet_fn = eager_unet_fn(engine)
    if mode != Acceleration.NONE.value:
        key = program_key(shape, model_dtype, copies, conditioning, has_noise, schedule.prediction_type, calls)
        captured = _capture(engine, mode, key, build, prepare, unet_fn, runner, shape[0])
        if captured is not None:
            program, advance, unet_fn = captured
    if program is None:
        program = build(unet_fn)
        prepare(program)
        advance = program.step
    return PreparedSteps(program, advance, unet_fn, t_table, table, has_noise, shape)


def _capture(engine: LeanEngine, mode: str, key: tuple, build: Callable, prepare: Callable, unet_fn: Callable,
             runner: Optional[GraphRunner], batch: int) -> Optional[tuple]:
    """(program, replay, unet_fn) of the captured (or cached) step; ``None`` when capturing ran out of GPU memory
    (this model's cached graphs dropped; one more try when other graphs were holding memory)."""
    runner = runner if runner is not None else default_runner()
    compiled = mode == Acceleration.COMPILE.value
    graph_fn = compiled_unet_fn(engine) if compiled else unet_fn
    captured, error = None, None
    for _ in range(2):
        had_others = bool(runner.cached_keys(engine))
        try:
            captured = runner.step_for(engine, key, lambda: build(graph_fn), prepare, compiled=compiled)
        except torch.cuda.OutOfMemoryError as exc:
            error = str(exc)
        except compile_errors() as exc:
            if not compiled:
                raise
            raise RuntimeError(
                f"acceleration={mode!r}: torch.compile could not compile the UNet ({compile_failure(exc)}); use "
                f"acceleration='cuda_graph' (the same CUDA-graph replay without compiling), or install what "
                f"torch's inductor needs (a Triton matching torch and a C++ compiler)") from exc
        if captured is not None:
            return captured.program, captured.replay, graph_fn
        runner.clear(engine)  # outside the except block: the failed capture's tensors are released
        if not had_others:  # nothing else was holding memory: a second try would fail the same way
            break
    logger.warning("capturing the %s step (batch %d) ran out of GPU memory (%s); dropped this model's cached "
                   "graphs and running eagerly", mode, batch, error)
    return None


def bound_run_ahead(in_flight: collections.deque) -> None:
    """After a step was enqueued on the current CUDA stream: record its event and wait for the oldest one once more
    than ``_RUN_AHEAD`` are in flight, so the host stays at most that many steps ahead of the device."""
    event = torch.cuda.Event()
    event.record()
    in_flight.append(event)
    if len(in_flight) > _RUN_AHEAD:
        in_flight.popleft().synchronize()


def run_steps(prepared: PreparedSteps, generator: Optional[torch.Generator],
              on_step: Callable[[int], None],
              step_noise: Optional[Callable[[int], torch.Tensor]] = None) -> torch.Tensor:
    """Run the schedule; returns the final scaled latents (float32, on the device, a new tensor).

    Per step: interruption check, the next step's values into the buffers, run or replay, bounded run-ahead (the
    host enqueues at most ``_RUN_AHEAD`` steps ahead of the device), then ``on_step(i)``. ``generator`` (CPU)
    supplies the eta noise, or ``step_noise(i)`` when given (rows of draws made for a larger batch). A cached
    program must not keep its engine alive (the cache is weak in the model), so the UNet call is bound for this
    run only; a real CUDA graph replays without calling it.
    """
    program, shape = prepared.program, prepared.shape
    device = prepared.table.device
    cuda = device.type == "cuda"
    in_flight: collections.deque = collections.deque()
    program.unet_fn = prepared.unet_fn
    try:
        for i in range(prepared.t_table.shape[0]):
            bridge.check_interrupted()
            noise = None
            if prepared.has_noise:
                noise = step_noise(i) if step_noise is not None else \
                    torch.randn(shape, generator=generator, dtype=STATE_DTYPE)
            if noise is not None and cuda:
                noise = noise.pin_memory()  # async upload; the host allocator keeps it until the copy is done
            program.set_step(prepared.t_table[i], prepared.table[i], noise)
            prepared.advance()
            if cuda:
                bound_run_ahead(in_flight)
            on_step(i)
    finally:
        program.unet_fn = None
    return program.sample.clone()


@torch.no_grad()
def denoise(engine: LeanEngine, conditioning: Conditioning, x_init: torch.Tensor, schedule: ddim.DDIMSchedule,
            cfg: float, cfg_mode: str = "batched", acceleration: str = "none",
            generator: Optional[torch.Generator] = None, runner: Optional[GraphRunner] = None,
            quiet: bool = False) -> torch.Tensor:
    """The denoising loop over ``schedule`` from ``x_init`` (scaled latents); call inside ``session("unet")``.

    Returns the final scaled latents (float32, on ``engine.device``). ``generator`` (CPU) supplies the eta noise.
    """
    if schedule.eta > 0 and generator is None:
        raise ValueError("eta > 0 needs a CPU generator for the per-step noise")
    prepared = prepare_steps(engine, conditioning, x_init, schedule, cfg, cfg_mode, acceleration, runner)
    with bridge.ProgressBar(len(schedule), desc="Fused DDIM", quiet=quiet) as bar:
        return run_steps(prepared, generator, lambda i: bar.update(1))

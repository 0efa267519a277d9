"""Stream Scheduler Sampler: text encoding of batch k+1, denoising of batch k and decoding of batch k-1, overlapped.

The run (prompt-major images ``n = p * images_per_prompt + i``, image n seeded ``seed + n``; the prompts are the
``prompts`` lines or the rows of a connected ``positive_cond``, ``stream.conditioning``) is cut into
consecutive batches. Each cycle k the host, on one thread, enqueues:
  1. the decode of batch k-1 on the ``vae`` stream (after the decode of batch k-2 was finished and its rows
     written: the decode queue holds one batch),
  2. the text encoding of batch k+1 on the ``text`` stream (the CPU under ``lowvram``; each prompt once),
  3. the denoising steps of batch k on the ``unet`` stream (the caller's stream, where the CUDA graphs replay),
so the GPU runs k-1's decode and k+1's encoding alongside k's UNet steps; events order every hand-over
(``streams.py``). On the CPU the streams are no-ops and the same code runs the stages one after the other.
The family decides the text stage, the CONDITIONING reader and the batch denoiser (``_FAMILIES``, keyed by
``ModelParts.is_flow``): CLIP prompts and DDIM for the UNet families (``text.py``, ``denoise.py``), Qwen3 captions
and the flow sampler's steps for Z-Image (``flow.py``); batching, streams, budgets, retries and decoding are shared.

Invariants
- Image n equals the Fused DDIM Sampler's output (a flow family: the Fused Flow Sampler's) for its prompt with
  seed ``seed + n`` and batch size 1: its initial noise is drawn on the CPU from its own
  ``torch.Generator().manual_seed(seed + n)`` as a ``[1, C, h, w]`` tensor, even inside a batch (batch rows are
  concatenated, never drawn together), its conditioning is its own prompt's, and the step math is the sampler's
  ``StepProgram`` (``FlowStepProgram``). In fp32 a DDIM batch of one is bit-identical; larger batches differ by the
  denoiser's batched floating-point error only. The LATENT is raw: ``x / scaling_factor + shift_factor``.
- Adapters (LoRA): the text session attaches the view's adapters on the ``text`` stream; when the view has any,
  the ``unet`` stream waits for the ``text`` stream before its own session, so weight or strength writes of the
  two sessions never overlap on the GPU. The VAE session runs on a view without adapters.
- Memory: one batch in each stage (bounded queues); the batch size (``batching.py``) counts the UNet's
  activations and one concurrent decode against the free VRAM and the loader's budget. Under the loader's
  ``stream`` policy the budget is a hard limit on the memory the process holds: the stages then run one after the
  other on one stream (no overlap, see ``streams.py``), cached blocks go back to the driver between stages, and the
  decodes wait until every batch is denoised and the run's CUDA graphs (whose pools stay reserved while they
  live) are dropped; the exact tiled decode then gets a share of what the budget leaves after the UNet's resident
  weights and the VAE weights (``decode_budget``). The next run recaptures its graphs. The whole run holds the
  allocator under the budget (``memory.cap``, ``run_cap_bytes``): cached blocks are returned before the process
  would go over it, and only live tensors that do not fit raise out-of-memory (handled as below).
- Out-of-memory while denoising a batch: nothing of that batch has been written; the batch size is halved and
  the same images are retried (earlier batches stay queued or written, later ones are not started), so no image
  is lost or produced twice (``DecodeStage`` refuses to write a row twice and the run checks every row was
  written). At batch size 1 the error is re-raised with the sizes tried.
- One progress bar of ``images x steps`` units; it never goes backwards (a retried batch re-advances nothing).
- Interruption (``bridge.check_interrupted``) is checked before every step and between stages; any exception
  stops all three stages: the streams are synchronised (no copy lands in a buffer after the run ended), the
  sessions are closed, nothing is returned, and the exception propagates unchanged with a note on the progress;
  its frames no longer hold the run's outputs or the stages' buffers.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch

from ... import bridge
from ...batch import release_frames
from ...memory.budget import run_cap_bytes
from ...memory.host_memory import check_host_bytes
from ...memory.out_of_memory import is_out_of_memory
from ...memory.cap import allocator_cap, release_library_workspaces
from ...memory.engine import LeanEngine
from ...memory.families import check_node_runs
from .. import ddim
from ..graph_runner import GraphRunner, default_runner
from ..loop import vae_scale_factor
from .batching import auto_batch, available_bytes, decode_reserve, per_image_bytes, saturating_batch, shrink
from .conditioning import conditioning_rows, read_conditioning_inputs
from .decode import DecodeStage, needs_tiles, untiled_decode_bytes
from ..loop import upload
from .denoise import denoise_batch
from .flow import FlowTextStage, flow_denoiser, read_flow_conditioning
from ...vae.tiled import DECODE_RESERVED_FACTOR
from .settings import ImageJob, StreamSettings
from .streams import StageStreams, Timeline
from .text import TextStage

logger = logging.getLogger(__name__)

_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


@dataclass(frozen=True, eq=False)
class StreamResult:
    images: torch.Tensor  # IMAGE [N, H, W, 3] float32 0..1, CPU, prompt-major order
    latents: torch.Tensor  # raw LATENT samples [N, C, h, w] float32, CPU
    batch_sizes: tuple  # the batch sizes the run used, in order (after any out-of-memory retries)
    oom_retries: int


def initial_noise(jobs: list[ImageJob], shape: tuple) -> torch.Tensor:
    """Each image's noise from its own CPU generator (seed + n), ``[1, C, h, w]`` float32, stacked.

    Each draw goes straight into its row of one tensor instead of through ``torch.cat``: on a many-core host a CPU
    cat wakes the whole intra-op thread pool, which after the host sat idle waiting for the GPU costs more than the
    draws, and for the run's first batch the GPU waits for it. The values are the same."""
    noise = torch.empty((len(jobs),) + tuple(shape), dtype=torch.float32)
    for row, job in enumerate(jobs):
        torch.randn((1,) + tuple(shape), generator=torch.Generator("cpu").manual_seed(job.seed), dtype=torch.float32,
                    out=noise[row:row + 1])
    return noise


class _Progress:
    """One bar over images x steps that only moves forward."""

    def __init__(self, bar, steps: int):
        self.bar, self.steps, self.shown = bar, steps, 0

    def at(self, start: int, batch: int, step: int) -> None:
        units = start * self.steps + (step + 1) * batch
        if units > self.shown:
            self.bar.update(units - self.shown)
            self.shown = units


def decode_budget(engine: LeanEngine) -> int:
    """Activation bytes for one tiled decode under a hard budget: what the budget leaves after the UNet's resident
    weights and the loader's headroom (``budget.activation_room_bytes``) less the VAE weights, divided by
    ``DECODE_RESERVED_FACTOR``; at least 64 MiB. The decodes run after every batch is denoised and the run's CUDA
    graphs are dropped (``DecodeStage`` deferred mode), so no UNet activation pool is held beside them."""
    budget = engine.placement.budget
    left = budget.activation_room_bytes - budget.vae_bytes
    return max(int(left / DECODE_RESERVED_FACTOR), 64 * 2 ** 20)


def choose_batch(engine: LeanEngine, s: StreamSettings, tiled: bool, latent_hw: tuple) -> int:
    if s.max_batch:
        return min(s.max_batch, s.n_images)
    reserve = 0 if tiled else decode_reserve(engine, untiled_decode_bytes(s.height, s.width, engine.vae_dtype))
    per = per_image_bytes(engine, latent_hw[0], latent_hw[1], s.guided)
    batch = auto_batch(s.n_images, per, available_bytes(engine), reserve,
                       saturating_batch(latent_hw[0], latent_hw[1], s.guided))
    logger.info("Stream Scheduler Sampler: automatic batch of %d images (%.0f MB activations per image)", batch,
                per / 2 ** 20)
    return batch


@dataclass(frozen=True, eq=False)
class _Family:
    """What the pipeline runs for the engine's family: its text stage class, its CONDITIONING reader and its batch
    denoiser ``(conditioning, x_init, on_step) -> final model-space latents`` (call inside the ``unet`` session)."""

    text_stage: type
    read_inputs: Callable
    denoise: Callable


def _ddim_family(engine: LeanEngine, s: StreamSettings, latent_shape: tuple,
                 runner: Optional[GraphRunner]) -> _Family:
    config = ddim.config_with(ddim.pipeline_config(engine.parts.scheduler_config, engine.parts.is_sdxl),
                              timestep_spacing=s.timestep_spacing)  # as the Fused DDIM Sampler
    schedule = ddim.make_schedule(config, s.steps, 0.0, s.timestep_spacing, 1.0)

    def denoise(conditioning, x_init: torch.Tensor, on_step: Callable[[int], None]) -> torch.Tensor:
        return denoise_batch(engine, conditioning, x_init, schedule, s.cfg, s.acceleration, on_step, runner)

    return _Family(TextStage, read_conditioning_inputs, denoise)


def _flow_family(engine: LeanEngine, s: StreamSettings, latent_shape: tuple,
                 runner: Optional[GraphRunner]) -> _Family:
    return _Family(FlowTextStage, read_flow_conditioning, flow_denoiser(engine, s, latent_shape, runner))


_FAMILIES = {False: _ddim_family, True: _flow_family}  # keyed by ModelParts.is_flow


@torch.no_grad()
def run_stream(engine: LeanEngine, settings: StreamSettings, runner: Optional[GraphRunner] = None,
               timeline: Optional[Timeline] = None, quiet: bool = False, positive_cond: Any = None,
               negative_cond: Any = None) -> StreamResult:
    """Sample every prompt's images through the three-stage pipeline (module docstring).

    ``positive_cond`` / ``negative_cond``: ComfyUI CONDITIONING that replaces the ``prompts`` lines (one prompt per
    row) / the ``negative`` text (1 row shared, or one row per prompt); see ``stream.conditioning``.
    """
    if not isinstance(engine, LeanEngine):
        raise TypeError(f"lean_model: expected a LEAN_MODEL from the Memory Pool Loader, got {type(engine).__name__}")
    check_node_runs(engine.family, "Stream Scheduler Sampler")
    if not isinstance(settings, StreamSettings):
        raise TypeError(f"settings: expected a StreamSettings, got {type(settings).__name__}")
    rows = 0 if positive_cond is None else conditioning_rows(positive_cond, "positive_cond")
    parts = engine.parts
    s = replace(settings, positive_rows=rows, flow=parts.is_flow).validated()
    factor = vae_scale_factor(engine)
    latent_shape = (parts.latent_channels, s.height // factor, s.width // factor)
    family = _FAMILIES[parts.is_flow](engine, s, latent_shape, runner)
    n = len(s.jobs())
    check_host_bytes(n * (s.height * s.width * 3 + math.prod(latent_shape)) * 4, "prompts",
                     f"{n} images of {s.width}x{s.height} px and their latents (float32)",
                     "sample fewer prompts or images_per_prompt per run, or at a smaller size")
    args = (engine, s, latent_shape, family, runner, timeline, quiet, positive_cond, negative_cond)
    if not engine.placement.budget.hard:
        return _run(*args)
    release_library_workspaces(engine.device)  # earlier runs' cuBLAS workspaces are not this run's to hold
    with allocator_cap(engine.device, run_cap_bytes(engine)):
        return _run(*args)


def _run(engine: LeanEngine, s: StreamSettings, latent_shape: tuple, family: _Family, runner: Optional[GraphRunner],
         timeline: Optional[Timeline], quiet: bool, positive_cond: Any, negative_cond: Any) -> StreamResult:
    jobs = s.jobs()
    n = len(jobs)
    budgeted = engine.placement.budget.hard
    streams = StageStreams(engine.device, overlap=not budgeted)
    with streams.use("text"):  # read (and refused) before any model runs; the text stage reads them on this stream
        given = family.read_inputs(engine, positive_cond, negative_cond, s.n_prompts, width=s.width,
                                   height=s.height, guided=s.guided)
    if timeline is not None:
        timeline.begin(streams)
    # under a hard budget the decode is always the exact tiled one (one tile when the budget allows it), sized by
    # ``decode_budget``; otherwise tiles only when an untiled decode would not fit
    tiled = bool(s.decode_tile_size) or budgeted or needs_tiles(
        engine, s.height, s.width, available_bytes(engine) if engine.device.type == "cuda" else None)
    batch = choose_batch(engine, s, tiled, latent_shape[1:])
    images = torch.empty((n, s.height, s.width, 3), dtype=torch.float32)
    latents = torch.empty((n,) + latent_shape, dtype=torch.float32)
    text = family.text_stage(engine, s, jobs, streams, timeline, given=given)
    graphs = runner if runner is not None else default_runner()

    def drop_graphs() -> None:  # budgeted: the captured UNet's memory pool must not sit beside the decode
        graphs.clear(engine)
        _settle(streams)

    decoder = DecodeStage(engine, s.decode_tile_size, tiled, streams, images, latents, timeline,
                          decode_budget=decode_budget(engine) if budgeted else None,
                          before_deferred=drop_graphs if budgeted else None)
    cycles = _Cycles(engine, s, jobs, latent_shape, family.denoise, timeline, streams, text, decoder)
    try:
        with bridge.ProgressBar(n * s.steps, desc="Stream sampler", quiet=quiet) as bar:
            cycles.run(batch, _Progress(bar, s.steps))
            decoder.drain()
        if not bool(decoder.written.all()):
            missing = (~decoder.written).nonzero().flatten().tolist()
            raise RuntimeError(f"Stream Scheduler Sampler: images {missing} were never written (a scheduler bug)")
    except BaseException as exc:
        _note_stop(exc, streams, decoder, n)
        # this frame still runs, so release_frames cannot drop its locals: the run's outputs (images x H x W x 3
        # floats), the stages' buffers and device tensors would stay alive for as long as the caller holds exc
        images = latents = decoder = text = cycles = None
        release_frames(exc)
        raise
    return StreamResult(images, latents, tuple(cycles.used), cycles.retries)


class _Cycles:
    """The run's cycles (module docstring): decode batch k-1, encode batch k+1, denoise batch k; an out-of-memory
    error while denoising halves the batch and retries the same images."""

    def __init__(self, engine: LeanEngine, s: StreamSettings, jobs: list, latent_shape: tuple, denoise: Callable,
                 timeline: Optional[Timeline], streams: StageStreams, text: TextStage, decoder: DecodeStage):
        self.engine, self.s, self.jobs, self.latent_shape, self.denoise = engine, s, jobs, latent_shape, denoise
        self.timeline, self.streams, self.text, self.decoder = timeline, streams, text, decoder
        self.used: list[int] = []  # the batch sizes denoised, in order
        self.tried: list[int] = []  # the batch sizes that ran out of memory
        self.retries = 0

    def run(self, batch: int, progress: "_Progress") -> None:
        n, start, upcoming = len(self.jobs), 0, None
        while start < n:
            stop = min(n, start + batch)
            bridge.check_interrupted()
            current = upcoming if upcoming is not None and (upcoming.start, upcoming.stop) == (start, stop) \
                else self.text.prepare(start, stop)
            _settle(self.streams)  # the text stage is done
            self.decoder.launch()  # batch k-1 (the queue's one entry)
            nxt = min(n, stop + batch)
            upcoming = self.text.prepare(stop, nxt) if stop < n else None
            final, oom = self._denoise(current, start, stop, progress)
            if oom is not None:
                current = upcoming = final = None  # nothing of the failed batch stays referenced
                batch = self._smaller_batch(oom, start, stop)
                continue
            self.used.append(stop - start)
            self.decoder.submit(start, stop, final)
            final = None
            self.text.release_before(stop)
            start = stop

    def _denoise(self, current, start: int, stop: int, progress: "_Progress") -> tuple:
        """(final latents, None), or (None, the out-of-memory error without its frames)."""
        engine, streams, timeline = self.engine, self.streams, self.timeline
        # DDIM's init_noise_sigma is 1 and flow starts at sigma 1: the noise is the start; moved without blocking
        x_init = upload(initial_noise(self.jobs[start:stop], self.latent_shape), engine.device)
        _settle(streams)  # the decode is done
        try:
            streams.hand_over(current.event, current.tensors(), "unet")
            if engine.adapters:  # the text session attached (and detached) them on the text stream
                streams.wait_stage("unet", "text")
            span = timeline.span("unet", f"images {start}-{stop - 1}", range(start, stop)) if timeline \
                else _Null()
            with span, engine.session("unet"):
                final = self.denoise(current.conditioning, x_init,
                                     lambda i, a=start, b=stop - start: progress.at(a, b, i))
        except Exception as exc:  # noqa: BLE001 - only out-of-memory errors are retried; the rest re-raise
            if not is_out_of_memory(exc):
                raise
            return None, exc.with_traceback(None)  # drop the failed frames (and their tensors) before retrying
        return final, None

    def _smaller_batch(self, oom: BaseException, start: int, stop: int) -> int:
        self.retries += 1
        self.tried.append(stop - start)
        self.streams.release_cached()
        smaller = shrink(stop - start)
        if smaller is None:
            raise _OOM(f"Stream Scheduler Sampler: out of memory denoising image {start} even with a batch of 1 "
                       f"(batch sizes tried: {self.tried}); lower the resolution, use a lower-VRAM policy in the "
                       f"Memory Pool Loader or free VRAM. Last error: {oom}") from oom
        logger.warning("out of memory denoising images %d-%d in a batch of %d (%s); retrying them in batches of %d",
                       start, stop - 1, stop - start, oom, smaller)
        return smaller


def _note_stop(exc: BaseException, streams: StageStreams, decoder: DecodeStage, n: int) -> None:
    """The run stopped: wait for the streams (no copy lands after the run ended) and note the progress on ``exc``."""
    streams.synchronize()
    finished = int(decoder.written.sum())
    unfinished = _spans((~decoder.written).nonzero().flatten().tolist())
    note = (f"Stream Scheduler Sampler stopped: {finished} of {n} images were finished (unfinished: images "
            f"{unfinished}); nothing was returned")
    logger.warning("%s (%s: %s)", note, type(exc).__name__, exc)
    if hasattr(exc, "add_note"):
        exc.add_note(note)


def _spans(indices: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    spans: list[list[int]] = []
    for i in indices:
        if spans and spans[-1][1] == i - 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans)


def _settle(streams: StageStreams) -> None:
    """Between stages of a budgeted run (``overlap=False``): return the finished stage's cached blocks to the driver.

    Under a hard VRAM budget the memory the process holds must fit, not just the memory in use: blocks a stage
    freed stay reserved in the caching allocator, sized for that stage (and, for the graph warm-up's side stream,
    usable by no other stream), while the next stage allocates its own."""
    if streams.cuda and not streams.overlap:
        streams.release_cached()


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

"""Stream Edit Sampler: many images edited with one instruction, the encoding of batch k+1 and the decoding of batch
k-1 overlapped with the denoising of batch k on separate CUDA streams.

Invariants
- Edit ``n`` (``edit_inputs``' order: the IMAGE rows, then the folder's files by name) is the one-image Fused Edit
  Sampler run (``edit.sample_qwen_edit``) on its picture with seed ``seed + n`` and the same instruction, negative,
  steps, true_cfg, megapixels and acceleration, exactly (``torch.equal`` on the CPU in fp32): its noise is its own
  ``[1, 16, h, w]`` draw from ``torch.Generator("cpu").manual_seed(seed + n)`` (``stream.scheduler.initial_noise``),
  its text rows are ``edit.encode_edit_rows`` of its own condition picture, its reference tokens are
  ``edit.reference_tokens`` of its picture alone (one VAE call per image), and its steps are
  ``loop.denoise_qwen_batch``, whose batch rows are independent (each text row attends only to its own real
  tokens). Its LATENT row is ``to_raw(unpack(x))`` of the final state, as the one-image run returns it, and its IMAGE
  row the untiled decode of that LATENT (``stream.decode.DecodeStage``, ``raw=True``: exact tiles when an untiled
  decode does not fit).
- Sizes: a batch holds images of one output size and one reference token grid (``EditItem.size_key``); images of
  different sizes are grouped by size (in each group the images keep their order), so the outputs are one IMAGE and
  one LATENT per output size, in the order of each size's first image (one of each when every image has one size).
- Batch size: ``max_batch``, or automatically (0) ``stream.batching.auto_batch`` from the DiT's activation estimate
  for one image's guided call with its reference tokens (``memory.units.trace_units``), the usable free VRAM and the
  loader's budget (``stream.batching.available_bytes``), less one concurrent decode and one VAE encode, and at most
  the batch that fills the GPU (``stream.batching.saturating_dit_batch``: a guided 1024 px edit alone does).
- Overlap (CUDA, every stage resident, no hard budget, stage-aware adapters only): after batch k's first step is
  enqueued, the host enqueues the decode of batch k-1 on the ``vae`` stream and encodes batch k+1 on the ``text``
  stream, inside batch k's session (nothing moves between stages when all are resident); events and
  ``record_stream`` order each hand-over (``stream.streams``). Otherwise (the CPU, a policy that moves weights per
  stage) the same work runs in the same order with no session nested, so the results do not depend on the mode.
- Out-of-memory while denoising a batch: nothing of it was written; its images are retried in batches of half the
  size; at a batch of 1 the error is re-raised with the sizes tried.
- Every input is checked before the first stage opens; one progress bar of images x steps; the interruption check
  runs before every step and between stages; on any error the streams are synchronised and nothing is returned.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from ... import bridge
from ...batch import release_frames
from ...memory.engine import LeanEngine
from ...memory.host_memory import check_host_bytes
from ...memory.out_of_memory import is_out_of_memory
from ...memory.plan import activation_bytes
from ...memory.units import trace_units
from ...memory.vram_budget import StageMode
from ..flow.schedule import flow_sigmas
from ..graph_runner import GraphRunner
from ..loop import upload, vae_scale_factor
from ..settings import MAX_SEED, check_int
from ..stream.batching import auto_batch, available_bytes, decode_reserve, saturating_dit_batch, shrink
from ..stream.decode import DecodeStage, needs_tiles, untiled_decode_bytes
from ..stream.scheduler import initial_noise
from ..stream.settings import MAX_BATCH, ImageJob
from ..stream.streams import StageStreams
from . import edit_images
from .edit import EditSettings, check_edit_model, encode_edit_rows, reference_shapes, reference_tokens
from .edit_inputs import EditItem, collect_items
from .forward import QwenReference
from .latents import PATCH, pack, to_raw, unpack
from .loop import denoise_qwen_batch

logger = logging.getLogger(__name__)

_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
NODE = "Stream Edit Sampler"


@dataclass(frozen=True)
class EditStreamSettings(EditSettings):
    """The Stream Edit Sampler's inputs, minus the model and the images: the Fused Edit Sampler's plus ``max_batch``."""

    max_batch: int = 0  # 0 = automatic

    def validated(self) -> "EditStreamSettings":
        s = super().validated()
        check_int("max_batch", self.max_batch, 0, MAX_BATCH, "0 = automatic from free VRAM, else images per DiT batch")
        return s

    def one_image(self, n: int) -> EditSettings:
        """The Fused Edit Sampler run edit ``n`` equals (module docstring)."""
        return EditSettings(self.instruction, self.negative, self.seed + n, self.steps, self.true_cfg,
                            self.megapixels, self.acceleration)


@dataclass(frozen=True, eq=False)
class EditStreamResult:
    images: list  # one IMAGE [n_g, H, W, 3] float32 0..1 (CPU) per output size
    latents: list  # the same edits' raw LATENT samples [n_g, 16, H/8, W/8] float32 (CPU)
    order: list  # per output: the edit indices of its rows
    batch_sizes: tuple  # the batch sizes denoised, in order (after any out-of-memory retries)
    oom_retries: int


@dataclass(eq=False)
class _Group:
    """The images of one output size and the decode stage writing their outputs."""

    items: list
    decoder: Optional[DecodeStage] = None


@dataclass(eq=False)
class _Encoded:
    """One batch's encoder outputs and the event after which the ``unet`` stream may read them."""

    group: int
    start: int  # row of the group's outputs
    items: list
    text_rows: list
    reference: QwenReference
    event: Any = None


def group_items(items: list[EditItem]) -> list[list[EditItem]]:
    """Items grouped by ``size_key``, groups in the order of their first item, items in order (module docstring)."""
    groups: dict = {}
    for item in items:
        groups.setdefault(item.size_key, []).append(item)
    return list(groups.values())


def overlaps(engine: LeanEngine) -> bool:
    """Whether the stages may run nested on their streams (module docstring)."""
    budget = engine.placement.budget
    resident = all(getattr(budget, stage) is StageMode.RESIDENT for stage in ("text", "unet", "vae"))
    stage_aware = all(hasattr(a, "attach_stage") for a in engine.adapters)
    return engine.device.type == "cuda" and resident and not budget.hard and stage_aware


def choose_batch(engine: LeanEngine, s: EditStreamSettings, group: list[EditItem], tiled: bool) -> int:
    """``max_batch``, else the automatic batch for the group's size (module docstring)."""
    if s.max_batch:
        return min(s.max_batch, len(group))
    width, height = group[0].sizes.output
    factor = vae_scale_factor(engine)
    h, w = height // factor, width // factor
    refs = len(group[0].sizes.vae)
    units = trace_units(engine.parts.unet, (2 if s.guided else 1, h, w), engine.dtype, reference_images=refs)
    per_image = max(1, activation_bytes(units, torch.empty((), dtype=engine.dtype).element_size(), "cpu"))
    decode = untiled_decode_bytes(height, width, engine.vae_dtype)
    reserve = decode if tiled else decode_reserve(engine, decode) + decode  # a decode and a VAE encode beside it
    # one row's image tokens: the noise's and each reference's (2x2 patches of the 1/8 latent)
    tokens = sum((y // factor // PATCH) * (x // factor // PATCH) for x, y in [(width, height), *group[0].sizes.vae])
    batch = auto_batch(len(group), per_image, available_bytes(engine), reserve,
                       saturating_dit_batch(tokens, s.guided))
    logger.info("%s: automatic batch of %d images at %dx%d (%.0f MB activations per image)", NODE, batch, width,
                height, per_image / 2 ** 20)
    return batch


@torch.no_grad()
def run_edit_stream(engine: Any, settings: EditStreamSettings, images: Optional[torch.Tensor] = None,
                    folder: str = "", runner: Optional[GraphRunner] = None, quiet: bool = False) -> EditStreamResult:
    """Edit every image (module docstring). Checks everything before any stage opens."""
    if not isinstance(settings, EditStreamSettings):
        raise TypeError(f"settings: expected an EditStreamSettings, got {type(settings).__name__}")
    s = settings.validated()
    check_edit_model(engine)
    items = collect_items(images, folder, s.megapixels)
    last = s.seed + len(items) - 1
    if last > MAX_SEED:
        raise ValueError(f"seed={s.seed}: edit n uses seed + n and this run has {len(items)} images, so the last seed "
                         f"{last} exceeds {MAX_SEED}; use a seed <= {MAX_SEED - len(items) + 1}")
    factor = vae_scale_factor(engine)
    for it in items[:1]:  # the schedule checks steps (the same for every size) before any stage opens
        flow_sigmas(engine.parts.scheduler_config, s.steps, it.sizes.output[1] // factor, it.sizes.output[0] // factor)
    pixels = sum(it.sizes.output[0] * it.sizes.output[1] for it in items)
    check_host_bytes(int(pixels * (3 + engine.parts.latent_channels / factor ** 2) * 4), "images",
                     f"{len(items)} edits and their latents (float32)", "edit fewer images per run, or lower megapixels")
    return _Run(engine, s, group_items(items), runner, quiet).run()


class _Run:
    """One run's cycles: for batch k, the decode of batch k-1 and the encoding of batch k+1 beside its steps."""

    def __init__(self, engine: LeanEngine, s: EditStreamSettings, groups: list, runner: Optional[GraphRunner],
                 quiet: bool):
        self.engine, self.s, self.runner, self.quiet = engine, s, runner, quiet
        self.overlap = overlaps(engine)
        self.streams = StageStreams(engine.device, overlap=self.overlap)
        self.groups = [_Group(g) for g in groups]
        self.n = sum(len(g.items) for g in self.groups)
        self.used: list[int] = []
        self.tried: list[int] = []
        self.finished = 0  # edits denoised so far (the progress bar's images)
        self.shown = 0
        self.bar = None

    def run(self) -> EditStreamResult:
        try:
            with bridge.ProgressBar(self.n * self.s.steps, desc=NODE, quiet=self.quiet) as bar:
                self.bar = bar
                self._cycles()
                for group in self.groups:
                    group.decoder.drain()
            for group in self.groups:
                if not bool(group.decoder.written.all()):
                    raise RuntimeError(f"{NODE}: edits {[it.index for it in group.items]} were not all written "
                                       f"(a scheduler bug)")
        except BaseException as exc:
            self.streams.synchronize()
            done = sum(int(g.decoder.written.sum()) for g in self.groups if g.decoder is not None)
            note = f"{NODE} stopped: {done} of {self.n} edits were finished; nothing was returned"
            logger.warning("%s (%s: %s)", note, type(exc).__name__, exc)
            if hasattr(exc, "add_note"):
                exc.add_note(note)
            self.groups = None
            release_frames(exc)
            raise
        return EditStreamResult([g.decoder.images_out for g in self.groups],
                                [g.decoder.latents_out for g in self.groups],
                                [[it.index for it in g.items] for g in self.groups], tuple(self.used),
                                len(self.tried))

    # ----------------------------------------------------------------- planning
    def _decoder(self, gi: int) -> DecodeStage:
        group = self.groups[gi]
        if group.decoder is None:
            width, height = group.items[0].sizes.output
            factor = vae_scale_factor(self.engine)
            available = available_bytes(self.engine) if self.engine.device.type == "cuda" else None
            tiled = needs_tiles(self.engine, height, width, available)
            images = torch.empty((len(group.items), height, width, 3), dtype=torch.float32)
            latents = torch.empty((len(group.items), self.engine.parts.latent_channels, height // factor,
                                   width // factor), dtype=torch.float32)
            group.decoder = DecodeStage(self.engine, 0, tiled, self.streams, images, latents, raw=True)
        return group.decoder

    def _batches(self, gi: int, start: int, batch: int) -> list[tuple[int, int, int]]:
        """``(group, start, stop)`` of the group's batches from row ``start`` on, at ``batch`` images each."""
        rows = len(self.groups[gi].items)
        return [(gi, a, min(rows, a + batch)) for a in range(start, rows, batch)]

    def _plan(self) -> list[tuple[int, int, int]]:
        plan = []
        for gi, group in enumerate(self.groups):
            plan += self._batches(gi, 0, choose_batch(self.engine, self.s, group.items, self._decoder(gi).tiled))
        return plan

    # ----------------------------------------------------------------- the cycles
    def _cycles(self) -> None:
        plan, k, upcoming = self._plan(), 0, None
        while k < len(plan):
            gi, start, stop = plan[k]
            bridge.check_interrupted()
            current = upcoming if upcoming is not None else self._encode(plan[k])
            upcoming, nxt = None, plan[k + 1] if k + 1 < len(plan) else None

            def side_work() -> None:  # the decode of batch k-1 (queued in its group) and the encoding of batch k+1
                nonlocal upcoming
                for group in self.groups:
                    if group.decoder is not None:
                        group.decoder.launch()
                if nxt is not None:
                    upcoming = self._encode(nxt)

            if not self.overlap:
                side_work()
            final, oom = self._denoise(current, side_work if self.overlap else None)
            if oom is not None:
                current = upcoming = final = None
                smaller = self._smaller(oom, gi, start, stop)
                plan[k:] = self._batches(gi, start, smaller) + [b for b in plan[k + 1:] if b[0] != gi]
                continue
            self.used.append(stop - start)
            self._decoder(gi).submit(start, stop, final)
            final = current = None
            k += 1

    def _encode(self, batch: tuple[int, int, int]) -> _Encoded:
        gi, start, stop = batch
        items = self.groups[gi].items[start:stop]
        engine, streams = self.engine, self.streams
        bridge.check_interrupted()
        with streams.use("text"):
            conditions = [edit_images.condition_pictures([it.picture], it.sizes) for it in items]
            rows = encode_edit_rows(engine, self.s, conditions)
            bridge.check_interrupted()
            tokens = torch.cat([reference_tokens(engine, [[it.picture]], it.sizes) for it in items])
            event = streams.record("text")
        return _Encoded(gi, start, items, rows, QwenReference(tokens, reference_shapes(items[0].sizes)), event)

    def _denoise(self, enc: _Encoded, side_work) -> tuple:
        """(final raw latents on the device, None), or (None, the out-of-memory error without its frames)."""
        engine, s, streams = self.engine, self.s, self.streams
        width, height = enc.items[0].sizes.output
        factor = vae_scale_factor(engine)
        h, w = height // factor, width // factor
        jobs = [ImageJob(it.index, 0, 0, s.seed + it.index) for it in enc.items]
        x_init = upload(pack(initial_noise(jobs, (engine.parts.latent_channels, h, w))), engine.device)
        sigmas = flow_sigmas(engine.parts.scheduler_config, s.steps, h, w)
        done_before, b = self.finished * s.steps, len(enc.items)

        def on_step(i: int) -> None:
            self._progress(done_before + (i + 1) * b)
            if i == 0 and side_work is not None:
                side_work()

        try:
            streams.hand_over(enc.event, enc.text_rows, "unet")
            with engine.session("unet"):
                x = denoise_qwen_batch(engine, enc.text_rows, x_init, sigmas, (h, w), s, on_step, enc.reference,
                                       self.runner)
                raw = to_raw(unpack(x, h, w), engine.parts.vae)
        except Exception as exc:  # noqa: BLE001 - only out-of-memory errors are retried; the rest re-raise
            if not is_out_of_memory(exc):
                raise
            return None, exc.with_traceback(None)
        self.finished += b
        return raw, None

    def _progress(self, units: int) -> None:
        """Move the bar to ``units`` (images x steps); it never goes back (a retried batch re-advances nothing)."""
        if units > self.shown:
            self.bar.update(units - self.shown)
            self.shown = units

    def _smaller(self, oom: BaseException, gi: int, start: int, stop: int) -> int:
        self.tried.append(stop - start)
        self.streams.release_cached()
        smaller = shrink(stop - start)
        if smaller is None:
            raise _OOM(f"{NODE}: out of memory denoising edit {self.groups[gi].items[start].index} even with a batch "
                       f"of 1 (batch sizes tried: {self.tried}); lower megapixels, use a lower-VRAM policy in the "
                       f"Memory Pool Loader or free VRAM. Last error: {oom}") from oom
        logger.warning("%s: out of memory denoising %d edits together (%s); retrying them in batches of %d", NODE,
                       stop - start, oom, smaller)
        return smaller

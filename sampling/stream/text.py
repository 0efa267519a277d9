"""Text stage: each batch's classifier-free-guidance conditioning, encoded ahead of the batch that needs it.

Invariants
- Every prompt is encoded exactly as the Fused DDIM Sampler encodes it for a run of batch size 1
  (``engine.encode_prompts([prompt])`` inside ``engine.session("text")``, the negative only when guided), so a
  row of a batch sees the same context as that image's one-prompt run. Each prompt (and the negative) is encoded
  once per run; embeddings of prompts no later image needs are dropped.
- A batch's conditioning is the per-image contexts stacked in image order, the negative repeated, SDXL pooled
  embeddings stacked the same way and the time ids repeated: ``cfg.Conditioning`` as ``conditioning_from_embeds``
  builds it for one prompt, generalised to one prompt per row.
- On CUDA the stage runs on the ``text`` stream and hands its result over with an event recorded after the session
  closed. When the view has adapters, the ``text`` stream first waits for the ``unet`` stream (the session attaches
  them, which may write weights or strength buffers the UNet's queued steps read). Under ``lowvram`` the encoders run on the CPU (``stage_device``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ...memory.engine import LeanEngine, PromptEmbeds
from ..cfg import Conditioning
from .settings import ImageJob, StreamSettings
from .streams import StageStreams, Timeline


@dataclass(eq=False)
class BatchConditioning:
    """Conditioning of images ``[start, stop)`` and the event after which the ``unet`` stream may read it."""

    start: int
    stop: int
    conditioning: Conditioning
    event: object = None

    def tensors(self) -> list:
        c = self.conditioning
        out = [c.cond.context, c.cond.pooled, c.time_ids]
        if c.uncond is not None:
            out += [c.uncond.context, c.uncond.pooled]
        return out


class TextStage:
    def __init__(self, engine: LeanEngine, settings: StreamSettings, jobs: list[ImageJob], streams: StageStreams,
                 timeline: Optional[Timeline] = None):
        self.engine = engine
        self.settings = settings
        self.jobs = jobs
        self.streams = streams
        self.timeline = timeline
        self._embeds: dict[int, PromptEmbeds] = {}
        self._negative: Optional[PromptEmbeds] = None
        self.encoder_calls = 0

    def _encode(self, prompt: str) -> PromptEmbeds:
        self.encoder_calls += 1
        return self.engine.encode_prompts([prompt])

    def release_before(self, index: int) -> None:
        """Drop the embeddings of prompts whose images all come before image ``index`` (finished denoising)."""
        if index >= len(self.jobs):
            self._embeds.clear()
            return
        first = self.jobs[index].prompt_index
        for p in [p for p in self._embeds if p < first]:
            del self._embeds[p]

    def prepare(self, start: int, stop: int) -> BatchConditioning:
        """Enqueue the encoding of images ``[start, stop)`` (prompts not encoded yet) and build their batch."""
        jobs = self.jobs[start:stop]
        needed = sorted({j.prompt_index for j in jobs})
        missing = [p for p in needed if p not in self._embeds]
        guided = self.settings.guided
        engine = self.engine
        span = self.timeline.span("text", f"images {start}-{stop - 1}", range(start, stop)) if self.timeline \
            else _null()
        if engine.adapters:  # attaching them may write what the UNet reads: wait for the UNet's queued steps
            self.streams.wait_stage("text", "unet")
        with self.streams.use("text"), span:
            if missing or (guided and self._negative is None):
                with engine.session("text"):
                    for p in missing:
                        self._embeds[p] = self._encode(self.settings.prompts[p])
                    if guided and self._negative is None:
                        self._negative = self._encode(self.settings.negative)
            rows = [self._embeds[j.prompt_index] for j in jobs]
            b = len(rows)
            cond = PromptEmbeds(torch.cat([r.context for r in rows]),
                                None if rows[0].pooled is None else torch.cat([r.pooled for r in rows]))
            uncond = None
            if guided:
                neg = self._negative
                uncond = PromptEmbeds(neg.context.repeat(b, 1, 1),
                                      None if neg.pooled is None else neg.pooled.repeat(b, 1))
            if engine.parts.is_sdxl and (cond.pooled is None or (uncond is not None and uncond.pooled is None)):
                raise ValueError("SDXL needs pooled text embeddings for every prompt (PromptEmbeds.pooled)")
            time_ids = engine.time_ids(self.settings.height, self.settings.width, b) if engine.parts.is_sdxl \
                else None
            conditioning = Conditioning(cond, uncond, time_ids)
        return BatchConditioning(start, stop, conditioning, self.streams.record("text"))


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

"""Text stage: each batch's classifier-free-guidance conditioning, encoded ahead of the batch that needs it.

Invariants
- Every prompt is encoded exactly as the Fused DDIM Sampler encodes it for a run of batch size 1: through
  ``prompts.encode_for_sampler``'s encoder (``prompt_encoder.encode_texts`` with the run's ``prompt_syntax``, so
  ComfyUI weight syntax, ``[x]``/``BREAK`` in the extended syntax, prompts longer than 75 tokens in 77-token chunks,
  ``embedding:NAME`` and the process-wide prompt cache), the negative only when guided. ``encode_texts`` encodes
  each text on its own (one [1, 77*k, C] result per text; batching texts never mixes them), opens the text session
  only on a cache miss, and is called once per batch for the texts not encoded yet in this run; embeddings of
  prompts no later image needs are dropped.
- Lengths: a prompt of k chunks has 77*k tokens. A batch's rows and the negative are repeated along the sequence
  axis to the least common multiple L of their lengths (``conditioning.match_lengths``'s rule generalised to many
  rows). Cross-attention over a sequence repeated r times equals attention over the original (each key's softmax
  weight splits evenly over its r copies), so each row conditions the UNet as in its one-prompt run; for a batch of
  one image L = lcm(prompt, negative), exactly the Fused DDIM Sampler's context, so ``max_batch`` 1 is bit-identical.
- Connected CONDITIONING inputs (``stream.conditioning.ConditioningInputs``, converted before the run) replace the
  encoder for their side: prompt p is row p of ``positive_cond``; the negative of prompt p is ``negative_cond``'s
  row 0 (one row, shared) or row p. Nothing is encoded for such a side. Each row carries its own SDXL pooled
  embedding and time ids (from the CONDITIONING's size keys, else the image size), exactly as ``from_conditioning``
  gives them to the Fused DDIM Sampler for a 1-row CONDITIONING.
- A batch's conditioning is the per-image contexts stacked in image order, each image's negative stacked the same
  way, SDXL pooled embeddings and time ids stacked per row (text prompts: (height, width, 0, 0, height, width)), the
  uncond side with its own time ids: ``cfg.Conditioning`` as ``cfg.encode_conditioning`` builds it for one prompt,
  generalised to one prompt per row.
- On CUDA the stage runs on the ``text`` stream and hands its result over with an event recorded after the session
  closed. When the view has adapters, the ``text`` stream first waits for the ``unet`` stream (the session attaches
  them, which may write weights or strength buffers the UNet's queued steps read). Under ``lowvram`` the encoders run
  on the CPU (``stage_device``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from ...memory.engine import LeanEngine, PromptEmbeds
from ..cfg import Conditioning
from ..conditioning import SamplerConditioning
from ..prompt_encoder import PROMPT_CACHE, PromptCache, encode_texts
from .conditioning import ConditioningInputs
from .settings import ImageJob, StreamSettings
from .streams import StageStreams, Timeline


@dataclass(eq=False)
class BatchConditioning:
    """Conditioning of images ``[start, stop)`` and the event after which the ``unet`` stream may read it."""

    start: int
    stop: int
    conditioning: Conditioning  # or, for a flow family, one [L, C] caption tensor per DiT row (``stream.flow``)
    event: object = None

    def tensors(self) -> list:
        c = self.conditioning
        if isinstance(c, list):  # a flow family's caption rows (``stream.flow``)
            return list(c)
        out = [c.cond.context, c.cond.pooled, c.time_ids]
        if c.uncond is not None:
            out += [c.uncond.context, c.uncond.pooled, c.uncond_time_ids]
        return out


def _to_length(context: torch.Tensor, length: int) -> torch.Tensor:
    """``context`` [1, l, C] repeated along the sequence axis to ``length`` (a multiple of l)."""
    return context.repeat(1, length // context.shape[1], 1)


class TextStage:
    def __init__(self, engine: LeanEngine, settings: StreamSettings, jobs: list[ImageJob], streams: StageStreams,
                 timeline: Optional[Timeline] = None, cache: Optional[PromptCache] = PROMPT_CACHE,
                 given: Optional[ConditioningInputs] = None):
        self.engine = engine
        self.settings = settings
        self.jobs = jobs
        self.streams = streams
        self.timeline = timeline
        self.cache = cache
        self.given = given if given is not None else ConditioningInputs()
        self._embeds: dict[int, SamplerConditioning] = {}
        self._negative: Optional[SamplerConditioning] = None  # the encoded ``negative`` text (shared)
        self.encoded_texts = 0  # texts handed to the encoder (cache hits included)

    def _encode(self, texts: list[str]) -> list[SamplerConditioning]:
        self.encoded_texts += len(texts)
        encoded = encode_texts(self.engine, texts, syntax=self.settings.prompt_syntax, cache=self.cache)
        s, engine = self.settings, self.engine
        ids = engine.time_ids(s.height, s.width, 1) if engine.parts.is_sdxl else None
        return [SamplerConditioning(e.context, e.pooled, ids) for e in encoded]

    def release_before(self, index: int) -> None:
        """Drop the embeddings of prompts whose images all come before image ``index`` (finished denoising)."""
        if index >= len(self.jobs):
            self._embeds.clear()
            return
        first = self.jobs[index].prompt_index
        for p in [p for p in self._embeds if p < first]:
            del self._embeds[p]

    def _negative_for(self, prompt_index: int) -> SamplerConditioning:
        if self.given.negative is not None:
            return self.given.negative_row(prompt_index)
        return self._negative

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
            if self.given.positive is not None:
                for p in missing:
                    self._embeds[p] = self.given.positive_row(p)
                missing = []
            want_negative = guided and self._negative is None and self.given.negative is None
            texts = [self.settings.prompts[p] for p in missing] + ([self.settings.negative] if want_negative else [])
            if texts:
                encoded = self._encode(texts)
                for p, e in zip(missing, encoded):
                    self._embeds[p] = e
                if want_negative:
                    self._negative = encoded[-1]
            rows = [self._embeds[j.prompt_index] for j in jobs]
            negs = [self._negative_for(j.prompt_index) for j in jobs] if guided else []
            conditioning = self._batch(rows, negs)
        return BatchConditioning(start, stop, conditioning, self.streams.record("text"))

    def _batch(self, rows: list[SamplerConditioning], negs: list[SamplerConditioning]) -> Conditioning:
        """The batch's rows and negatives (empty when unguided) as what the denoise stage takes."""
        return _stack(self.engine, rows, negs, math.lcm(*{r.context.shape[1] for r in rows + negs}))


def _stack(engine: LeanEngine, rows: list[SamplerConditioning], negs: list[SamplerConditioning],
           length: int) -> Conditioning:
    """Batch-1 rows (and their negatives, empty when unguided) -> one batch's ``Conditioning``, every context
    repeated along the sequence axis to ``length``; SDXL pooled rows and time ids stacked the same way."""

    def side(items: list[SamplerConditioning]) -> PromptEmbeds:
        pooled = None if any(r.pooled is None for r in items) else torch.cat([r.pooled for r in items])
        return PromptEmbeds(torch.cat([_to_length(r.context, length) for r in items]), pooled)

    cond = side(rows)
    uncond = side(negs) if negs else None
    if not engine.parts.is_sdxl:
        return Conditioning(cond, uncond, None)
    if cond.pooled is None or (uncond is not None and uncond.pooled is None) \
            or any(r.time_ids is None for r in rows + negs):
        raise ValueError("SDXL needs pooled text embeddings and size conditioning for every prompt; encode with an "
                         "SDXL model")
    # the uncond side always carries its own time ids: equal values give the same UNet input as sharing them, and
    # comparing them here would make the host wait for the text stream
    return Conditioning(cond, uncond, torch.cat([r.time_ids for r in rows]),
                        torch.cat([r.time_ids for r in negs]) if negs else None)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

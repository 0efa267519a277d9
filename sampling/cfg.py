"""Classifier-free guidance plumbing: text conditioning for a batch and the UNet calls that realise a CFG mode.

Guidance itself, m = u + s (c - u) (Ho & Salimans 2022), is applied by the fused kernel; this module decides what
the UNet sees. Invariants (diffusers' ``StableDiffusionPipeline`` / ``StableDiffusionXLPipeline`` conventions):
- each prompt is encoded once and repeated ``batch`` times;
- batched CFG stacks uncond first: context ``[u..., c...]``, SDXL pooled ``[u..., c...]``, time ids repeated;
- sequential CFG makes two calls of ``batch`` rows (uncond, then cond); unguided runs one call on cond;
- SDXL time ids are (height, width, 0, 0, height, width) in pixels, for every row, unless a ComfyUI CONDITIONING
  gives its own size keys; the uncond side then may carry its own (``uncond_time_ids``), as ComfyUI's samplers
  build the added conditioning per side.
- every prompt string and CONDITIONING goes through ``prompts.encode_for_sampler`` (weight syntax, long prompts,
  embeddings, the prompt cache); a prompt without weights, brackets, ``BREAK`` or embeddings within 75 tokens
  encodes exactly as diffusers' pipelines do.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..memory.engine import LeanEngine, PromptEmbeds
from .prompts import SAMPLER_SYNTAX, encode_for_sampler
from .settings import CfgMode


@dataclass(frozen=True, eq=False)
class Conditioning:
    """Text conditioning of one run, already repeated to the batch: cond and (when guided) uncond."""

    cond: PromptEmbeds
    uncond: Optional[PromptEmbeds]
    time_ids: Optional[torch.Tensor]  # [batch, 6] (SDXL) or None
    uncond_time_ids: Optional[torch.Tensor] = None  # the uncond side's own time ids; None = same as ``time_ids``

    @property
    def guided(self) -> bool:
        return self.uncond is not None

    @property
    def batch(self) -> int:
        return int(self.cond.context.shape[0])


@dataclass(frozen=True, eq=False)
class UNetCall:
    """One UNet call per step: its context and SDXL added conditioning (None for SD1/SD2)."""

    context: torch.Tensor
    added: Optional[dict]


def call_buffers(calls, alloc, prefix: str) -> list[UNetCall]:
    """Static buffers shaped like ``calls`` (a step program's conditioning), from ``alloc(role, shape, dtype)``."""
    out = []
    for i, call in enumerate(calls):
        context = alloc(f"{prefix}.context{i}", tuple(call.context.shape), call.context.dtype)
        added = None
        if call.added is not None:
            added = {k: alloc(f"{prefix}.{k}{i}", tuple(v.shape), v.dtype) for k, v in call.added.items()}
        out.append(UNetCall(context, added))
    return out


def load_calls(buffers, calls) -> None:
    """Copy a run's conditioning into ``call_buffers`` made for the same layout."""
    if len(calls) != len(buffers):
        raise ValueError(f"expected {len(buffers)} UNet call(s), got {len(calls)}")
    for mine, theirs in zip(buffers, calls):
        mine.context.copy_(theirs.context)
        if mine.added is not None:
            for k, v in mine.added.items():
                v.copy_(theirs.added[k])


def _repeat(embeds: PromptEmbeds, batch: int) -> PromptEmbeds:
    pooled = None if embeds.pooled is None else embeds.pooled.repeat(batch, 1)
    return PromptEmbeds(embeds.context.repeat(batch, 1, 1), pooled)


def conditioning_from_embeds(engine: LeanEngine, cond: PromptEmbeds, uncond: Optional[PromptEmbeds], batch: int,
                             height: int, width: int) -> Conditioning:
    """Conditioning from one prompt's embeddings (batch 1) each, repeated to ``batch`` rows."""
    for name, e in (("cond", cond), ("uncond", uncond)):
        if e is not None and e.context.shape[0] != 1:
            raise ValueError(f"{name} embeddings have batch {e.context.shape[0]}; pass one prompt's embeddings")
    if engine.parts.is_sdxl and (cond.pooled is None or (uncond is not None and uncond.pooled is None)):
        raise ValueError("SDXL needs pooled text embeddings for both prompts (PromptEmbeds.pooled)")
    time_ids = engine.time_ids(height, width, batch) if engine.parts.is_sdxl else None
    return Conditioning(_repeat(cond, batch), None if uncond is None else _repeat(uncond, batch), time_ids)


def encode_conditioning(engine: LeanEngine, positive: str, negative: str, batch: int, guided: bool, height: int,
                        width: int, *, positive_cond: Any = None, negative_cond: Any = None,
                        syntax: str = SAMPLER_SYNTAX) -> Conditioning:
    """Conditioning for a run: the prompt strings (``syntax``, see ``prompts``) or, where connected, the ComfyUI
    CONDITIONING of that side; the negative side only when guided. Opens the text session only on a cache miss."""
    cond, uncond = encode_for_sampler(engine, positive, negative, batch, positive_cond, negative_cond, width=width,
                                      height=height, syntax=syntax, guided=guided)
    if engine.parts.is_sdxl:
        for name, side in (("positive", cond), ("negative", uncond)):
            if side is not None and (side.pooled is None or side.time_ids is None):
                raise ValueError(f"{name}: SDXL needs pooled text embeddings and size conditioning; encode the "
                                 f"prompt with an SDXL CLIP")
    time_ids = cond.time_ids if engine.parts.is_sdxl else None
    uncond_ids = None
    if uncond is not None and time_ids is not None and not torch.equal(uncond.time_ids, time_ids):
        uncond_ids = uncond.time_ids
    return Conditioning(PromptEmbeds(cond.context, cond.pooled),
                        None if uncond is None else PromptEmbeds(uncond.context, uncond.pooled), time_ids, uncond_ids)


def unet_calls(conditioning: Conditioning, mode: str) -> tuple[list[UNetCall], int]:
    """The UNet calls of one step and how many copies of the latent the (shared) UNet input holds."""
    c, u, ids = conditioning.cond, conditioning.uncond, conditioning.time_ids
    u_ids = ids if conditioning.uncond_time_ids is None else conditioning.uncond_time_ids

    def added(e: PromptEmbeds, time_ids) -> Optional[dict]:
        return None if time_ids is None else {"text_embeds": e.pooled, "time_ids": time_ids}

    if u is None:
        return [UNetCall(c.context, added(c, ids))], 1
    if mode == CfgMode.SEQUENTIAL.value:
        return [UNetCall(u.context, added(u, u_ids)), UNetCall(c.context, added(c, ids))], 1
    context = torch.cat([u.context, c.context])
    both = None
    if ids is not None:
        both = {"text_embeds": torch.cat([u.pooled, c.pooled]), "time_ids": torch.cat([u_ids, ids])}
    return [UNetCall(context, both)], 2

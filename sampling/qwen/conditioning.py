"""Qwen-Image's conditioning, one entry per side of CFG: prompt strings (``text.encode_prompts``) or ComfyUI
CONDITIONING holding Qwen2.5-VL hidden states, laid out for the transformer as ``(embeds [B, L, C], mask)``.

Invariants
- A CONDITIONING side replaces its prompt string. It is a single ``[tensor [b, L, C], dict]`` entry, what
  ComfyUI's Qwen-Image text encode gives (the last hidden state with the template's system turn dropped; an
  ``attention_mask`` in the dict marks padding rows, which are dropped), ``C`` the transformer's
  ``joint_attention_dim`` and ``b`` 1 (used for every image) or the batch size; anything else is refused by input
  name before any model runs (``flow.captions.conditioning_captions``, shared with Z-Image).
- The prompt strings a run needs are encoded in one call (one text session); every side has one row per image
  (``qwen_text_rows``, the flow loop's layout) or goes through ``text.prompt_batch`` as ``QwenImagePipeline`` lays
  it out (``qwen_conditioning``, the Fused KSampler's), so a CONDITIONING holding the rows
  ``encode_prompts`` gives for a prompt samples exactly that prompt's latent.

Why its own module: the flow loop and the Fused KSampler condition Qwen-Image the same way.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from ...memory.engine import LeanEngine
from ..flow.captions import conditioning_captions
from .text import encode_prompts, prompt_batch

Side = tuple[torch.Tensor, Optional[torch.Tensor]]


def _check_rows(rows: list, name: str, batch: int) -> list:
    if len(rows) not in (1, batch):
        raise ValueError(f"{name} holds {len(rows)} rows; expected 1 or the batch size {batch}: give one "
                         f"conditioning row per image, or one for all")
    return rows


def conditioning_rows(engine: LeanEngine, conds: Sequence[Any], names: Sequence[str], batch: int) -> list:
    """Per side, ``None`` (no CONDITIONING) or its ``[L, C]`` rows, checked (refused naming ``names[i]``); runs no
    model, so a caller can check its inputs before it opens a stage."""
    return [None if c is None else _check_rows(conditioning_captions(engine, c, n), n, batch)
            for c, n in zip(conds, names)]


def qwen_text_rows(engine: LeanEngine, texts: Sequence[str], conds: Sequence[Any], names: Sequence[str],
                   batch: int) -> list[list[torch.Tensor]]:
    """Per side, ``batch`` text rows ``[L, C]`` (engine device and dtype): side ``i`` from ``conds[i]`` when it is not
    ``None`` (a CONDITIONING, refused naming ``names[i]``), else from the prompt string ``texts[i]``. Every
    CONDITIONING is checked before the text encoder runs."""
    if not len(texts) == len(conds) == len(names):
        raise ValueError(f"texts, conds and names: expected one of each per side, got {len(texts)}, {len(conds)} "
                         f"and {len(names)}")
    rows = conditioning_rows(engine, conds, names, batch)
    strings = [i for i, r in enumerate(rows) if r is None]
    if strings:
        encoded = encode_prompts(engine, [texts[i] for i in strings])
        for i, row in zip(strings, encoded):
            rows[i] = [row]
    return [[r.to(engine.device, engine.dtype) for r in (side * batch if len(side) == 1 else side)] for side in rows]


def qwen_conditioning(engine: LeanEngine, texts: Sequence[str], conds: Sequence[Any], names: Sequence[str],
                      batch: int) -> list[Side]:
    """One ``(embeds [batch, L, C], mask [batch, L] or None)`` per side, laid out by ``text.prompt_batch`` from
    :func:`qwen_text_rows`."""
    return [prompt_batch(side) for side in qwen_text_rows(engine, texts, conds, names, batch)]

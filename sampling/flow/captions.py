"""The captions a flow run conditions on: encoded prompt strings, or ComfyUI CONDITIONING holding the text
encoder's hidden states (Qwen3 for Z-Image; ``conditioning_captions`` reads Qwen2.5-VL's for Qwen-Image too), as
one ``[L, C]`` tensor per DiT row (``[positive x B, negative x B]`` when guided, else positives only).

Invariant: a CONDITIONING side replaces its prompt string. It must be a single ``[tensor [b, L, C], dict]`` entry
whose width ``C`` is the DiT's caption width (``caption_source``); with an ``attention_mask`` in its dict the
masked rows are dropped (as the pipeline drops padding), and ``b`` is 1 (used for every image) or the batch size.
Anything else is refused by input name with the fix, before any model runs.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ...memory.engine import LeanEngine
from ...memory.finite import refuse_non_finite_input
from .text import check_prompt, encode_prompts


def _from_conditioning(value: Any, name: str, width: int, encoder: str = "Qwen3") -> list[torch.Tensor]:
    if not isinstance(value, (list, tuple)) or len(value) != 1 or not isinstance(value[0], (list, tuple)) \
            or len(value[0]) != 2 or not isinstance(value[0][0], torch.Tensor):
        raise ValueError(f"{name}: expected a CONDITIONING with one entry [tensor [b, L, C], dict] from a {encoder} "
                         f"text encoder node; combined or empty conditionings are not supported here")
    cond, extra = value[0]
    if cond.ndim != 3 or cond.shape[-1] != width or cond.shape[1] < 1 or not cond.is_floating_point():
        raise ValueError(f"{name} has shape {tuple(cond.shape)}; this model needs {encoder} hidden states "
                         f"[b, L, {width}]: encode the prompt with this model's {encoder} text encoder")
    refuse_non_finite_input(cond, name, "re-encode the prompt")
    mask = extra.get("attention_mask") if isinstance(extra, dict) else None
    if isinstance(mask, torch.Tensor):
        mask = mask.reshape(-1, mask.shape[-1]).bool()
        if mask.shape[-1] != cond.shape[1] or mask.shape[0] not in (1, cond.shape[0]):
            raise ValueError(f"{name}: its attention_mask has shape {tuple(mask.shape)}, which does not match the "
                             f"hidden states {tuple(cond.shape)}; re-encode the prompt")
    rows = []
    for i in range(cond.shape[0]):
        row = cond[i] if mask is None else cond[i][mask[i if mask.shape[0] > 1 else 0]]
        if row.shape[0] < 1:
            raise ValueError(f"{name} row {i} has no unmasked token; encode a prompt (an empty prompt still gives "
                             f"the chat-template tokens)")
        rows.append(row)
    return rows


def caption_source(engine: LeanEngine) -> tuple[int, str]:
    """The text width the DiT reads and the encoder that writes it: Z-Image's ``cap_feat_dim`` (Qwen3), else
    Qwen-Image's ``joint_attention_dim`` (Qwen2.5-VL)."""
    config = engine.parts.unet.config
    width = getattr(config, "cap_feat_dim", None)
    return (int(width), "Qwen3") if width is not None else (int(config.joint_attention_dim), "Qwen2.5-VL")


def conditioning_captions(engine: LeanEngine, value: Any, name: str) -> list[torch.Tensor]:
    """The caption rows of CONDITIONING input ``name`` for ``engine``'s DiT (module docstring; refused by name)."""
    return _from_conditioning(value, name, *caption_source(engine))


def _side(engine: LeanEngine, text: str, cond: Any, name: str, batch: int) -> list[torch.Tensor]:
    if cond is not None:
        rows = conditioning_captions(engine, cond, f"{name}_cond")
    else:
        rows = encode_prompts(engine, [check_prompt(name, text)])
    if len(rows) == 1:
        return rows * batch
    if len(rows) != batch:
        raise ValueError(f"{name}_cond holds {len(rows)} rows; expected 1 or batch_size={batch}")
    return rows


def flow_captions(engine: LeanEngine, positive: str, negative: str, guided: bool, batch: int,
                  positive_cond: Optional[Any] = None, negative_cond: Optional[Any] = None) -> list[torch.Tensor]:
    """Caption rows for the DiT (module docstring), on the engine's device in its dtype; the negative side only when
    ``guided``."""
    rows = _side(engine, positive, positive_cond, "positive", batch)
    if guided:
        rows = rows + _side(engine, negative, negative_cond, "negative", batch)
    return [r.to(engine.device, engine.dtype) for r in rows]

"""What the samplers call to turn their prompt inputs into CFG conditioning.

``encode_for_sampler`` takes the sampler node's ``positive``/``negative`` strings and its optional
``positive_cond``/``negative_cond`` CONDITIONING; a CONDITIONING, when given, replaces the string of its side.
Strings are encoded with ComfyUI's CLIPTextEncode rules (``prompt_encoder``) through the process-wide prompt cache,
in the ``"extended"`` syntax by default (``SAMPLER_SYNTAX``: ComfyUI's rules plus ``[x]`` = weight / 1.1 and
``BREAK``, as the prompt-handling issue specifies for the pack's own prompt strings; a prompt without ``[``, ``]``
or ``BREAK`` reads identically in both syntaxes);
CONDITIONING is converted as ComfyUI's samplers read it (``conditioning``). The two sides come back batched to
``batch`` and with equal sequence length (lcm repetition, exact for cross-attention), ready for a batched CFG call.

Invariant: an unchanged prompt on an unchanged model view costs no text-encoder call and no weight movement (the
text session is opened only on a cache miss). Returned tensors are new (never the cached ones), so callers may
modify them.
"""
from __future__ import annotations

from typing import Any, Optional

from ..memory.engine import LeanEngine
from .conditioning import SamplerConditioning, from_conditioning, match_lengths, repeat_to_batch, time_ids_from_sizes
from .prompt_encoder import PROMPT_CACHE, PromptCache, encode_texts

SAMPLER_SYNTAX = "extended"


def _check_size(name: str, value: Optional[int]) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        raise ValueError(f"{name}={value!r}: expected the image size in pixels (a positive int) or None")


def encode_for_sampler(engine: LeanEngine, positive: Optional[str], negative: Optional[str], batch: int,
                       positive_cond: Any = None, negative_cond: Any = None, *, width: Optional[int] = None,
                       height: Optional[int] = None, syntax: str = SAMPLER_SYNTAX, missing_embedding: str = "error",
                       cache: Optional[PromptCache] = PROMPT_CACHE, guided: bool = True
                       ) -> tuple[SamplerConditioning, Optional[SamplerConditioning]]:
    """(cond, uncond) for ``engine``: ``context`` [batch, L, C] each (same L), SDXL ``pooled`` [batch, P] and
    ``time_ids`` [batch, 6] (from the CONDITIONING's size keys, defaulting to ``width``/``height`` = the image size
    in pixels; ``None`` when neither is known -- then use ``engine.time_ids``). Do not call inside a session.
    ``guided=False`` (CFG scale 1) leaves the negative side out: nothing is encoded for it and uncond is ``None``.
    """
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise ValueError(f"batch={batch!r}: expected a positive int (the sampler's batch_size)")
    _check_size("width", width)
    _check_size("height", height)
    sides = {"positive": (positive, positive_cond)}
    if guided:
        sides["negative"] = (negative, negative_cond)
    texts = []
    for name, (text, cond) in sides.items():
        if cond is None:
            if not isinstance(text, str):
                raise TypeError(f"{name}: expected the prompt text (a string) when {name}_cond is not connected, "
                                f"got {type(text).__name__}")
            texts.append(text)
    # the connected CONDITIONING first: a wrong one is refused before the text encoders are placed and run
    given = {name: from_conditioning(cond, engine, batch, width=width, height=height, input_name=f"{name}_cond")
             for name, (text, cond) in sides.items() if cond is not None}
    encoded = iter(encode_texts(engine, texts, syntax=syntax, missing_embedding=missing_embedding, cache=cache))
    out = []
    for name, (text, cond) in sides.items():
        if cond is not None:
            out.append(given[name])
            continue
        emb = next(encoded)
        pooled = None if emb.pooled is None else repeat_to_batch(emb.pooled, batch)
        time_ids = time_ids_from_sizes({}, width, height, batch, engine) if engine.parts.is_sdxl else None
        out.append(SamplerConditioning(repeat_to_batch(emb.context, batch), pooled, time_ids))
    if not guided:
        return out[0], None
    cond_ctx, uncond_ctx = match_lengths(out[0], out[1])
    return (SamplerConditioning(cond_ctx, out[0].pooled, out[0].time_ids),
            SamplerConditioning(uncond_ctx, out[1].pooled, out[1].time_ids))

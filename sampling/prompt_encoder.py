"""Weighted, chunked prompt encoding with ComfyUI 0.3.64's rules, and the prompt-encoding cache.

Hand-written because neither diffusers nor transformers implement ComfyUI's chunking and emphasis rules.

Tokens and chunks (ComfyUI ``SDTokenizer.tokenize_with_weights``). Each text piece of the parsed prompt
(``prompt_parser``) is tokenized on its own, without its start/end tokens; an embedding contributes its vectors.
A chunk is ``[start] + up to L-2 items + [end]`` padded to ``L`` (= 77) with the tokenizer's pad token. A piece that
does not fit into the current chunk: if it has >= 8 items it is split (the chunk is filled, closed, and the rest
continues in a new chunk); a shorter piece moves whole to a new chunk (the current one is closed and padded).
Every item carries its piece's weight; start/end/pad carry 1.0. ``BREAK`` (extended syntax) closes the current
chunk; a trailing empty chunk after a ``BREAK`` is dropped.

Encoding (ComfyUI ``ClipTokenWeightEncoder.encode_token_weights``). All chunks of a prompt go through the text
encoder in one batch; if any weight differs from 1.0, an "empty" sequence ``[start, end, pad, ...]`` is encoded
in the same batch, and every item with weight ``w != 1`` becomes ``z_empty[j] + w * (z[j] - z_empty[j])``
(interpolation from the empty prompt at the same position; computed in float32). Chunks are concatenated along the
sequence axis ([1, 77*k, C]). The pooled output is the first chunk's, unweighted.

Hidden states per family (identical to diffusers' pipelines and to ComfyUI for a plain prompt):
- SD1: ``last_hidden_state`` (last layer, final layer norm applied).
- SD2: ``last_hidden_state`` of the diffusers text encoder, whose conversion already dropped OpenCLIP-H's last
  layer; that equals ComfyUI's penultimate layer with the final norm.
- SDXL: CLIP-L ``hidden_states[-2]`` and CLIP-G ``hidden_states[-2]`` (no final norm), concatenated on channels
  after cutting both to the shorter length; pooled = CLIP-G ``text_embeds`` (projection of the normed end token).
The pad token is the tokenizer's ``pad_token_id`` (CLIP-L: the end token; SD2 and SDXL's CLIP-G: ``!`` = 0), which
is what both ComfyUI and diffusers use for correctly configured tokenizers.

Textual-inversion vectors replace the token-embedding output at their positions through a forward hook on the
encoder's input-embedding module, held only for that one forward call, under a lock, and checked to have fired.

Cache: results are keyed by (model parts identity, text-affecting adapters' ``cache_key``, device, dtypes, syntax,
missing-embedding policy, text, signatures of the embedding files the text uses) in a bounded LRU that lives for
the process, so an unchanged prompt costs no text-encoder call within a run or across runs.
"""
from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from ..memory.engine import LeanEngine, ModelParts, PromptEmbeds
from . import prompt_embeddings
from .prompt_parser import DEFAULT_SYNTAX, EMBEDDING_PREFIX, Piece, check_syntax, parse_prompt

logger = logging.getLogger(__name__)

MISSING_EMBEDDING_POLICIES = ("error", "ignore")
LARGE_PIECE = 8  # ComfyUI's max_word_length: pieces this long may be split across chunks

_FORWARD_LOCK = threading.RLock()


@dataclass(frozen=True, eq=False)
class EncoderSpec:
    """One text encoder of a model and how ComfyUI reads it."""

    key: str  # embedding-file key: "clip_l", "clip_g", "clip_h"
    model: torch.nn.Module
    tokenizer: Any
    layer: str  # "last" or "penultimate"
    projected_pooled: bool

    @property
    def width(self) -> int:
        return int(self.model.get_input_embeddings().weight.shape[-1])

    @property
    def length(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 77))

    def special_ids(self) -> tuple[int, int, int]:
        tok = self.tokenizer
        start, end = tok.bos_token_id, tok.eos_token_id
        pad = tok.pad_token_id if tok.pad_token_id is not None else end
        if start is None or end is None:
            raise ValueError(f"the {self.key} tokenizer has no start/end token; a CLIP tokenizer is required")
        return int(start), int(end), int(pad)


def encoder_specs(parts: ModelParts) -> list[EncoderSpec]:
    if parts.is_sdxl:
        return [EncoderSpec("clip_l", parts.text_encoder, parts.tokenizer, "penultimate", False),
                EncoderSpec("clip_g", parts.text_encoder_2, parts.tokenizer_2, "penultimate", True)]
    key = "clip_h" if parts.family.startswith("sd2") else "clip_l"
    return [EncoderSpec(key, parts.text_encoder, parts.tokenizer, "last", False)]


# --------------------------------------------------------------------------------------------- chunks
Item = Any  # int token id or a float32 vector [width]


def build_chunks(pieces: Sequence[Piece], spec: EncoderSpec,
                 vectors: Callable[[str], torch.Tensor]) -> list[tuple[list[Item], list[float]]]:
    """Pieces -> chunks of exactly ``spec.length`` items with their weights (ComfyUI's packing rule)."""
    start, end, pad = spec.special_ids()
    length = spec.length
    room = length - 1  # items a chunk may hold before its end token
    chunks: list[tuple[list[Item], list[float]]] = []
    items: list[Item] = [start]
    weights: list[float] = [1.0]
    pending_empty = False  # the current chunk was opened by a BREAK and holds nothing yet

    def close(pad_to_full: bool) -> None:
        items.append(end)
        weights.append(1.0)
        if pad_to_full:
            items.extend([pad] * (length - len(items)))
            weights.extend([1.0] * (length - len(weights)))
        chunks.append((list(items), list(weights)))
        items[:] = [start]
        weights[:] = [1.0]

    for piece in pieces:
        if piece.kind == "break":
            close(True)
            pending_empty = True
            continue
        if piece.kind == "embedding":
            group = list(vectors(piece.text))
        else:
            group = spec.tokenizer(piece.text, verbose=False)["input_ids"][1:-1]
        if not group:
            continue
        pending_empty = False
        large = len(group) >= LARGE_PIECE
        while group:
            if len(items) + len(group) <= room:
                items.extend(group)
                weights.extend([piece.weight] * len(group))
                group = []
            elif large:
                take = room - len(items)
                items.extend(group[:take])
                weights.extend([piece.weight] * take)
                group = group[take:]
                close(False)
            else:
                close(True)
    if not (pending_empty and chunks):
        close(True)
    return chunks


# --------------------------------------------------------------------------------------------- encoding
def _hidden(spec: EncoderSpec, ids: torch.Tensor, overrides: list[tuple[int, int, torch.Tensor]]):
    """Run ``spec.model`` on ``ids`` [n, L] with ``overrides`` (row, position, vector) in the token embeddings."""
    fired = []

    def replace(module, args, output):
        if output.dim() != 3 or tuple(output.shape[:2]) != tuple(ids.shape):
            return None
        output = output.clone()
        for row, pos, vec in overrides:
            output[row, pos] = vec.to(output.device, output.dtype)
        fired.append(True)
        return output

    want_hidden = spec.layer == "penultimate"
    with _FORWARD_LOCK:
        handle = spec.model.get_input_embeddings().register_forward_hook(replace) if overrides else None
        try:
            out = spec.model(ids, output_hidden_states=want_hidden)
        finally:
            if handle is not None:
                handle.remove()
    if overrides and not fired:
        raise RuntimeError(f"the {spec.key} text encoder did not call its input embedding on the token ids; "
                           f"textual-inversion vectors could not be applied")
    hidden = out.hidden_states[-2] if want_hidden else out.last_hidden_state
    pooled = out.text_embeds if spec.projected_pooled else None
    return hidden, pooled


def encode_chunks(spec: EncoderSpec, chunks: list[tuple[list[Item], list[float]]],
                  device: torch.device) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Chunks -> (context [1, L*k, C] float32, pooled [1, P] float32 or None), ComfyUI's weighting."""
    start, end, pad = spec.special_ids()
    length = spec.length
    weighted = any(w != 1.0 for _, ws in chunks for w in ws)
    rows = [items for items, _ in chunks]
    if weighted:
        rows.append([start, end] + [pad] * (length - 2))
    placeholder = 0 if 0 not in (start, end) else min({1, 2, 3} - {start, end})
    ids = torch.empty((len(rows), length), dtype=torch.long)
    overrides: list[tuple[int, int, torch.Tensor]] = []
    for r, row in enumerate(rows):
        for p, item in enumerate(row):
            if isinstance(item, int):
                ids[r, p] = item
            else:
                ids[r, p] = placeholder
                overrides.append((r, p, item))
    hidden, pooled = _hidden(spec, ids.to(device), overrides)
    z = hidden.float()
    if weighted:
        empty = z[-1:]
        z = z[:-1]
        w = torch.tensor([ws for _, ws in chunks], dtype=torch.float32, device=z.device).unsqueeze(-1)
        z = torch.where(w != 1.0, (z - empty) * w + empty, z)
    context = z.reshape(1, -1, z.shape[-1])
    first_pooled = pooled[0:1].float() if pooled is not None else None
    return context, first_pooled


class _Vectors:
    """Embedding vectors by name for one encoder, loaded once per prompt encode."""

    def __init__(self, spec: EncoderSpec, resolved: dict[str, str]):
        self.spec = spec
        self.resolved = resolved
        self.loaded: dict[str, torch.Tensor] = {}

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.loaded:
            self.loaded[name] = prompt_embeddings.load_embedding(self.resolved[name], self.spec.key, self.spec.width)
        return self.loaded[name]


@dataclass(frozen=True)
class ParsedPrompt:
    text: str
    pieces: tuple[Piece, ...]
    resolved: tuple[tuple[str, str], ...]  # (name in prompt, relative file)
    signatures: tuple


def parse_for_encoding(text: str, syntax: str = DEFAULT_SYNTAX, missing_embedding: str = "error") -> ParsedPrompt:
    """Parse ``text`` and resolve its embeddings (raising or dropping unknown ones per ``missing_embedding``)."""
    if not isinstance(text, str):
        raise TypeError(f"prompt: expected a string, got {type(text).__name__}")
    check_syntax(syntax)
    if missing_embedding not in MISSING_EMBEDDING_POLICIES:
        raise ValueError(f"missing_embedding={missing_embedding!r}: use one of {MISSING_EMBEDDING_POLICIES}")
    available = prompt_embeddings.available_embeddings() if EMBEDDING_PREFIX in text else []
    resolved: dict[str, str] = {}

    def exists(name: str) -> bool:
        found = prompt_embeddings.find_embedding(name, available)
        if found is not None:
            resolved[name] = found
        return found is not None

    pieces = []
    for piece in parse_prompt(text, syntax, exists):
        if piece.kind == "embedding" and not piece.found:
            if missing_embedding == "error":
                listing = ", ".join(available[:20]) or "none"
                raise ValueError(
                    f"prompt: embedding:{piece.text} was not found in the 'embeddings' model folder "
                    f"(available: {listing}); check the name, or put the file into models/embeddings/")
            logger.warning("embedding:%s does not exist, ignoring it (as ComfyUI does)", piece.text)
            continue
        pieces.append(piece)
    names = sorted(set(resolved.values()))
    signatures = tuple(prompt_embeddings.file_signature(n) for n in names)
    return ParsedPrompt(text, tuple(pieces), tuple(sorted(resolved.items())), signatures)


@torch.no_grad()
def encode_parsed(engine: LeanEngine, parsed: ParsedPrompt) -> PromptEmbeds:
    """Encode one parsed prompt. Call inside ``engine.session("text")``. Returns [1, 77*k, C] on the engine."""
    device = engine.stage_device("text")
    resolved = dict(parsed.resolved)
    contexts, pooled = [], None
    for spec in encoder_specs(engine.parts):
        chunks = build_chunks(parsed.pieces, spec, _Vectors(spec, resolved))
        context, spec_pooled = encode_chunks(spec, chunks, device)
        contexts.append(context)
        if spec.projected_pooled:
            pooled = spec_pooled
    cut = min(c.shape[1] for c in contexts)
    context = torch.cat([c[:, :cut] for c in contexts], dim=-1)
    return PromptEmbeds(context.to(engine.device, engine.dtype),
                        None if pooled is None else pooled.to(engine.device, engine.dtype))


# --------------------------------------------------------------------------------------------- cache
_serials: "weakref.WeakKeyDictionary[ModelParts, int]" = weakref.WeakKeyDictionary()
_serial_counter = itertools.count(1)
_serial_lock = threading.Lock()


def parts_serial(parts: ModelParts) -> int:
    """A number unique to ``parts`` for the life of the process (never reused, unlike ``id``)."""
    with _serial_lock:
        serial = _serials.get(parts)
        if serial is None:
            serial = next(_serial_counter)
            _serials[parts] = serial
        return serial


def adapter_key(adapter) -> Any:
    """An adapter's part of the cache key: ``None`` if it leaves the text encoders alone (``affects_text`` False),
    else its ``cache_key`` (file identity and strengths), else the adapter object itself (identity)."""
    if not getattr(adapter, "affects_text", True):
        return None
    key = getattr(adapter, "cache_key", None)
    return adapter if key is None else key


def cache_key(engine: LeanEngine, parsed: ParsedPrompt, syntax: str, missing_embedding: str) -> tuple:
    adapters = tuple(k for k in (adapter_key(a) for a in engine.adapters) if k is not None)
    return (parts_serial(engine.parts), adapters, str(engine.device), str(engine.dtype),
            str(engine.dtype_for("text")), str(engine.stage_device("text")), syntax, missing_embedding,
            parsed.text, parsed.signatures)


class PromptCache:
    """Bounded LRU of prompt encodings; ``hits``/``misses`` count lookups."""

    def __init__(self, maxsize: int = 64):
        if not isinstance(maxsize, int) or maxsize < 0:
            raise ValueError(f"maxsize={maxsize!r}: expected an int >= 0 (0 disables the cache)")
        self.maxsize = maxsize
        self._data: "OrderedDict[tuple, PromptEmbeds]" = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: tuple) -> Optional[PromptEmbeds]:
        with self._lock:
            value = self._data.get(key)
            if value is None:
                self.misses += 1
                return None
            self._data.move_to_end(key)
            self.hits += 1
            return value

    def put(self, key: tuple, value: PromptEmbeds) -> None:
        if self.maxsize == 0:
            return
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.maxsize:
                self._data.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._data)


PROMPT_CACHE = PromptCache()


def encode_texts(engine: LeanEngine, texts: Sequence[str], *, syntax: str = DEFAULT_SYNTAX,
                 missing_embedding: str = "error", cache: Optional[PromptCache] = PROMPT_CACHE) -> list[PromptEmbeds]:
    """Encode each text ([1, 77*k, C] each), from ``cache`` when possible.

    Opens ``engine.session("text")`` only when some text is not cached (so a fully cached call moves no weights);
    do not call it inside a text session.
    """
    if isinstance(texts, str) or not isinstance(texts, Sequence):
        raise TypeError(f"texts: expected a list of prompt strings, got {type(texts).__name__}")
    parsed = [parse_for_encoding(t, syntax, missing_embedding) for t in texts]
    keys = [cache_key(engine, p, syntax, missing_embedding) for p in parsed]
    results: list[Optional[PromptEmbeds]] = [cache.get(k) if cache is not None else None for k in keys]
    missing = [i for i, r in enumerate(results) if r is None]
    if missing:
        with engine.session("text") as live:
            done: dict[tuple, PromptEmbeds] = {}
            for i in missing:
                if keys[i] not in done:
                    done[keys[i]] = encode_parsed(live, parsed[i])
                    if cache is not None:
                        cache.put(keys[i], done[keys[i]])
                results[i] = done[keys[i]]
    return results  # type: ignore[return-value]

"""Prompt weight syntax: text -> weighted pieces, exactly as ComfyUI 0.3.64's ``CLIPTextEncode`` reads it.

Hand-written because no library implements ComfyUI's rules (ComfyUI's own code may not be imported by the pack);
the tests check it against an independent reference and, with ``COMFYUI_PATH``, against ComfyUI itself.

Syntax ``"comfyui"`` (the default; ComfyUI 0.3.64 ``comfy/sd1_clip.py`` semantics):
- ``\\(`` and ``\\)`` are literal parentheses (they never open or close a group).
- The text is split at top level into plain runs and parenthesised groups. A depth counter goes up at ``(`` and
  down at ``)``; a group is the text from a ``(`` at depth 0 to the ``)`` that brings the depth back to 0.
  Unbalanced parentheses are therefore literal text (``(a b`` stays ``(a b``; a stray ``)`` drives the depth
  negative and the rest of the prompt is read as plain text, parentheses included).
- A group ``(inner)`` has weight ``w_parent * 1.1`` -- nesting multiplies: ``((x))`` = 1.1**2 = 1.21.
  If ``inner`` has a ``:`` after its first character, the text after the LAST ``:`` is read with Python's
  ``float``; on success the group's weight becomes that number (absolute: ``((x:1.5))`` is 1.5, not 1.65) and the
  ``:number`` suffix is removed. On failure (``(cat:abc)``) ComfyUI silently keeps ``1.1`` and the literal text
  ``cat:abc``; we reproduce that fallback (documented in docs/prompts.md).
- Square brackets and ``BREAK`` are literal text in ComfyUI.

Syntax ``"extended"`` (opt-in): the same rules plus A1111's ``[x]`` = weight * (1/1.1) per level (no ``:w`` inside
brackets; ``\\[`` ``\\]`` are literal) and ``BREAK`` (upper case, whole word) which ends the current 77-token
chunk. The emphasis *math* stays ComfyUI's (see ``prompt_encoder``).

After weighting, each piece is split at ``" embedding:"`` / ``"\\nembedding:"`` (and a leading ``embedding:``);
the first whitespace-separated word after ``embedding:`` names a textual-inversion file, the rest of the words are
text again (joined with single spaces, as ComfyUI does). A name that is not found is retried without surrounding
commas (``embedding:foo,``), the stripped commas going back into the text.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable, Optional

SYNTAXES = ("comfyui", "extended")
DEFAULT_SYNTAX = "comfyui"

EMPHASIS = 1.1
DEEMPHASIS = 1 / 1.1
EMBEDDING_PREFIX = "embedding:"
# Deepest group nesting read; deeper groups are refused (a weight of 1.1**200 is already meaningless, and each level
# is one Python frame, so an unbounded depth would end in RecursionError).
MAX_NESTING = 200
# Largest explicit weight ``(text:w)`` read: beyond it the embedding's scale only gives noise, and NaN / inf (which
# Python's float() parses) or 1e308 would turn the whole conditioning non-finite.
MAX_WEIGHT = 100.0

# Private-use code points stand in for escaped brackets while groups are found.
_ESCAPES = {"\\)": "\ue000", "\\(": "\ue001", "\\]": "\ue002", "\\[": "\ue003"}
_UNESCAPES = {"\ue000": ")", "\ue001": "(", "\ue002": "]", "\ue003": "["}
_EMBED_SPLIT = re.compile(r"(?: |\n)" + re.escape(EMBEDDING_PREFIX))
_BREAK = re.compile(r"\bBREAK\b")


@dataclass(frozen=True)
class Piece:
    """One unit of a parsed prompt.

    kind ``"text"``: ``text`` is tokenized as one group at ``weight``; kind ``"embedding"``: ``text`` is the
    textual-inversion name (``found`` says whether the resolver knew it); kind ``"break"``: end of a chunk.
    """

    kind: str
    text: str
    weight: float = 1.0
    found: bool = True


def check_syntax(syntax: str) -> str:
    if syntax not in SYNTAXES:
        raise ValueError(f"syntax={syntax!r} is not a prompt syntax; use one of {', '.join(SYNTAXES)}")
    return syntax


def check_text(text: str, input_name: str = "prompt") -> str:
    """``text`` unchanged; ``ValueError`` for a lone surrogate code point, which no tokenizer can encode as UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{input_name}: character {exc.start} is a lone surrogate ({text[exc.start]!r}), which is not valid "
            f"text; remove it or replace it with the intended character (a broken copy-paste or a mis-decoded "
            f"emoji usually leaves one)") from exc
    return text


def _top_level_items(text: str, openers: str, closers: str) -> list[str]:
    """Split ``text`` into plain runs and depth-0 bracket groups (brackets kept), ComfyUI's depth-counter rule."""
    items: list[str] = []
    buf: list[str] = []
    depth = 0
    for ch in text:
        if ch in openers:
            if depth == 0 and buf:
                items.append("".join(buf))
                buf = []
            buf.append(ch)
            depth += 1
        elif ch in closers:
            depth -= 1
            buf.append(ch)
            if depth == 0:
                items.append("".join(buf))
                buf = []
        else:
            buf.append(ch)
    if buf:
        items.append("".join(buf))
    return items


def _explicit_weight(inner: str) -> tuple[str, Optional[float]]:
    """``"text:1.3"`` -> ``("text", 1.3)``; no colon after position 0, or an unparsable number -> ``(inner, None)``."""
    cut = inner.rfind(":")
    if cut <= 0:
        return inner, None
    try:
        weight = float(inner[cut + 1:])
    except ValueError:
        return inner, None
    if not (math.isfinite(weight) and abs(weight) <= MAX_WEIGHT):
        raise ValueError(f"prompt: the weight of ({inner[:60]}) is {weight:g}; a weight must be a finite number within "
                         f"+-{MAX_WEIGHT:g} (1.0 is neutral, 1.1-1.5 the usual emphasis)")
    return inner[:cut], weight


def _weigh(text: str, weight: float, brackets: bool, out: list[tuple[str, float]], depth: int = 0) -> None:
    openers, closers = ("([", ")]") if brackets else ("(", ")")
    items = _top_level_items(text, openers, closers)
    if depth >= MAX_NESTING and any(len(i) >= 2 and i[0] in openers and i[-1] in closers for i in items):
        raise ValueError(
            f"prompt: its parentheses/brackets are nested more than {MAX_NESTING} levels deep; the nesting limit is "
            f"{MAX_NESTING}: use an explicit weight such as (word:1.5) instead of deep nesting, or escape literal "
            f"parentheses as \\( \\)")
    for item in items:
        if len(item) >= 2 and item[0] == "(" and item[-1] == ")":
            inner, explicit = _explicit_weight(item[1:-1])
            _weigh(inner, weight * EMPHASIS if explicit is None else explicit, brackets, out, depth + 1)
        elif brackets and len(item) >= 2 and item[0] == "[" and item[-1] == "]":
            _weigh(item[1:-1], weight * DEEMPHASIS, brackets, out, depth + 1)
        else:
            out.append((item, weight))


def parse_weights(text: str, syntax: str = DEFAULT_SYNTAX) -> list[tuple[str, float]]:
    """``text`` -> ``[(segment, weight), ...]`` with escapes resolved (no embedding or BREAK handling)."""
    if not isinstance(text, str):
        raise TypeError(f"text: expected a prompt string, got {type(text).__name__}")
    check_text(text)
    check_syntax(syntax)
    brackets = syntax == "extended"
    escaped = text
    for seq, mark in _ESCAPES.items():
        if brackets or seq in ("\\)", "\\("):
            escaped = escaped.replace(seq, mark)
    out: list[tuple[str, float]] = []
    _weigh(escaped, 1.0, brackets, out)
    restored = []
    for segment, weight in out:
        for mark, ch in _UNESCAPES.items():
            segment = segment.replace(mark, ch)
        restored.append((segment, weight))
    return restored


def _embedding_word(rest: str, exists: Callable[[str], bool]) -> tuple[str, bool, str]:
    """The text after ``embedding:`` -> (name, found, leftover text), with ComfyUI's trailing-comma retry."""
    words = rest.split()
    if not words:
        raise ValueError(
            f"prompt: 'embedding:' must be followed by an embedding file name (e.g. embedding:my_style), "
            f"got {EMBEDDING_PREFIX + rest!r}")
    name, leftover = words[0], " ".join(words[1:])
    if exists(name):
        return name, True, leftover
    stripped = name.strip(",")
    if len(stripped) < len(name):
        return stripped, bool(stripped) and exists(stripped), f"{name[len(stripped):]} {leftover}"
    return name, False, leftover


def parse_prompt(text: str, syntax: str = DEFAULT_SYNTAX,
                 exists: Optional[Callable[[str], bool]] = None) -> list[Piece]:
    """Parse ``text`` into :class:`Piece` s. ``exists(name)`` says whether an embedding file ``name`` is available."""
    exists = exists or (lambda name: False)
    pieces: list[Piece] = []
    for segment, weight in parse_weights(text, syntax):
        parts = [segment]
        if syntax == "extended":
            parts = []
            for i, part in enumerate(_BREAK.split(segment)):
                if i:
                    parts.append(None)  # BREAK marker
                parts.append(part)
        for part in parts:
            if part is None:
                pieces.append(Piece("break", "", 1.0))
                continue
            split = _EMBED_SPLIT.split(part)
            words = [split[0]] + [EMBEDDING_PREFIX + s for s in split[1:]]
            for word in words:
                if word == "":
                    continue
                if word.startswith(EMBEDDING_PREFIX):
                    name, found, leftover = _embedding_word(word[len(EMBEDDING_PREFIX):].strip("\n"), exists)
                    pieces.append(Piece("embedding", name, weight, found))
                    if leftover == "":
                        continue
                    word = leftover
                pieces.append(Piece("text", word, weight))
    return pieces

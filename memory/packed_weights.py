"""Lossless packing of streamed bf16 weights: fewer bytes cross PCIe per step, the same bits land in the ring.

Why: under ``stream`` a DiT's step at a small budget is bound by host-to-device bandwidth (Z-Image at 6 GB moves
8.8 GB a step against ~115 ms of compute). A bf16 word is sign, 8 exponent bits, 7 mantissa bits; the sign and
mantissa are incompressible, but a layer's exponents crowd into a few binades. Coding each exponent in 3 bits
against a per-unit window of 7 binades (code 0 escapes to the full byte, kept in a side stream) leaves ~11.1 bits a
word for weights drawn around one scale: ~70% of the bytes, decoded on the GPU at memory speed
(``kernels/bf16_unpack.py`` holds the format and its decoder).

Invariants
- ``pack_words(words)`` then ``unpack_words`` gives back ``words`` bit for bit, for any 16-bit content (the window
  only decides how many words escape, never what they decode to); a unit whose packed form is not smaller than
  ``SLOT_FRACTION`` of its plain bytes is left plain (``PackedUnit`` is None for it).
- The window base is chosen from a strided sample of the unit (``SAMPLE_WORDS``): it affects the size only.
- ``slot_fraction(device, dtype)`` is the planner's one switch: packing needs a CUDA device (the copy engine is what
  it saves) and bf16 streaming (an fp16 word's exponent has 5 bits: nothing to gain). The streamer packs exactly
  when its schedule reserved a packed staging slot (``StreamSchedule.slot_bytes``).
  ``LEANDIFFUSION_PACKED_STREAMING=off`` turns it off (for comparing against plain copies);
  ``LEANDIFFUSION_PACKED_SLOTS`` (1 or 2) sets how many slots a ring gets (``slot_count``).
- Packing runs on ``device`` (the GPU at load, in slices of ``SLICE_WORDS``; the CPU in tests): no extra device
  memory stays held after it.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional

import torch

from ..kernels.bf16_unpack import CHUNK, CODE_BITS, unpack_words
from .hostmem import ALIGN, PinnedBuffer, align

logger = logging.getLogger(__name__)

SLOT_FRACTION = 0.75  # a packed staging slot, per byte of the largest unit; a unit packing larger stays plain
# slots the packed copies alternate between (``slot_count``): with 2, unit k+1's bytes land while unit k decodes,
# with 1 the copy engine waits for each decode but one more slot's worth of weights stays resident (Z-Image at
# 6 GB, eager steps: 2 slots 1.38 s, 1 slot 1.43 s)
DEFAULT_SLOTS = 2
SLOTS_ENV = "LEANDIFFUSION_PACKED_SLOTS"
ESTIMATED_RATIO = 0.70  # packed / plain bytes the planner's time model assumes (weights around one scale)
SLICE_WORDS = 1 << 24  # words packed per device pass (a multiple of CHUNK)
SAMPLE_WORDS = 1 << 20  # words sampled to choose a unit's exponent window
ENV = "LEANDIFFUSION_PACKED_STREAMING"
_WINDOW = (1 << CODE_BITS) - 1  # exponents a code can name: base + 1 .. base + 7


def slot_fraction(device: torch.device, dtype: torch.dtype) -> float:
    """The packed slot's size per byte of the largest streamed unit, 0.0 where streaming stays plain (docstring)."""
    setting = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if setting not in ("auto", "off"):
        raise ValueError(f"{ENV}={setting!r}: expected 'auto' or 'off'")
    if setting == "off" or torch.device(device).type != "cuda" or dtype != torch.bfloat16:
        return 0.0
    return SLOT_FRACTION


def slot_count() -> int:
    """How many packed staging slots a ring gets: ``$LEANDIFFUSION_PACKED_SLOTS`` (1 or 2), else ``DEFAULT_SLOTS``."""
    text = os.environ.get(SLOTS_ENV, "").strip() or str(DEFAULT_SLOTS)
    if text not in ("1", "2"):
        raise ValueError(f"{SLOTS_ENV}={text!r}: expected 1 or 2 packed staging slots")
    return int(text)


def slot_bytes_for(biggest_unit_bytes: int, fraction: float) -> int:
    """Bytes of the ``slot_count()`` packed staging slots for units up to ``biggest_unit_bytes`` (0 without
    packing)."""
    return slot_count() * align(int(fraction * biggest_unit_bytes)) if fraction > 0 else 0


def choose_base(words: torch.Tensor) -> int:
    """The window base whose exponents ``base + 1 .. base + 7`` cover the most of a strided sample of ``words``."""
    step = max(1, words.numel() // SAMPLE_WORDS)
    sample = words[::step].to(torch.int32)
    hist = torch.bincount((sample >> 7) & 0xFF, minlength=256).cpu()
    hist[0] = 0  # exponent field 0 (zeros, subnormals) always escapes
    window = hist.unfold(0, _WINDOW, 1).sum(1)  # window[j] covers exponents j .. j + 6
    return max(0, int(torch.argmax(window[1:])))  # base = j - 1 for the best j >= 1


@dataclass
class PackedUnit:
    """One unit's packed words in a pinned host buffer: ``[sm | planes | offsets | escapes]`` (each section aligned)."""
    host: PinnedBuffer
    words: int
    base: int
    escapes: int
    sections: tuple  # byte offsets of sm, planes, offsets, escapes

    @property
    def nbytes(self) -> int:
        return self.host.nbytes

    def views(self, buffer: torch.Tensor) -> tuple:
        """(sm, planes, offsets, escapes) as views of ``buffer`` (the host copy, or the slot it was copied to)."""
        n, (o_sm, o_pl, o_off, o_esc) = self.words, self.sections
        n8, chunks = (n + 7) // 8, (n + CHUNK - 1) // CHUNK
        return (buffer[o_sm: o_sm + n], buffer[o_pl: o_pl + CODE_BITS * n8].view(CODE_BITS, n8),
                buffer[o_off: o_off + 4 * chunks].view(torch.int32), buffer[o_esc: o_esc + self.escapes])

    def unpack_into(self, slot: torch.Tensor, out: torch.Tensor) -> None:
        """Decode from ``slot`` (this unit's bytes already copied to its start) into ``out`` (the unit's plain bytes
        as uint8), on the current stream."""
        unpack_words(*self.views(slot), self.base, out.view(torch.int16))


def _sections(words: int, escapes: int) -> tuple[tuple, int]:
    n8, chunks = (words + 7) // 8, (words + CHUNK - 1) // CHUNK
    o_sm = 0
    o_pl = align(o_sm + words)
    o_off = align(o_pl + CODE_BITS * n8)
    o_esc = align(o_off + 4 * chunks)
    return (o_sm, o_pl, o_off, o_esc), align(o_esc + max(escapes, 1))


def _pack_slice(words: torch.Tensor, base: int) -> tuple:
    """(sm, planes [3, n/8], escape counts per chunk, escapes) of a slice of ``words`` (CHUNK-aligned start)."""
    w = words.to(torch.int32) & 0xFFFF
    n = w.numel()
    exponent = (w >> 7) & 0xFF
    code = exponent - base
    in_window = (code >= 1) & (code <= _WINDOW)
    code = torch.where(in_window, code, torch.zeros_like(code))
    sm = (((w >> 8) & 0x80) | (w & 0x7F)).to(torch.uint8)
    padded = torch.nn.functional.pad(code, (0, (-n) % 8)).view(-1, 8)
    weights = (1 << torch.arange(8, device=w.device, dtype=torch.int32))
    planes = torch.stack([(((padded >> b) & 1) * weights).sum(1) for b in range(CODE_BITS)]).to(torch.uint8)
    escaped = ~in_window
    counts = torch.nn.functional.pad(escaped.to(torch.int32), (0, (-n) % CHUNK)).view(-1, CHUNK).sum(1)
    return sm, planes, counts, exponent[escaped].to(torch.uint8)


def pack_words(words: torch.Tensor, device: Optional[torch.device] = None, pin: bool = False,
               limit_bytes: Optional[int] = None) -> Optional[PackedUnit]:
    """Pack a 1-D int16 tensor (a unit's plain bytes viewed as words) into a new host buffer, working on ``device``
    (default: where ``words`` are); None when the packed form would exceed ``limit_bytes`` (default: the plain
    size times ``SLOT_FRACTION``)."""
    if words.dtype != torch.int16 or words.dim() != 1:
        raise ValueError(f"words must be a 1-D int16 tensor, got {words.dtype} {tuple(words.shape)}")
    device = torch.device(device) if device is not None else words.device
    n = words.numel()
    limit = int(SLOT_FRACTION * 2 * n) if limit_bytes is None else limit_bytes
    base = choose_base(words)
    parts = []
    for start in range(0, n, SLICE_WORDS):
        chunk = words[start: start + SLICE_WORDS].to(device, non_blocking=False)
        parts.append(tuple(t.cpu() for t in _pack_slice(chunk, base)))
    sm = torch.cat([p[0] for p in parts]) if parts else torch.empty(0, dtype=torch.uint8)
    planes = torch.cat([p[1] for p in parts], dim=1) if parts else torch.empty(CODE_BITS, 0, dtype=torch.uint8)
    counts = torch.cat([p[2] for p in parts]) if parts else torch.empty(0, dtype=torch.int32)
    escapes = torch.cat([p[3] for p in parts]) if parts else torch.empty(0, dtype=torch.uint8)
    sections, total = _sections(n, escapes.numel())
    if total > limit:
        return None
    offsets = (torch.cumsum(counts, 0) - counts).to(torch.int32)
    packed = PackedUnit(PinnedBuffer(total, pin=pin), n, base, escapes.numel(), sections)
    packed.host.tensor.zero_()
    for view, values in zip(packed.views(packed.host.tensor), (sm, planes, offsets, escapes)):
        view.copy_(values)
    return packed


def packed_host_estimate(plain_bytes: int) -> int:
    """Host bytes packing ``plain_bytes`` of weights is expected to take (the planner's ratio)."""
    return int(ESTIMATED_RATIO * plain_bytes) + ALIGN

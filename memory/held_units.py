"""Streamed units kept on the device for one run (``BlockStreamer.hold``): their parameters point into one device
buffer, filled by the run's first forward, so later forwards neither copy nor decode them.

Invariants
- While held, a unit's parameters are views of its slice of ``buffer`` (laid out as in its ring slice), not of the
  ring. Its first forward after ``hold`` copies it from the host into that slice exactly as it would into the ring
  (packed or plain: the same bytes land), so every forward computes on the same bytes as without holding.
- A unit is marked filled when its copy is issued; copies are stream-ordered and every forward joins its copy
  streams before the next one forks, so a later forward always reads a completed fill.
- ``release`` points the parameters back at their ring slices (or leaves them where the caller put them when the
  ring is gone) and drops the buffer; the next forward copies every unit again.

Why: a held unit's copy from a second device buffer into its ring slice each step still queued on the copy stream
between the host copies (~0.5-1 ms a unit on an H200) and the buffer itself crossed PCIe unpacked before the first
step; computing in place removes both.
"""
from __future__ import annotations

from typing import Optional

import torch

from .hostmem import FlatLayout, align


class HeldUnits:
    """The held units of one run: ``offsets`` maps a streamed unit's position to its slice of ``buffer``."""

    def __init__(self, buffer: torch.Tensor, offsets: dict[int, int], params: list[list[torch.nn.Parameter]],
                 layouts: list[FlatLayout]):
        self.buffer = buffer
        self.offsets = dict(offsets)
        self._params, self._layouts = params, layouts
        self._unfilled = set(self.offsets)
        with torch.no_grad():
            for k, offset in self.offsets.items():
                for p, view in zip(params[k], layouts[k].views(buffer, offset)):
                    p.data = view

    @staticmethod
    def choose(layouts: list[FlatLayout], room_bytes: int) -> tuple[dict[int, int], int]:
        """Units in schedule order while they fit in ``room_bytes``: (position -> offset in the held buffer, the
        buffer's bytes)."""
        chosen, total = {}, 0
        for k, lay in enumerate(layouts):
            size = align(lay.nbytes)
            if total + size <= room_bytes:
                chosen[k] = total
                total += size
        return chosen, total

    def __contains__(self, k: int) -> bool:
        return k in self.offsets

    def take_fill(self, k: int) -> Optional[torch.Tensor]:
        """The slice unit ``k``'s copy must fill now, or None when an earlier forward already issued its fill."""
        if k not in self._unfilled:
            return None
        self._unfilled.discard(k)
        offset = self.offsets[k]
        return self.buffer[offset: offset + self._layouts[k].nbytes]

    def release(self, arena: Optional[torch.Tensor], ring_offsets: tuple) -> None:
        """Point the held parameters back at their ring slices of ``arena`` (left alone when ``arena`` is None: the
        caller has put them on the host) and drop the buffer."""
        if arena is not None:
            with torch.no_grad():
                for k in self.offsets:
                    for p, view in zip(self._params[k], self._layouts[k].views(arena, ring_offsets[k])):
                        p.data = view
        self.buffer, self.offsets, self._unfilled = None, {}, set()

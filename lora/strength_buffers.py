"""Where unmerged LoRA strengths live: persistent device buffers ``up_s = strength * up``, rewritten at attach.

Invariants
- Strength is data, not structure: a forward reads the buffers, so a CUDA graph captured while a binding was
  attached replays any strength written since; a strength change costs the rewrite, never a recapture, recompile
  or base-weight copy.
- The plain layers' buffers of a component are consecutive views of one flat tensor per device and dtype
  (``BufferArena``): zeroing them is one kernel, and since the loader packs their sources the same way
  (``loader.to_device``) the multi-tensor ``buf += strength * up`` runs over a few long spans, not one entry per
  layer. ``0 + s * up`` rounds exactly as ``s * up``.
- Strength writes never happen inside a CUDA-graph capture (``refuse_inside_capture``): a write captured into a
  graph would replay the old value.
"""
from __future__ import annotations

from typing import Iterable

import torch


def refuse_inside_capture(label: str, component: str) -> None:
    """Strength writes are kernels with the value baked in: inside a CUDA-graph capture they would be recorded
    and re-run on every replay with the old value. Sessions must be entered before capturing (as the sampler does)."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"LoRA {label!r}: cannot write the {component} strength while a CUDA graph is being "
                           f"captured; enter the view's session('unet') before capturing and capture inside it")


class BufferArena:
    """The plain LoRA layers' ``up_s`` buffers of one component as consecutive views of one zeroed flat tensor per
    (device, dtype), handed out in ``take`` order with their sources.

    ``spans()`` merges each maximal run of buffers whose sources also lie back to back in one storage (the loader
    packs a component's plain ``up`` factors so: ``loader.to_device``) into one pair of 1-D views; every buffer lies
    in exactly one span, paired element for element with its own source."""

    __slots__ = ("flats", "used", "_pairs")

    def __init__(self, factors: Iterable[torch.Tensor]):
        sizes: dict[tuple, int] = {}
        for f in factors:
            sizes[(f.device, f.dtype)] = sizes.get((f.device, f.dtype), 0) + f.numel()
        self.flats = {key: torch.zeros(n, device=key[0], dtype=key[1]) for key, n in sizes.items()}
        self.used = dict.fromkeys(sizes, 0)
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def take(self, source: torch.Tensor) -> torch.Tensor:
        """A zeroed contiguous buffer shaped like ``source`` (whose device, dtype and size the arena was built
        with), to hold ``strength * source``."""
        key = (source.device, source.dtype)
        start = self.used[key]
        self.used[key] = start + source.numel()
        buf = self.flats[key][start:start + source.numel()].view(source.shape)
        self._pairs.append((source, buf))
        return buf

    def holds(self, buf: torch.Tensor) -> bool:
        """Whether ``buf`` is one of this arena's views."""
        return any(buf.untyped_storage().data_ptr() == f.data_ptr() for f in self.flats.values())

    def spans(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``(buffer spans, source spans)``: equal-shaped pairs covering every buffer taken (class docstring)."""
        runs: list[list] = []  # [first source, first buffer, element count]
        for src, buf in self._pairs:
            if runs and _follows(runs[-1][0], runs[-1][2], src) and _follows(runs[-1][1], runs[-1][2], buf):
                runs[-1][2] += src.numel()
            else:
                runs.append([src, buf, src.numel()])
        dst, srcs = [], []
        for src, buf, n in runs:
            if src.is_contiguous():
                src, buf = (torch.as_strided(t, (n,), (1,), t.storage_offset()) for t in (src, buf))
            dst.append(buf)
            srcs.append(src)
        return dst, srcs

    def zero_(self) -> None:
        for flat in self.flats.values():
            flat.zero_()


def _follows(first: torch.Tensor, count: int, t: torch.Tensor) -> bool:
    """Whether contiguous ``t`` starts right after ``count`` elements from ``first`` in the same storage."""
    return (t.is_contiguous() and first.is_contiguous() and t.dtype == first.dtype and t.device == first.device
            and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
            and t.storage_offset() == first.storage_offset() + count)

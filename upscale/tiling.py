"""Tile plan for context-tiled upscaling: cores partition the image, windows add context, seams are feathered.

Per axis of length ``L`` (already a multiple of ``m``, the model's alignment), with core size ``t`` and context
``o`` (rounded up to a multiple of ``m``):

- cores: ``n = ceil(L / t)`` near-equal intervals ``[b_i, b_{i+1})`` with ``b_i`` = ``i*L/n`` rounded to a
  multiple of ``m``; they partition ``[0, L)``;
- window (what the model sees): ``[b_i - o, b_{i+1} + o)`` clipped to ``[0, L)``. Clipping happens only at the
  image border, where the model's own zero padding is what the one-piece run sees too;
- kept part: ``[b_i - f, b_{i+1} + f)`` clipped, ``f = min(o // 4, shortest core // 2)``; neighbouring kept parts
  overlap by the band ``[b_i - f, b_i + f)`` and are blended there with linear ramps evaluated at output pixel
  centres, ``w_right(j) = (j + 0.5) / (2 f s)`` and ``w_left = 1 - w_right``, so the weights of every output
  pixel sum to 1 (a partition of unity; 2-D weights are products of the 1-D ones, which keeps the property).

A window shorter than the model's smallest accepted side (``min_window``, spandrel's ``minimum``: RealCUGAN,
SCUNet ...) is widened to it inside ``[0, L)``; that only adds context, so kept parts and weights are unchanged.

Every kept pixel therefore sees at least ``o - f >= 3o/4`` pixels of real context on each interior side. When that is at
least the model's receptive-field radius (SRVGGNetCompact: ``num_conv + 2``), the tiled result equals the untiled
one up to float rounding; for RRDBNet (receptive field wider than any practical overlap) the remaining error is
small and the feathering hides the seam.

Why hand-written: spandrel (the architecture library ComfyUI uses) loads models but does not tile, and ComfyUI's
``tiled_scale`` lives in ComfyUI (which the pack may not import) and feathers across the whole overlap, so each
tile's own cut edge (computed without context) still carries weight; no library computes this plan.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Span:
    keep0: int
    keep1: int
    win0: int
    win1: int
    band_lo: int  # feather band width (input px) at the low end of the kept part, 0 at the image border
    band_hi: int


def _round_up(v: int, m: int) -> int:
    return -(-v // m) * m


def plan_axis(length: int, tile: int, overlap: int, multiple: int = 1, min_window: int = 1) -> list[Span]:
    """Spans covering ``[0, length)`` (see the module docstring); ``length`` must be a multiple of ``multiple``
    and at least ``min_window``."""
    if length <= 0 or tile <= 0 or overlap < 0 or multiple <= 0 or length % multiple or length < min_window:
        raise ValueError(f"plan_axis(length={length}, tile={tile}, overlap={overlap}, multiple={multiple}, "
                         f"min_window={min_window}): need positive sizes, overlap >= 0, length a multiple of "
                         f"multiple and at least min_window")
    if length <= tile:
        return [Span(0, length, 0, length, 0, 0)]
    o = _round_up(overlap, multiple)
    n = math.ceil(length / tile)
    bounds = [0] + [int(round(i * length / n / multiple)) * multiple for i in range(1, n)] + [length]
    bounds = sorted(set(bounds))
    shortest = min(b - a for a, b in zip(bounds, bounds[1:]))
    f = min(o // 4, shortest // 2)
    smallest = _round_up(min_window, multiple)
    spans = []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        first, last = i == 0, i == len(bounds) - 2
        keep0 = a if first else a - f
        keep1 = b if last else b + f
        win0, win1 = max(0, a - o), min(length, b + o)
        if win1 - win0 < smallest:  # widen to the model's minimum: extend the end first, then the start
            win1 = min(length, win0 + smallest)
            win0 = max(0, win1 - smallest)
        spans.append(Span(keep0, keep1, win0, win1, 0 if first else 2 * f, 0 if last else 2 * f))
    return spans


def axis_weights(span: Span, scale: int, device=None) -> torch.Tensor:
    """1-D feather weights of a span's kept part in output pixels (float32, ones outside the bands)."""
    n = (span.keep1 - span.keep0) * scale
    w = torch.ones(n, dtype=torch.float32, device=device)
    if span.band_lo:
        k = span.band_lo * scale
        w[:k] = (torch.arange(k, dtype=torch.float32, device=device) + 0.5) / k
    if span.band_hi:
        k = span.band_hi * scale
        w[n - k:] = 1 - (torch.arange(k, dtype=torch.float32, device=device) + 0.5) / k
    return w


def plan(height: int, width: int, tile: int, overlap: int, multiple: int = 1,
         min_window: int = 1) -> list[tuple[Span, Span]]:
    """All ``(row_span, col_span)`` tiles, row-major."""
    rows = plan_axis(height, tile, overlap, multiple, min_window)
    cols = plan_axis(width, tile, overlap, multiple, min_window)
    return [(r, c) for r in rows for c in cols]


def largest_window(tiles: list[tuple[Span, Span]]) -> tuple[int, int]:
    return (max(r.win1 - r.win0 for r, _ in tiles), max(c.win1 - c.win0 for _, c in tiles))


def largest_keep(tiles: list[tuple[Span, Span]]) -> tuple[int, int]:
    return (max(r.keep1 - r.keep0 for r, _ in tiles), max(c.keep1 - c.keep0 for _, c in tiles))

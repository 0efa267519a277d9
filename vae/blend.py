"""``blend`` mode: overlapping tiles, each run through the whole module, cross-faded with linear ramps.

Invariant: every output pixel is the weighted mean of the tiles covering it, the weights being products of
per-axis linear ramps that rise across each overlap (so a pixel covered by one tile is that tile's value).
Tiles have per-tile GroupNorm statistics, so this is an approximation of the untiled result (its error is
reported by the tests); it is cheaper than ``exact`` because each tile makes a single pass.

Tiles are spread evenly: ``n = ceil((L - o) / (t - o))`` tiles per axis of length ``L`` (tile at most ``t``,
overlap at least ``o``), each ``ceil((L + (n - 1) o) / n)`` long, so no tile is wasted on a sliver at the edge.
The weighted sum and the weight sum are accumulated on the host; the division happens once at the end.

Why hand-written: diffusers' ``AutoencoderKL.tiled_decode`` / ``tiled_encode`` cross-fade the same way, but only for
diffusers modules (not ComfyUI's LDM ``VAE``), with the tile size held in attributes of the module (choosing one
per call would mutate the shared model) and without the out-of-memory retry and budget that ``tiled.py`` gives both
modes; here one function serves both module trees.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from .. import bridge


def axis_tiles(length: int, tile: int, overlap: int, align: int = 1) -> list[tuple[int, int]]:
    """(start, size) of the tiles along one axis (see the module docstring); starts are multiples of ``align``."""
    if length <= tile:
        return [(0, length)]
    n = math.ceil((length - overlap) / (tile - overlap))
    size = math.ceil((length + (n - 1) * overlap) / n)
    size = min(length, math.ceil(size / align) * align)
    starts = [min(length - size, (round(i * (length - size) / (n - 1)) // align) * align) for i in range(n)]
    starts[-1] = length - size
    return [(s, size) for s in sorted(set(starts))]


def _ramp(starts: list, index: int, scale_num: int, scale_den: int):
    """Per-row weights of tile ``index`` along one axis, in output units."""
    s, e = starts[index]
    so, eo = s * scale_num // scale_den, (s + e) * scale_num // scale_den
    w = torch.ones(eo - so)
    if index > 0:
        prev_end = (starts[index - 1][0] + starts[index - 1][1]) * scale_num // scale_den
        ov = prev_end - so
        if ov > 0:
            w[:ov] = torch.minimum(w[:ov], (torch.arange(ov) + 0.5) / ov)
    if index + 1 < len(starts):
        nxt = starts[index + 1][0] * scale_num // scale_den
        ov = eo - nxt
        if ov > 0:
            w[-ov:] = torch.minimum(w[-ov:], (ov - 0.5 - torch.arange(ov)) / ov)
    return so, eo, w


def run_blend(fn: Callable[[torch.Tensor], torch.Tensor], sample: torch.Tensor, tile: int, overlap: int,
              scale: tuple[int, int], device: torch.device, dtype: torch.dtype, align: int = 1,
              progress: Optional[Callable[[], None]] = None) -> torch.Tensor:
    """Run ``fn`` over overlapping tiles of ``sample`` [1, C, H, W] (host) and blend; returns [1, C', H', W'] fp32.

    ``tile``/``overlap`` are in input units; ``scale = (num, den)`` maps input to output size (8/1 decode, 1/8
    encode).
    """
    _, _, h, w = sample.shape
    ys, xs = axis_tiles(h, tile, overlap, align), axis_tiles(w, tile, overlap, align)
    num, den = scale
    acc = wsum = None
    for iy, (y0, th) in enumerate(ys):
        for ix, (x0, tw) in enumerate(xs):
            bridge.check_interrupted()
            part = sample[:, :, y0:y0 + th, x0:x0 + tw].to(device, dtype)
            out = fn(part).float().cpu()
            del part
            if acc is None:
                acc = torch.zeros(1, out.shape[1], h * num // den, w * num // den)
                wsum = torch.zeros(1, 1, h * num // den, w * num // den)
            ya, yb, wy = _ramp(ys, iy, num, den)
            xa, xb, wx = _ramp(xs, ix, num, den)
            weight = (wy[:, None] * wx[None, :])[None, None]
            acc[:, :, ya:yb, xa:xb] += out * weight
            wsum[:, :, ya:yb, xa:xb] += weight
            if progress is not None:
                progress()
    return acc / wsum

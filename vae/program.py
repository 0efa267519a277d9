"""A VAE encoder/decoder as a list of stages of row-local operations, with the row algebra tiles need.

Invariant: running a ``Program``'s stages in order over whole images computes exactly what the original module
computes (same modules, same order; GroupNorm statistics supplied from outside). Every operation except global
attention is *row-local*: output rows ``[a, b)`` depend only on input rows ``need(a, b)``, so a full-width band of
rows can be computed from a band of input rows plus a halo:

- 3x3 convolution, stride 1, zero padding 1: ``[a-1, b+1)`` clipped to the image. Computing it on a cropped band
  with the module's own zero padding is exact on every row whose 3 input rows were real; the first/last row of
  an interior band is wrong and is cropped away (it is halo). At the image border the padding is the real one.
- 1x1 convolution, GroupNorm with given statistics, a per-pixel norm over channels (``rms``: Wan-style VAEs,
  ``causal3d.py``), SiLU: ``[a, b)``.
- nearest 2x upsampling: ``[a // 2, ceil(b / 2))``.
- downsampling as in SD's encoder (zero pad 1 at the right and bottom, 3x3 convolution, stride 2, no padding):
  ``[2a, min(2b + 1, H))``; the bottom zero row is added only when the band reaches the image's bottom.

Widths are never cut (bands span the full width), so left/right padding is always the module's own.
A stage's ``residual`` adds ``shortcut(value after ops[:src])`` at the end (ResNet blocks).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F

ROW_LOCAL = ("gn", "rms", "silu", "conv1", "conv3", "up2", "down2", "affine")


@dataclass(frozen=True, eq=False)
class Op:
    """One operation. ``kind`` is one of ``ROW_LOCAL``; ``module`` is the torch module it calls (conv, norm)."""

    kind: str
    module: Any = None
    args: tuple = ()

    def __post_init__(self):
        if self.kind not in ROW_LOCAL:
            raise ValueError(f"Op kind={self.kind!r}: expected one of {ROW_LOCAL}")

    def channels(self, c_in: int) -> int:
        if self.kind in ("conv1", "conv3", "down2"):
            return int(self.module.out_channels)
        return c_in

    def out_size(self, h: int) -> int:
        if self.kind == "up2":
            return 2 * h
        if self.kind == "down2":
            return (h - 2) // 2 + 1
        return h

    def need(self, a: int, b: int, h_in: int) -> tuple[int, int]:
        """Input rows needed for output rows ``[a, b)`` (see the module docstring)."""
        if self.kind == "conv3":
            return max(a - 1, 0), min(b + 1, h_in)
        if self.kind == "up2":
            return a // 2, (b + 1) // 2
        if self.kind == "down2":
            return 2 * a, min(2 * b + 1, h_in)
        return a, b

    def forward(self, x: torch.Tensor, lo: int, h_in: int, norm=None) -> tuple[torch.Tensor, int]:
        """Apply to rows starting at ``lo`` of an input of height ``h_in``; returns (output, its first row)."""
        k = self.kind
        if k == "gn":
            return norm(x), lo
        if k == "silu":
            return F.silu(x), lo
        if k in ("conv1", "conv3", "rms"):
            return self.module(x), lo
        if k == "up2":
            return F.interpolate(x, scale_factor=2.0, mode="nearest"), 2 * lo
        if k == "down2":
            bottom = 1 if lo + x.shape[2] == h_in else 0
            return self.module(F.pad(x, (0, 1, 0, bottom))), lo // 2
        scale, shift = self.args  # affine
        return x * scale + shift, lo


@dataclass(eq=False)
class Stage:
    """A chain of row-local ops (``kind="chain"``) or one global attention block (``kind="attention"``)."""

    kind: str
    ops: list = field(default_factory=list)
    residual_src: Optional[int] = None  # add shortcut(value after ops[:src]) at the end
    shortcut: Any = None  # a 1x1 conv module or None (identity)
    output_scale: float = 1.0
    attention: Any = None  # an AttentionSpec for kind == "attention"
    name: str = ""

    @property
    def first_groups(self) -> Optional[int]:
        """GroupNorm groups of the op that reads this stage's input first, if that op is a GroupNorm (an attention
        block's input GroupNorm included: the stage before gathers its statistics); None for a per-pixel norm."""
        if self.kind == "chain" and self.ops and self.ops[0].kind == "gn":
            return int(self.ops[0].module.num_groups)
        if self.kind == "attention" and self.attention is not None and not self.attention.pointwise_norm:
            return int(self.attention.norm.num_groups)
        return None

    def shapes(self, c: int, h: int, w: int) -> list[tuple[int, int, int]]:
        """(channels, height, width) of the value after ``ops[:k]`` for k = 0..len(ops)."""
        out = [(c, h, w)]
        for op in self.ops:
            c, h, w = op.channels(c), op.out_size(h), op.out_size(w)
            out.append((c, h, w))
        return out


@dataclass(eq=False)
class Program:
    """Stages of an encoder or decoder, plus what the image/latent convention needs at each end."""

    stages: list
    in_channels: int
    out_channels: int
    scale: int  # output size / input size: 8 for a decoder; 1/8 is written as -8 for an encoder
    kind: str  # "decoder" | "encoder"
    latent_channels: int = 4

    @property
    def factor(self) -> int:
        """Image pixels per latent pixel along each axis: 2 ** (number of up/downsamplers); 8 for SD's VAEs."""
        return abs(self.scale)


def fuse(first: Stage, second: Stage) -> Stage:
    """One chain computing ``first`` then ``second`` (``first`` must have no residual)."""
    if first.kind != "chain" or second.kind != "chain" or first.residual_src is not None:
        raise ValueError("only a residual-free chain can be fused into a following chain")
    src = None if second.residual_src is None else second.residual_src + len(first.ops)
    return Stage("chain", list(first.ops) + list(second.ops), src, second.shortcut, second.output_scale,
                 name=f"{first.name}+{second.name}")

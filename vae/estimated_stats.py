"""``blend`` mode's estimated statistics for a GroupNorm that follows a convolution inside a stage (a ResNet block's
``norm2``): the group means exact, the variances from a subset of the columns.

Why: ``exact`` (``exact.py``) needs the whole-image statistics of ``norm2``'s input ``y = conv1(u)`` before any band
can be normalised, so it runs ``norm1 -> silu -> conv1`` over the whole image once more: 0.38x the untiled
module's FLOPs on the test kit's VAEs. Cheaper estimates of those statistics must be very good: on the kit's tiny
random VAEs a 1% error in every group's variance moves the decoded image by 0.005 of its 0..1 range on average, an
error of 1% of the spread in every group's mean by 0.009, so statistics from a downscaled image (0.03-0.45 mean
error), from a sample of windows (0.03-0.15), per tile (0.015-0.06) or from every other band of rows (0.01) are not
usable there. This estimate is:

- the mean, exactly: the convolution is linear, so the image mean of output channel ``c`` is
  ``(sum over input channel i and tap (dy, dx) of W[c, i, dy, dx] * S_i(dy, dx)) / N + bias[c]`` where ``S_i(dy, dx)``
  is the sum of ``u_i`` over the pixels that tap reads (the whole image without the row / column that falls in
  the zero padding). Per band, each input row's sum over all columns, all but the first and all but the last column
  is kept (a row seen twice, as one band's halo and the next band's core, is simply written twice); the sums over
  rows follow, minus the first or last row where the tap misses it. No convolution is computed for it.
- the variance, from the convolution evaluated at every ``s``-th column only (``stride (1, s)`` from column
  ``s // 2``: ``1/s`` of its work), about the exact mean: ``M2_s / n_s + (mean_s - mean)^2`` per group, from the
  samples' own count, mean and ``M2`` (``stats.GroupStats``, Chan's merge). ``s = column_stride(...)`` keeps at least
  ``MIN_SAMPLES`` values per group (and 16 columns), at most ``MAX_STRIDE``: the small maps near the latent
  resolution, whose groups hold few values, keep every column (``s = 1``, their passes are cheap), the large maps,
  which hold nearly all of the statistics passes' work, are sampled. Columns rather than rows: a band spans the whole
  width, so the sampled columns are the same in every band and the rows keep the convolution's own halo algebra.

Measured on the kit's tiny VAEs (4-channel SD-like and 16-channel Z-Image-like, fp32 CPU, 37 x 45 latent, 128 px
bands): decode mean error 0.0010 / 0.0007 of the 0..1 range, encode 0.4-0.6% of the latents' mean magnitude (96 x 96
latents: 0.0014, 0.6-0.9%); every other column everywhere was 0.006 / 0.005 and 1.5-2.3% for about the same work,
and those samples without the exact mean 0.009 / 0.006. Tests: ``tests/vae/test_blend.py``,
``tests/vae/test_estimated_stats.py``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .stats import GroupStats

ESTIMATED_AFTER = ("conv1", "conv3")  # op kinds whose following GroupNorm ``blend`` estimates
MIN_SAMPLES = 16384  # sampled values per group at least (a column stride above 1 only where a group holds more)
MAX_STRIDE = 7  # at most every 7th column: the statistics pass keeps at least 1/7 of its convolution
MIN_COLUMNS = 16  # sampled columns at least


def column_stride(channels: int, groups: int, height: int, width: int) -> int:
    """The column stride ``s`` for a GroupNorm over a ``channels x height x width`` map in ``groups`` groups: the
    largest odd ``s <= MAX_STRIDE`` that leaves ``MIN_SAMPLES`` values per group and ``MIN_COLUMNS`` columns (1 if
    none does). Odd: the maps above the latent resolution come from nearest 2x upsamplings, so their columns are
    periodic in 2, 4 and 8 (even and odd columns have different statistics after the next convolution); an odd
    stride visits every phase equally often, an even one always the same phases (a biased variance: with strides
    up to 8 the kit's decode error grew from 0.002 to 0.007 as the image grew from 37x45 to 96x96 latents). The
    samples start at column ``s // 2`` and end before the last column: a border column, whose neighbour is the zero
    padding, would otherwise weigh ``s`` times its share (the encoder's smooth images, whose border columns stand
    out, paid most); left out, it misses only its ``1 / width`` share."""
    per_group = channels // groups * height * width
    s = max(1, min(MAX_STRIDE, per_group // MIN_SAMPLES, width // MIN_COLUMNS))
    return s if s % 2 else s - 1


class ColumnSampledConv:
    """Stands in for a ``conv1`` / ``conv3`` op (``program.Op``) in a statistics pass: the same rows (stride 1, the
    module's row padding, so the band algebra is unchanged), every ``stride``-th column from column ``stride // 2``
    (stride 1: every column; otherwise up to the second-to-last column, so no sampled column reads the padding), and
    the per-row column sums of its input that give the exact mean (module docstring). ``height`` / ``width``: the
    input map's size."""

    def __init__(self, op, height: int, width: int, stride: int):
        if op.kind not in ESTIMATED_AFTER:
            raise ValueError(f"ColumnSampledConv wraps a convolution op, got {op.kind!r}")
        if stride < 1 or (stride > 1 and width < stride // 2 + 2):
            raise ValueError(f"stride={stride}: expected 1, or a column stride that leaves a sampled column in a map "
                             f"of width {width}")
        self.op, self.kind, self.module = op, op.kind, op.module
        self.height, self.width, self.stride = height, width, stride
        self.offset = stride // 2  # sampled columns offset, offset + stride, ...: see ``column_stride``
        self.pad = int(op.module.padding[0]) if op.kind == "conv3" else 0
        # per input row [H, 3, C_in] fp64: the sum over all columns, all but the last, all but the first
        self.row_sums: Optional[torch.Tensor] = None

    def channels(self, c_in: int) -> int:
        return self.op.channels(c_in)

    def out_size(self, h: int) -> int:
        return h  # rows; the stage's width estimate stays the full width (an over-estimate of the band's memory)

    def need(self, a: int, b: int, h_in: int) -> tuple[int, int]:
        return self.op.need(a, b, h_in)

    def forward(self, x: torch.Tensor, lo: int, h_in: int, norm=None) -> tuple[torch.Tensor, int]:
        if x.shape[3] != self.width or h_in != self.height:
            raise RuntimeError(f"tiling bug: column-sampled convolution planned for {self.height}x{self.width}, "
                               f"got rows of width {x.shape[3]} from a map of height {h_in}")
        acc = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        whole = x.sum(dim=3, dtype=acc)[0]  # [C, n]
        sums = torch.stack((whole - x[0, :, :, -1], whole, whole - x[0, :, :, 0]), dim=0)  # dx = -1, 0, +1
        if self.row_sums is None:
            self.row_sums = torch.zeros(self.height, 3, x.shape[1], dtype=torch.float64, device=x.device)
        self.row_sums[lo:lo + x.shape[2]] = sums.permute(2, 0, 1).double()
        m = self.module
        weight = m.weight.detach().to(x.device, x.dtype)
        bias = None if m.bias is None else m.bias.detach().to(x.device, x.dtype)
        if self.offset == 0:  # every column: the module's own convolution
            return F.conv2d(x, weight, bias, padding=(self.pad, self.pad)), lo
        # columns offset, offset + stride, ... whose right neighbour is real (a view: no padded copy)
        return F.conv2d(x[..., self.offset - self.pad:], weight, bias, stride=(1, self.stride),
                        padding=(self.pad, 0)), lo

    def output_means(self) -> torch.Tensor:
        """Exact per-channel image means of the convolution's output ([C_out] fp64), from the row sums."""
        if self.row_sums is None:
            raise RuntimeError("tiling bug: the column-sampled convolution saw no band")
        total = self.row_sums.sum(dim=0)  # [3, C_in]: over all rows, per dx
        first, last = self.row_sums[0], self.row_sums[-1]
        m = self.module
        weight = m.weight.detach().to(total.device, torch.float64)  # [C_out, C_in, k, k]
        if self.pad == 0:
            reads = total[1][:, None, None]  # a 1x1 convolution reads every pixel once
        else:
            # [dy, dx, C_in]: the tap one row up (dy = -1) never reads the last row, one row down the first
            rows = torch.stack((total - last, total, total - first), dim=0)
            reads = rows.permute(2, 0, 1)  # [C_in, dy, dx]
        n = float(self.height * self.width)
        means = torch.einsum("oiyx,iyx->o", weight, reads) / n
        if m.bias is not None:
            means = means + m.bias.detach().to(total.device, torch.float64)
        return means

    def estimate(self, samples: GroupStats) -> GroupStats:
        """Whole-image statistics for the GroupNorm after this convolution: exact group means, variances of the
        column samples about them (module docstring). ``samples``: the sampled outputs' statistics."""
        if samples.mean is None:
            raise RuntimeError("tiling bug: no sampled column reached the statistics")
        groups = samples.groups
        means = self.output_means().to(samples.mean.device).view(groups, -1).mean(dim=1)
        variance = samples.variance() + (samples.mean - means) ** 2
        count = float(self.height * self.width * self.op.channels(0) // groups)
        return GroupStats(groups, count=count, mean=means, m2=variance * count)

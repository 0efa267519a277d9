"""Whole-image GroupNorm statistics gathered from tiles, and GroupNorm applied with given statistics.

Invariant: ``GroupStats`` over a set of disjoint tiles that cover an image equals the statistics one
``GroupNorm`` computes over the whole image (per group: the mean and the biased variance of every element of the
group's channels at every pixel), up to floating-point error.

Math (Chan, Golub and LeVeque 1979, "Updating formulae and a pairwise algorithm for computing sample variances"):
each tile contributes per channel its count ``n``, mean ``m`` and sum of squared deviations ``M2``, computed in
fp32 by ``torch.var_mean`` (accurate one-tile pass). Channels of a group are merged, then tiles are merged, in
fp64 with
    n = na + nb,  d = mb - ma,  m = ma + d * nb / n,  M2 = M2a + M2b + d^2 * na * nb / n,
which, unlike accumulating ``sum`` and ``sum of squares``, does not cancel catastrophically when a group's mean is
large against its spread. The group variance is ``M2 / n``.

``apply_group_norm`` normalises with those statistics: ``(x - mean) / sqrt(var + eps) * weight + bias`` is exactly
inference-mode batch normalisation with per-channel running statistics, so it runs as one fused
``F.batch_norm`` kernel (any memory format, fp16/bf16 input with fp32 statistics) instead of four element-wise
passes. No library exposes GroupNorm with external statistics, hence this module.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F


# Elements per ``torch.var_mean`` call in ``GroupStats.add(x, chunked=True)``: on CUDA the call on a channels-last
# band allocates ~20 bytes per element at 512 channels (its fp32 copy and the reduction's temporaries: 0.64 GiB for
# a 2048 px fp16 band of the SD VAE's 1/8 map), more than the band itself, and about as much viewed as a [pixels, C]
# matrix; chunked, larger bands are reduced in row chunks of at most this many elements and merged (the invariant
# above). The attention stage and the stage feeding it ask for it (their bands span the whole 1/8 map); the other
# convolution stages, whose budget share (exact.CUDA_WORK_SHARE) is calibrated with one call per band, do not:
# chunking every band of the decoder's large levels slows a 2048 px fp16 decode by about a fifth.
STATS_CHUNK_ELEMENTS = 2 ** 22


def stats_transient_bytes(elements: int) -> int:
    """Device bytes ``GroupStats.add(x, chunked=True)`` allocates at once for a band of ``elements`` elements."""
    return 20 * min(elements, STATS_CHUNK_ELEMENTS)


@dataclass
class GroupStats:
    """Running per-group count, mean and M2 for one GroupNorm of one image (tensors live on the compute device)."""

    groups: int
    count: float = 0.0
    mean: Optional[torch.Tensor] = None  # [G] fp64
    m2: Optional[torch.Tensor] = None  # [G] fp64

    def add(self, x: torch.Tensor, chunked: bool = False) -> None:
        """Merge the elements of ``x`` ([1, C, h, w], any memory format) into the statistics; ``chunked``: in row
        chunks of at most ``STATS_CHUNK_ELEMENTS`` (bounded temporaries, see there)."""
        if x.shape[0] != 1:
            raise ValueError(f"GroupStats.add expects one image ([1, C, h, w]), got shape {tuple(x.shape)}")
        channels = x.shape[1]
        if channels % self.groups:
            raise ValueError(f"{channels} channels do not split into {self.groups} groups")
        n_c = x.shape[2] * x.shape[3]
        if n_c == 0:
            return
        rows = max(1, STATS_CHUNK_ELEMENTS // (channels * x.shape[3]))
        if chunked and x.shape[2] > rows:
            for a in range(0, x.shape[2], rows):
                self.add(x[:, :, a:a + rows])
            return
        var_c, mean_c = torch.var_mean(x.float(), dim=(0, 2, 3), correction=0)
        mean_c = mean_c.double().view(self.groups, -1)
        m2_c = var_c.double().view(self.groups, -1) * n_c
        per = mean_c.shape[1]
        mean_t = mean_c.mean(dim=1)
        m2_t = m2_c.sum(dim=1) + n_c * ((mean_c - mean_t[:, None]) ** 2).sum(dim=1)
        n_t = float(n_c * per)
        if self.mean is None:
            self.count, self.mean, self.m2 = n_t, mean_t, m2_t
            return
        n = self.count + n_t
        delta = mean_t - self.mean
        self.mean = self.mean + delta * (n_t / n)
        self.m2 = self.m2 + m2_t + delta * delta * (self.count * n_t / n)
        self.count = n

    def variance(self) -> torch.Tensor:
        if self.mean is None:
            raise RuntimeError("GroupStats has no data: no tile was added before the statistics were used")
        return self.m2 / self.count


def apply_group_norm(x: torch.Tensor, stats: GroupStats, weight: Optional[torch.Tensor],
                     bias: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """GroupNorm of ``x`` ([1, C, h, w]) with the given whole-image statistics (see the module docstring)."""
    channels = x.shape[1]
    per = channels // stats.groups
    low = x.dtype in (torch.float16, torch.bfloat16)
    sdtype = torch.float32 if low else x.dtype
    mean = stats.mean.repeat_interleave(per).to(sdtype)
    var = stats.variance().repeat_interleave(per).to(sdtype)
    w = None if weight is None else weight.detach().to(x.device, sdtype)
    b = None if bias is None else bias.detach().to(x.device, sdtype)
    return F.batch_norm(x, mean, var, w, b, False, 0.0, eps)

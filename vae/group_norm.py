"""GroupNorm with grid-wide statistics for wide activations, swapped into a VAE for the length of one call.

Why this exists: PyTorch's CUDA GroupNorm reduces each (sample, group) row of the input in a single thread block. A VAE
decode has few rows and very long ones (at 1024 px: 32 groups of 4 M elements per image, i.e. 32 blocks on a GPU of 100+
SMs), so that moments kernel takes over a third of an SDXL fp32 decode. ``torch.var_mean`` over the spatial dims splits
a long reduction across many blocks (per channel, in NCHW or channels-last), the channels of each group are merged
exactly, and the normalisation is one inference-mode ``F.batch_norm`` with per-(sample, channel) statistics -- the same
one-kernel ``(x - mean) / sqrt(var + eps) * weight + bias`` that ``stats.apply_group_norm`` uses for tiled decoding --
in the input's own layout. An SDXL fp32 1024 px decode takes about 30% less time, an SD1.5 fp16 512 px one about a third
less. No library offers a GroupNorm that parallelises this way (diffusers and ComfyUI call ``F.group_norm``), hence this
module.

Invariants
- ``parallel_stats_group_norm(x, ...)`` equals ``F.group_norm(x, ...)`` up to floating-point rounding: the same
  biased statistics (per-channel passes, channel means and variances kept in fp32 at least, merged exactly), the
  group mean rounded to the dtype PyTorch's own kernel stores it in (the input's), the variance kept in fp32
  (PyTorch stores ``rstd``, which a half dtype holds for any variance; a half *variance* overflows above a spread
  of 256 and loses its digits below ~0.01), normalised in fp32 for fp16/bf16 inputs; the output keeps the input's
  layout.
- ``ParallelStatsGroupNorm`` only overrides ``forward``: parameters, buffers, ``state_dict`` and ``isinstance(m,
  nn.GroupNorm)`` are unchanged. It takes the parallel path only where it pays (CUDA, a layout it reads without a
  copy, at least ``MIN_GROUP_ELEMENTS`` elements per group); everywhere else it is ``nn.GroupNorm.forward`` itself,
  except that a channels-last CPU input is normalised as an NCHW copy (``cpu_layout_safe``): PyTorch's CPU kernel for
  that layout loses the variance to cancellation when a group's mean is large against its spread (torch 2.13, fp32:
  1.7e-3 off at mean 0.5 and spread 0.05, 3.0 off at mean 0.7 and spread 1e-3; the NCHW kernel is within 1e-4 of
  fp64 there). It put the untiled CPU encode of the test kit's tiny VAE 2.5e-5 (a colour gradient) to 1.1 (a flat
  colour) away from an fp64 encode when the IMAGE came as a channels-last view; the exact tiled encode, 1e-5.
- ``parallel_group_norms(module)`` swaps exactly the modules whose type is ``nn.GroupNorm`` and restores every one
  of them when the block ends, also on error or interruption; nothing outside the block sees the swap (the
  independent references -- diffusers' own decode -- run unpatched).
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

# Below this many elements per (sample, group) row the native kernel's one block per row costs no more than the
# parallel path's extra small launches (~8 per GroupNorm). Of the thresholds 64 K / 256 K / 1 M / 2 M, 256 K is the
# fastest decode at SDXL fp32 1024 px and SD1.5 fp16 512 / 1024 px alike (at 64 K an SD1.5 512 px decode's 64x64
# level only adds launches; above 256 K the large levels of every decode lose part of the gain).
MIN_GROUP_ELEMENTS = 1 << 18
# Slabs of a channels-last image's two-level statistics (``channel_var_mean``); the slab count divides H*W.
CHANNELS_LAST_SPLITS = 256


def layout_supported(x: torch.Tensor) -> bool:
    """Layouts the parallel path handles without a copy: contiguous ``[N, C, *]``, or one channels-last image.

    Diffusers' VAE attention hands its output back as a channels-last view, so every block after the mid block
    runs channels-last (convolutions keep the layout); PyTorch's CUDA GroupNorm copies such inputs to NCHW first.
    """
    if x.dim() < 3 or x.shape[0] == 0:
        return False
    one_channels_last_image = x.dim() == 4 and x.shape[0] == 1 and x.is_contiguous(memory_format=torch.channels_last)
    return x.is_contiguous() or one_channels_last_image


def parallel_stats_group_norm(x: torch.Tensor, groups: int, weight: Optional[torch.Tensor],
                              bias: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """``F.group_norm(x, groups, weight, bias, eps)`` with grid-wide statistics (see the module docstring).

    Per (sample, channel): ``torch.var_mean`` over the spatial dims (long reductions split across blocks in either
    layout); the channels of a group are merged exactly (equal counts: the group mean is the mean of the channel
    means, the group variance the mean of the channel variances plus the variance of the channel means) in fp32 at
    least; the group mean is then rounded to ``x``'s dtype as PyTorch's kernel stores it, the variance stays in
    fp32 (module docstring). Output in ``x``'s layout.
    """
    n, c = x.shape[0], x.shape[1]
    if c % groups:
        raise ValueError(f"{c} channels do not split into {groups} groups")
    if not layout_supported(x):
        raise ValueError(f"parallel GroupNorm: unsupported layout (shape {tuple(x.shape)}, strides {x.stride()}); "
                         f"expected a contiguous tensor or one channels-last image")
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    var_c, mean_c = channel_var_mean(x, acc)  # [N, C]
    spread, mean_g = torch.var_mean(mean_c.view(n, groups, -1), dim=2, correction=0)  # [N, G], in acc
    var_g = var_c.view(n, groups, -1).mean(dim=2) + spread
    # PyTorch's kernel keeps the mean (and rstd) in x's dtype when the affine parameters share it (mixed ones never
    # come here, see ``takes_parallel_path``); normalisation runs in fp32 for fp16/bf16 inputs.
    apply_dtype = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    per = c // groups

    def per_channel(stat: torch.Tensor) -> torch.Tensor:
        return stat.to(apply_dtype).reshape(n * groups).repeat_interleave(per)

    def affine(p: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if p is None else (p.detach().to(apply_dtype) if n == 1 else p.detach().to(apply_dtype).repeat(n))

    # inference-mode batch norm with per-(sample, channel) statistics: one fused kernel in x's own layout
    src = x if n == 1 else x.view(1, n * c, -1)
    return F.batch_norm(src, per_channel(mean_g.to(x.dtype)), per_channel(var_g), affine(weight), affine(bias),
                        False, 0.0, eps).view(x.shape)


def channel_var_mean(x: torch.Tensor, acc: torch.dtype) -> tuple:
    """Biased per-(sample, channel) variance and mean of ``x`` [N, C, *] over its spatial dims as ``[N, C]`` in ``acc``.

    Contiguous inputs: one ``torch.var_mean`` (PyTorch splits long rows across blocks). A channels-last image is
    reduced in two levels, because PyTorch's kernel for a spatial reduction of that layout is ~3x slower than the
    NCHW one (over all GroupNorms of an SDXL fp32 1024 px decode): its ``[H*W, C]`` rows are split
    into ``CHANNELS_LAST_SPLITS`` equal slabs, each slab is reduced over its rows (a coalesced reduction along the
    channel-minor layout), and the slabs are merged exactly in ``acc`` (equal counts: the mean of the slab means;
    the mean of the slab variances plus the variance of the slab means).
    """
    spatial = x[0, 0].numel()
    splits = math.gcd(spatial, CHANNELS_LAST_SPLITS)
    if x.is_contiguous() or splits < 2:
        return var_and_wide_mean(x, tuple(range(2, x.dim())), acc)
    slabs = x.permute(0, 2, 3, 1).reshape(splits, spatial // splits, x.shape[1])  # a view: one channels-last image
    var_s, mean_s = var_and_wide_mean(slabs, (1,), acc)  # [splits, C]
    spread, mean_c = torch.var_mean(mean_s, dim=0, correction=0)
    return (var_s.mean(dim=0) + spread).unsqueeze(0), mean_c.unsqueeze(0)


def var_and_wide_mean(x: torch.Tensor, dims: tuple, acc: torch.dtype) -> tuple:
    """Biased variance and mean of ``x`` over ``dims``, both in ``acc``, without copying ``x``.

    ``torch.var_mean`` returns both in ``x``'s dtype. A half mean is off by up to half a unit in its last place *of
    the mean*, and the merge above turns that into an error in the spread term: 0.08 in a normalised output whose
    channel means sit near 100. So a narrower ``x`` takes a second pass for a mean accumulated and returned in
    ``acc`` (2-3% of an fp16 decode); fp32 inputs take one pass. Its variance comes as a standard deviation (the same
    fp32 Welford pass, square-rooted before the cast), squared in ``acc``: an fp16 variance overflowed to inf above a
    spread of 256 (the group then normalised to its bias: 5.1 off) and went subnormal below ~0.008 (0.03 off at a
    spread of 0.001), where PyTorch, which stores ``rstd``, is exact to rounding.
    """
    if x.dtype == acc:
        return torch.var_mean(x, dim=dims, correction=0)
    return torch.std(x, dim=dims, correction=0).to(acc).square(), torch.mean(x, dim=dims, dtype=acc)


def takes_parallel_path(x: torch.Tensor, groups: int, weight: Optional[torch.Tensor] = None) -> bool:
    """Whether ``ParallelStatsGroupNorm`` reduces ``x`` grid-wide: CUDA, a supported layout, long rows, and affine
    parameters (if any) in ``x``'s dtype (with wider ones PyTorch keeps fp32 statistics; that case stays native)."""
    if not x.is_cuda or not layout_supported(x) or x.shape[1] % groups:
        return False
    if weight is not None and weight.dtype != x.dtype:
        return False
    return x.numel() // (x.shape[0] * groups) >= MIN_GROUP_ELEMENTS


def cpu_layout_safe(x: torch.Tensor) -> torch.Tensor:
    """``x`` as PyTorch's CPU GroupNorm normalises it accurately: a non-contiguous (e.g. channels-last) CPU tensor
    as a contiguous NCHW copy, anything else unchanged (module docstring: the CPU channels-last kernel cancels)."""
    return x.contiguous() if x.device.type == "cpu" and not x.is_contiguous() else x


class ParallelStatsGroupNorm(torch.nn.GroupNorm):
    """``nn.GroupNorm`` whose forward reduces long rows grid-wide; identical state (see the module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not takes_parallel_path(x, self.num_groups, self.weight):
            return super().forward(cpu_layout_safe(x))
        return parallel_stats_group_norm(x, self.num_groups, self.weight, self.bias, self.eps)


@contextlib.contextmanager
def parallel_group_norms(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Inside the block every plain ``nn.GroupNorm`` of ``module`` runs as ``ParallelStatsGroupNorm``."""
    swapped = [m for m in module.modules() if type(m) is torch.nn.GroupNorm]
    try:
        for m in swapped:
            m.__class__ = ParallelStatsGroupNorm
        yield module
    finally:
        for m in swapped:
            m.__class__ = torch.nn.GroupNorm

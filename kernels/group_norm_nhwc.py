"""GroupNorm on channels-last (NHWC) tensors, optionally after a per-channel add and followed by SiLU: the same
arithmetic as ``kernels.group_norm`` for inputs whose channels are the innermost dimension.

Math: as ``kernels.group_norm`` (its module docstring: the add rounded into ``x``'s dtype, biased moments in fp32,
``mean`` and ``rstd`` rounded to the half dtype as PyTorch stores them unless the parameters are fp32, ``y =
round(x * a + b)``, SiLU on the rounded value). Here ``x`` [N, C, H, W] is stored as [N, S = H*W, C], so a
(sample, group) row is ``S`` runs of ``C/G`` adjacent channels, not one contiguous run.

Three launches: (1) per (sample, spatial tile, channel block) each channel's tile mean and centred sum of squares
(blocks of [BLOCK_S, BLOCK_C], loads along the contiguous channel axis; a Welford update per (row lane, channel)
across the tile's blocks, the lanes merged once by Chan's formula: no cross-thread reduction inside the loop);
(2) per (sample, group) the exact merge of its channels' tile statistics into ``mean`` and ``rstd``; (3) per
(sample, spatial tile, channel block) the normalise pass.

Why hand-written: a channels-last UNet lets cuDNN run its convolutions without transposing activations to NHWC and
back (``memory.unet_layout``); PyTorch's own channels-last GroupNorm costs more than the transposes saved (an SDXL
1024 px step on an H200: 40.1 ms with it, 35.8 ms NCHW with ``kernels.group_norm``), and diffusers and ComfyUI ship
none.
"""
# No ``from __future__ import annotations``: see kernels/geglu_lora.py (the interpreter reads constexpr annotations).
import functools
from typing import Optional

import torch

try:  # Triton is optional: ``kernels.group_norm`` only calls this module when it imports
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

BLOCK_S = 64  # spatial positions per block
BLOCK_C = 64  # channels per block (SD UNets have 320, 640 or 1280: no masked lanes)
MAX_TILES = 64  # spatial tiles per sample: a larger image gives each program several blocks
STATS_BLOCK = 1024  # (tile, channel) statistics merged per vector step of the group pass


if triton is not None:

    @triton.jit
    def _nhwc_moments_kernel(x_ptr, add_ptr, mean_ptr, m2_ptr, S, C, tiles, HAS_ADD: tl.constexpr,
                             BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, ITERS: tl.constexpr):
        n, tile, cb = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
        cols = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cols < C
        if HAS_ADD:
            extra = tl.load(add_ptr + n * C + cols, mask=cmask, other=0.0).to(tl.float32)
        # Welford per (row lane, channel) over the tile's blocks: no reduction inside the loop
        seen = tl.zeros([BLOCK_S, 1], tl.float32)
        mean = tl.zeros([BLOCK_S, BLOCK_C], tl.float32)
        m2 = tl.zeros([BLOCK_S, BLOCK_C], tl.float32)
        for i in range(ITERS):
            rows = (tile * ITERS + i) * BLOCK_S + tl.arange(0, BLOCK_S)
            valid = (rows < S)[:, None]
            mask = valid & cmask[None, :]
            x = tl.load(x_ptr + n * S * C + rows[:, None] * C + cols[None, :], mask=mask, other=0.0)
            if HAS_ADD:  # rounded into x's dtype as a separate add would be
                x = (x.to(tl.float32) + extra[None, :]).to(x.dtype)
            x = x.to(tl.float32)
            seen += valid.to(tl.float32)
            delta = x - mean
            mean += tl.where(valid, delta / tl.maximum(seen, 1.0), 0.0)
            m2 += tl.where(valid, delta * (x - mean), 0.0)
        # the lanes merged by Chan's formula: the tile's per-channel mean and centred sum of squares
        total = tl.maximum(tl.sum(seen, axis=0), 1.0)  # [1]
        tile_mean = tl.sum(seen * mean, axis=0) / total
        d = mean - tile_mean[None, :]
        tile_m2 = tl.sum(m2 + seen * d * d, axis=0)
        out = (n * tiles + tile) * C + cols
        tl.store(mean_ptr + out, tile_mean, mask=cmask)
        tl.store(m2_ptr + out, tile_m2, mask=cmask)

    @triton.jit
    def _nhwc_group_stats_kernel(mean_ptr, m2_ptr, stats_ptr, S, C, G, tiles, span, eps,
                                 ROUND_HALF: tl.constexpr, ROUND_BF16: tl.constexpr, BLOCK: tl.constexpr,
                                 CHUNKS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # n * G + g
        n, g = row // G, row % G
        per_group = C // G
        entries = tiles * per_group
        base = n * tiles * C + g * per_group
        length = S * per_group * 1.0
        total = 0.0
        for i in range(CHUNKS):  # the group mean: each (tile, channel) mean weighted by its count
            k = i * BLOCK + tl.arange(0, BLOCK)
            valid = k < entries
            t, j = k // per_group, k % per_group
            count = tl.where(valid, tl.minimum(S - t * span, span), 0).to(tl.float32)
            total += tl.sum(tl.load(mean_ptr + base + t * C + j, mask=valid, other=0.0) * count, axis=0)
        mean = total / length
        m2 = 0.0
        for i in range(CHUNKS):  # Chan's merge: each entry's centred sum plus its count times its squared offset
            k = i * BLOCK + tl.arange(0, BLOCK)
            valid = k < entries
            t, j = k // per_group, k % per_group
            count = tl.where(valid, tl.minimum(S - t * span, span), 0).to(tl.float32)
            d = tl.load(mean_ptr + base + t * C + j, mask=valid, other=0.0) - mean
            m2 += tl.sum(tl.where(valid, tl.load(m2_ptr + base + t * C + j, mask=valid, other=0.0)
                                  + count * d * d, 0.0), axis=0)
        rstd = 1.0 / tl.sqrt(tl.maximum(m2 / length, 0.0) + eps)
        if ROUND_HALF:  # PyTorch stores the statistics in the input's dtype (kernels.group_norm)
            mean = mean.to(tl.float16).to(tl.float32)
            rstd = rstd.to(tl.float16).to(tl.float32)
        if ROUND_BF16:
            mean = mean.to(tl.bfloat16).to(tl.float32)
            rstd = rstd.to(tl.bfloat16).to(tl.float32)
        tl.store(stats_ptr + 2 * row, mean)
        tl.store(stats_ptr + 2 * row + 1, rstd)

    @triton.jit
    def _nhwc_apply_kernel(x_ptr, add_ptr, y_ptr, w_ptr, b_ptr, stats_ptr, S, C, G, HAS_ADD: tl.constexpr,
                           HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                           BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, ITERS: tl.constexpr):
        n, tile, cb = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
        cols = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cols < C
        group = n * G + cols // (C // G)
        mean = tl.load(stats_ptr + 2 * group, mask=cmask, other=0.0)
        a = tl.load(stats_ptr + 2 * group + 1, mask=cmask, other=0.0)
        if HAS_WEIGHT:
            a = a * tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        shift = -a * mean
        if HAS_BIAS:
            shift += tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        if HAS_ADD:
            extra = tl.load(add_ptr + n * C + cols, mask=cmask, other=0.0).to(tl.float32)
        for i in range(ITERS):
            rows = (tile * ITERS + i) * BLOCK_S + tl.arange(0, BLOCK_S)
            mask = (rows < S)[:, None] & cmask[None, :]
            offs = n * S * C + rows[:, None] * C + cols[None, :]
            x = tl.load(x_ptr + offs, mask=mask, other=0.0)
            if HAS_ADD:
                x = (x.to(tl.float32) + extra[None, :]).to(x.dtype)
            y = (x.to(tl.float32) * a[None, :] + shift[None, :]).to(x.dtype)
            if SILU:  # F.silu on the rounded normalised value, computed in fp32 and rounded once
                yf = y.to(tl.float32)
                y = (yf / (1.0 + tl.exp(-yf))).to(x.dtype)
            tl.store(y_ptr + offs, y, mask=mask)


@functools.lru_cache(maxsize=512)
def _launch_shape(shape: tuple, groups: int) -> tuple:
    """(S, tiles, blocks per tile, channel blocks, statistic chunks) for an [N, C, H, W] ``shape``."""
    spatial = shape[2] * shape[3]
    blocks = triton.cdiv(spatial, BLOCK_S)
    iters = triton.next_power_of_2(triton.cdiv(blocks, MAX_TILES))
    tiles = triton.cdiv(blocks, iters)
    chunks = triton.next_power_of_2(triton.cdiv(tiles * (shape[1] // groups), STATS_BLOCK))
    return spatial, tiles, iters, triton.cdiv(shape[1], BLOCK_C), chunks


def launch_channels_last(x: torch.Tensor, groups: int, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                         eps: float, add: Optional[torch.Tensor], silu: bool, round_stats: Optional[torch.dtype]
                         ) -> torch.Tensor:
    """The three launches on checked arguments: ``x`` a non-empty 4-D channels-last tensor, ``add`` contiguous
    [N, C] in ``x``'s dtype, ``round_stats`` the half dtype ``mean`` and ``rstd`` are rounded to (or None).
    The result is channels-last like ``x``."""
    n, c = x.shape[:2]
    spatial, tiles, iters, channel_blocks, chunks = _launch_shape(tuple(x.shape), groups)
    y = torch.empty_like(x, memory_format=torch.channels_last)
    partial = torch.empty(2, n, tiles, c, dtype=torch.float32, device=x.device)
    stats = torch.empty(n * groups, 2, dtype=torch.float32, device=x.device)
    add_arg = x if add is None else add
    grid = (n, tiles, channel_blocks)
    _nhwc_moments_kernel[grid](x, add_arg, partial[0], partial[1], spatial, c, tiles, HAS_ADD=add is not None,
                               BLOCK_S=BLOCK_S, BLOCK_C=BLOCK_C, ITERS=iters, num_warps=8)
    _nhwc_group_stats_kernel[(n * groups,)](partial[0], partial[1], stats, spatial, c, groups, tiles,
                                            BLOCK_S * iters, eps, ROUND_HALF=round_stats == torch.float16,
                                            ROUND_BF16=round_stats == torch.bfloat16, BLOCK=STATS_BLOCK,
                                            CHUNKS=chunks, num_warps=4)
    _nhwc_apply_kernel[grid](x, add_arg, y, x if weight is None else weight, x if bias is None else bias, stats,
                             spatial, c, groups, HAS_ADD=add is not None, HAS_WEIGHT=weight is not None,
                             HAS_BIAS=bias is not None, SILU=silu, BLOCK_S=BLOCK_S, BLOCK_C=BLOCK_C, ITERS=iters,
                             num_warps=8)
    return y

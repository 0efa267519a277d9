"""GroupNorm (optionally after a per-channel add, optionally followed by SiLU) in two launches: tile statistics,
then one fused pass that merges them and normalises.

Math (``x`` [N, C, *]; row ``(n, g)`` is the ``C/G`` channels of group ``g`` of sample ``n``, ``L = C/G * spatial``
elements, one contiguous run for a contiguous ``x``; ``add`` [N, C] optional):

    x' = round(x + add[n, c])                               (diffusers' ``hidden_states + temb``)
    mean, var = biased moments of row (n, g) of x' (fp32);  rstd = 1 / sqrt(var + eps)
    y = round(x' * a + b),  a = rstd * weight[c],  b = bias[c] - a * mean   (``F.group_norm``)
    y = round(silu(y))                                      (when ``silu``)

with PyTorch's rounding points: for a half-precision ``x`` whose affine parameters share its dtype (or are absent)
PyTorch stores ``mean`` and ``rstd`` in ``x``'s dtype before forming ``a`` and ``b`` in fp32, and so does the
kernel; with fp32 parameters (mixed) both stay fp32. The moments differ from PyTorch's Welford pass only in fp32
summation order, so the output matches the plain ops to an ulp or two of the output dtype (not bitwise).

Why hand-written: PyTorch's CUDA GroupNorm reduces each row in one thread block (64 blocks for a batch-2 SDXL UNet
GroupNorm, on a GPU of 132 SMs) and applies the affine through a generic broadcasting kernel, and diffusers runs the
add and SiLU as passes of their own: 4.1 ms of GroupNorm alone in an SDXL 1024 px UNet step of 38 ms on an H200,
0.75 ms here. Each tile of a row (at most ``MAX_TILES`` per row) is reduced by its own program (each 4096-element
block's mean and centred sum of squares in registers, merged by Chan's formula: no cancellation); the apply
programs merge their row's tiles the same way and write the result in one pass. Neither diffusers nor ComfyUI ship
a faster GroupNorm (both call ``F.group_norm``); ``vae.group_norm`` handles the VAE's few and very long rows with
torch ops. A 4-D channels-last ``x`` takes ``group_norm_nhwc``'s kernels (same arithmetic, channel-major blocks).

Three implementations with one signature ``(x, groups, weight, bias, eps, add=None, silu=False)``:
``group_norm_triton`` (the kernels), ``group_norm_reference`` (plain torch: diffusers' ops) and ``group_norm``
(dispatcher: the kernels for contiguous or channels-last CUDA inputs with everything on one device and ``add`` in
``x``'s dtype, when Triton runs there and ``torch.compile`` is not tracing -- inductor fuses the reference itself --
the reference elsewhere; ``LEANDIFFUSION_GROUP_NORM`` = ``reference`` | ``triton`` | ``auto`` overrides, and
``impl=`` overrides both). Nothing reads a device value on the host, so every path is CUDA-graph capturable.
"""
# No ``from __future__ import annotations``: see kernels/geglu_lora.py (the Triton 3.0-3.2 interpreter reads a
# ``tl.constexpr`` parameter's annotation evaluated).
import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F

from . import dispatch, group_norm_nhwc

IMPL = dispatch.KernelChoice("LEANDIFFUSION_GROUP_NORM")
BLOCK = 4096  # elements per vector step of a program
MAX_TILES = 64  # tiles per row: a longer row gives each program several blocks (its tile spans ``iters`` blocks)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_ROW = 2 ** 31 - 1  # elements per (sample, group) row: the kernels index within a row in int32

try:  # Triton is optional: without it every call takes the reference path
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None


if triton is not None:

    @triton.jit
    def _tile_moments_kernel(x_ptr, add_ptr, mean_ptr, m2_ptr, L, tiles, spatial, per_group,
                             HAS_ADD: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        row, tile = tl.program_id(0).to(tl.int64), tl.program_id(1)
        seen, mean, m2 = 0.0, 0.0, 0.0
        for i in range(ITERS):  # each block's mean and centred sum of squares, merged by Chan's formula
            start = tile * (BLOCK * ITERS) + i * BLOCK
            offs = start + tl.arange(0, BLOCK)
            mask = offs < L
            x = tl.load(x_ptr + row * L + offs, mask=mask, other=0.0)
            if HAS_ADD:  # the per-(sample, channel) addend, rounded into x's dtype as a separate add would be
                extra = tl.load(add_ptr + row * per_group + offs // spatial, mask=mask, other=0.0)
                x = (x.to(tl.float32) + extra.to(tl.float32)).to(x.dtype)
            x = x.to(tl.float32)
            count = tl.minimum(tl.maximum(L - start, 0), BLOCK).to(tl.float32)
            block_mean = tl.sum(x, axis=0) / tl.maximum(count, 1.0)
            centred = tl.where(mask, x - block_mean, 0.0)
            total = seen + count
            delta = block_mean - mean
            mean += delta * count / tl.maximum(total, 1.0)
            m2 += tl.sum(centred * centred, axis=0) + delta * delta * seen * count / tl.maximum(total, 1.0)
            seen = total
        tl.store(mean_ptr + row * tiles + tile, mean)
        tl.store(m2_ptr + row * tiles + tile, m2)

    @triton.jit
    def _apply_kernel(x_ptr, add_ptr, y_ptr, w_ptr, b_ptr, mean_ptr, m2_ptr, L, tiles, spatial, per_group, C, eps,
                      HAS_ADD: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                      ROUND_HALF: tl.constexpr, ROUND_BF16: tl.constexpr, BLOCK: tl.constexpr,
                      ITERS: tl.constexpr, TILES: tl.constexpr):
        row, tile = tl.program_id(0).to(tl.int64), tl.program_id(1)
        # the row's statistics: its tiles merged exactly (equal spans but the last)
        t = tl.arange(0, TILES)
        valid = t < tiles
        span = BLOCK * ITERS
        count = tl.where(valid, tl.minimum(L - t * span, span), 0).to(tl.float32)
        means = tl.load(mean_ptr + row * tiles + t, mask=valid, other=0.0)
        mean = tl.sum(means * count, axis=0) / L
        d = means - mean
        m2 = tl.sum(tl.where(valid, tl.load(m2_ptr + row * tiles + t, mask=valid, other=0.0) + count * d * d, 0.0),
                    axis=0)
        rstd = 1.0 / tl.sqrt(tl.maximum(m2 / L, 0.0) + eps)
        if ROUND_HALF:  # PyTorch stores the statistics in the input's dtype (module docstring)
            mean = mean.to(tl.float16).to(tl.float32)
            rstd = rstd.to(tl.float16).to(tl.float32)
        if ROUND_BF16:
            mean = mean.to(tl.bfloat16).to(tl.float32)
            rstd = rstd.to(tl.bfloat16).to(tl.float32)
        for i in range(ITERS):
            offs = tile * span + i * BLOCK + tl.arange(0, BLOCK)
            mask = offs < L
            channel = (row * per_group) % C + offs // spatial
            a = tl.full([BLOCK], 1.0, tl.float32) * rstd
            if HAS_WEIGHT:
                a = a * tl.load(w_ptr + channel, mask=mask, other=0.0).to(tl.float32)
            shift = -a * mean
            if HAS_BIAS:
                shift += tl.load(b_ptr + channel, mask=mask, other=0.0).to(tl.float32)
            x = tl.load(x_ptr + row * L + offs, mask=mask, other=0.0)
            if HAS_ADD:
                extra = tl.load(add_ptr + row * per_group + offs // spatial, mask=mask, other=0.0)
                x = (x.to(tl.float32) + extra.to(tl.float32)).to(x.dtype)
            y = (x.to(tl.float32) * a + shift).to(x.dtype)
            if SILU:  # F.silu on the rounded normalised value, computed in fp32 and rounded once
                yf = y.to(tl.float32)
                y = (yf / (1.0 + tl.exp(-yf))).to(x.dtype)
            tl.store(y_ptr + row * L + offs, y, mask=mask)


@functools.lru_cache(maxsize=512)
def _launch_shape(shape: tuple, groups: int) -> tuple:
    """(rows, L, spatial, channels per group, tiles, blocks per tile, padded tile count) for ``shape``."""
    rows = shape[0] * groups
    spatial = math.prod(shape[2:])
    L = shape[1] // groups * spatial
    iters = triton.next_power_of_2(triton.cdiv(L, BLOCK * MAX_TILES))
    tiles = triton.cdiv(L, BLOCK * iters)
    return rows, L, spatial, shape[1] // groups, tiles, iters, triton.next_power_of_2(tiles)


def _stats_rounding(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor]):
    """The half dtype PyTorch stores ``mean`` and ``rstd`` in (``x``'s, unless the parameters are fp32), or None."""
    mixed = (weight is not None and weight.dtype != x.dtype) or (bias is not None and bias.dtype != x.dtype)
    return None if mixed or x.dtype == torch.float32 else x.dtype


def _launch(x: torch.Tensor, groups: int, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float,
            add: Optional[torch.Tensor], silu: bool) -> torch.Tensor:
    """The launches, on checked arguments (``x`` non-empty, contiguous or 4-D channels-last, ``add`` contiguous)."""
    rounding = _stats_rounding(x, weight, bias)
    if not x.is_contiguous():  # checked: 4-D channels-last
        return group_norm_nhwc.launch_channels_last(x, groups, weight, bias, eps, add, silu, rounding)
    rows, L, spatial, per_group, tiles, iters, padded = _launch_shape(tuple(x.shape), groups)
    y = torch.empty_like(x)
    partial = torch.empty(2, rows, tiles, dtype=torch.float32, device=x.device)
    add_arg = x if add is None else add
    _tile_moments_kernel[(rows, tiles)](x, add_arg, partial[0], partial[1], L, tiles, spatial, per_group,
                                        HAS_ADD=add is not None, BLOCK=BLOCK, ITERS=iters, num_warps=8)
    _apply_kernel[(rows, tiles)](x, add_arg, y, x if weight is None else weight, x if bias is None else bias,
                                 partial[0], partial[1], L, tiles, spatial, per_group, x.shape[1], eps,
                                 HAS_ADD=add is not None, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
                                 SILU=silu, ROUND_HALF=rounding == torch.float16,
                                 ROUND_BF16=rounding == torch.bfloat16, BLOCK=BLOCK, ITERS=iters,
                                 TILES=padded, num_warps=8)
    return y


def _check(x: torch.Tensor, groups: int, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
           add: Optional[torch.Tensor]) -> None:
    if x.dim() < 2 or groups < 1 or x.shape[1] % groups:
        raise ValueError(f"x has shape {tuple(x.shape)}; GroupNorm needs [N, C, *] with C divisible by "
                         f"groups={groups}")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and (p.numel() != x.shape[1] or p.device != x.device):
            raise ValueError(f"{name} has {p.numel()} elements on {p.device}; expected {x.shape[1]} on {x.device}")
    if add is not None and (add.numel() != x.shape[0] * x.shape[1] or add.device != x.device):
        raise ValueError(f"add has shape {tuple(add.shape)} on {add.device}; expected one value per (sample, "
                         f"channel) of x {tuple(x.shape[:2])} on {x.device}")


def group_norm_reference(x: torch.Tensor, groups: int, weight: Optional[torch.Tensor] = None,
                         bias: Optional[torch.Tensor] = None, eps: float = 1e-5, add: Optional[torch.Tensor] = None,
                         silu: bool = False) -> torch.Tensor:
    """Plain torch, the ops diffusers' ResnetBlock2D runs: ``x + add`` (broadcast over the spatial dims), then
    ``F.group_norm``, then ``F.silu``."""
    _check(x, groups, weight, bias, add)
    if add is not None:
        x = x + add.reshape(x.shape[:2] + (1,) * (x.dim() - 2))
    y = F.group_norm(x, groups, weight, bias, eps)
    return F.silu(y) if silu else y


def group_norm_triton(x: torch.Tensor, groups: int, weight: Optional[torch.Tensor] = None,
                      bias: Optional[torch.Tensor] = None, eps: float = 1e-5, add: Optional[torch.Tensor] = None,
                      silu: bool = False) -> torch.Tensor:
    """The Triton kernels (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``); ``x`` contiguous or 4-D
    channels-last, ``add`` in ``x``'s dtype."""
    if triton is None:
        raise RuntimeError("group_norm_triton needs the 'triton' package; install triton or use group_norm_reference")
    _check(x, groups, weight, bias, add)
    if x.dtype not in DTYPES or not _kernel_layout(x):
        raise ValueError(f"group_norm_triton takes contiguous or 4-D channels-last {DTYPES} inputs, got {x.dtype} "
                         f"with strides {x.stride()}; use group_norm_reference")
    if add is not None and add.dtype != x.dtype:
        raise ValueError(f"add is {add.dtype}, x is {x.dtype}: group_norm_triton adds in x's dtype; use "
                         f"group_norm_reference for mixed dtypes")
    row = _row_length(x, groups)
    if row > MAX_ROW:
        raise ValueError(f"x {tuple(x.shape)} has {row} elements per (sample, group) row (channels-last: per "
                         f"sample), over the kernels' {MAX_ROW}; use group_norm_reference")
    if x.numel() == 0:
        return torch.empty_like(x)
    return _launch(x, groups, weight, bias, float(eps), None if add is None else add.contiguous(), silu)


def _kernel_layout(x: torch.Tensor) -> bool:
    """Contiguous (one run per row), or 4-D channels-last (``group_norm_nhwc``)."""
    return x.is_contiguous() or (x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last))


def _row_length(x: torch.Tensor, groups: int) -> int:
    """Elements the kernels index in int32: a (sample, group) row, or a whole sample for channels-last inputs."""
    if not x.is_contiguous():
        return x.numel() // max(x.shape[0], 1)
    return x.numel() // max(x.shape[0] * groups, 1)


def _triton_usable(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                   add: Optional[torch.Tensor], groups: int) -> bool:
    return (triton is not None and x.is_cuda and _kernel_layout(x) and x.dtype in DTYPES and x.dim() >= 2
            and _row_length(x, groups) <= MAX_ROW
            and all(p is None or p.device == x.device for p in (weight, bias, add))
            and (add is None or add.dtype == x.dtype)
            and dispatch.triton_unusable_reason(x.device) is None)


def group_norm(x: torch.Tensor, groups: int, weight: Optional[torch.Tensor] = None,
               bias: Optional[torch.Tensor] = None, eps: float = 1e-5, add: Optional[torch.Tensor] = None,
               silu: bool = False, impl: str = "auto") -> torch.Tensor:
    """Dispatcher (module docstring): the kernels for contiguous or channels-last CUDA inputs with everything on one
    device, the reference elsewhere and while ``torch.compile`` traces."""
    if impl == "auto" and torch.compiler.is_compiling():
        return group_norm_reference(x, groups, weight, bias, eps, add=add, silu=silu)
    if IMPL.pick(impl, lambda: _triton_usable(x, weight, bias, add, groups)) == "triton":
        return group_norm_triton(x, groups, weight, bias, eps, add=add, silu=silu)
    return group_norm_reference(x, groups, weight, bias, eps, add=add, silu=silu)

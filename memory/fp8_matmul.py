"""The ``fp8_e4m3fn_fast`` matmul: ``x @ W^T + b`` as one fp8 tensor-core GEMM (``torch._scaled_mm``), and the one
decision of where it can run.

Math: the activation is quantized per tensor on the fly, ``s_x = amax(|x|) (1 + 2^-7) / 448`` (rounded to the
activation dtype, so the division and the GEMM use the same value; the 2^-7 margin keeps ``x / s_x`` within 448
after that rounding; at least ``MIN_ACT_SCALE``, so an all-zero input never divides 0 by 0),
``X = round_e4m3fn(x / s_x)`` (``quantize_activation``); with the weight's fp8 values ``Q`` and scale ``s``
(``memory/fp8_weights.py``)
``y = _scaled_mm(X, Q^T, s_x, s, bias=b, out_dtype=bf16, use_fast_accum=True)``: fp8 products, accumulated in the
tensor cores' own precision (``FAST_ACCUMULATE``), one rounding to bf16. Against the dequantizing path
(``x @ (Q s)^T`` in bf16) the new error is the activation's fp8 rounding (about 2^-5 relative, rms, per element);
the GPU test bounds the GEMM against the same formula in fp32. ``fp8_linear_rows`` takes an activation already
quantized with one scale per row (``kernels.fp8_rows``, which owns the scale rule): the feed-forwards of
``memory/fp8_feedforward.py`` quantize their GELU output so, in one pass.

Invariants: no host sync (``.item()``), no data-dependent shape, no host->device copy: a forward through it is
CUDA-graph capturable. ``fp8_matmul_supported`` (CUDA compute capability >= 8.9, not ROCm, a torch with
``_scaled_mm``) decides ``fp8_linear_fast``, ``rows_supported`` (that, and a per-row-scaled GEMM runs there)
``fp8_linear_rows``; ``fast_shape_ok`` is the only shape rule (``K`` and ``N`` multiples of 16; ``M`` is free).
Callers check them before calling.
"""
from __future__ import annotations

import functools
import logging
from typing import Optional

import torch

from ..kernels.fp8_rows import ACT_SCALE_FACTOR, FP8_DTYPE, FP8_MAX, MIN_ACT_SCALE  # noqa: F401  (re-exported)

logger = logging.getLogger(__name__)

FAST_MIN_CAPABILITY = (8, 9)  # fp8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell (10.x, 12.x)
FAST_OUT_DTYPE = torch.bfloat16
FAST_DIM_MULTIPLE = 16  # torch._scaled_mm: K and N multiples of 16
# Hopper's fp8 tensor cores accumulate in fewer than fp32's bits; without fast accumulation cuBLAS promotes partial
# sums to fp32 every few K steps. Fast accumulation (torchao's default for fp8 inference) cut a compiled Qwen-Image
# block on an H200 from 8.50 to 8.17 ms (its GEMMs ~12% faster) and left its output's distance from bf16 as it was
# (0.0614 vs 0.0615 rel L2 after four blocks: the activation's fp8 rounding dominates it).
FAST_ACCUMULATE = True


def fp8_matmul_supported(device) -> bool:
    """Whether ``device`` runs ``torch._scaled_mm`` on fp8 tensor cores: CUDA (not ROCm) with compute capability
    >= ``FAST_MIN_CAPABILITY`` (8.9: Ada; Hopper, Blackwell) and a torch that has ``_scaled_mm``. The one place the
    ``fp8_e4m3fn_fast`` capability is decided."""
    device = torch.device(device)
    if device.type != "cuda" or getattr(torch.version, "hip", None) or not hasattr(torch, "_scaled_mm"):
        return False
    if not torch.cuda.is_available():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return tuple(torch.cuda.get_device_capability(index)) >= FAST_MIN_CAPABILITY


def fast_shape_ok(in_features: int, out_features: int) -> bool:
    """``torch._scaled_mm``'s shape rule for ``x [M, K] @ W^T [K, N]``: ``K`` and ``N`` multiples of 16."""
    return in_features % FAST_DIM_MULTIPLE == 0 and out_features % FAST_DIM_MULTIPLE == 0


def resolve_fast(requested: bool, device) -> bool:
    """``requested`` where ``fp8_matmul_supported(device)``; else False, with one log line saying so."""
    if not requested:
        return False
    if fp8_matmul_supported(device):
        return True
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available() and not getattr(torch.version, "hip", None):
        index = device.index if device.index is not None else torch.cuda.current_device()
        where = f"{device} (compute capability {'.'.join(map(str, torch.cuda.get_device_capability(index)))})"
    else:
        where = str(device)
    logger.warning("weight_dtype=fp8_e4m3fn_fast: %s has no fp8 tensor cores (needs CUDA compute capability >= "
                   "%d.%d); computing as fp8_e4m3fn (weights dequantized to the compute dtype)", where,
                   *FAST_MIN_CAPABILITY)
    return False


def quantize_activation(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(X, s_x)`` for a 2-D activation: ``s_x = amax(|x|) (1 + 2^-7) / 448`` rounded to ``x``'s dtype (the margin
    covers that rounding, so ``x / s_x`` never exceeds 448 and needs no clamp; ``s_x >= MIN_ACT_SCALE``) and
    ``X = round_e4m3fn(x / s_x)``. Three passes over ``x``: one reduction (``vector_norm(inf)``, accumulated in fp32),
    the division, the cast; plus three one-element kernels. ``s_x`` is a float32 0-d tensor on ``x``'s device."""
    amax = torch.linalg.vector_norm(x2, float("inf"), dtype=torch.float32)
    s_x = amax.mul_(ACT_SCALE_FACTOR).clamp_(min=MIN_ACT_SCALE).to(x2.dtype)
    return (x2 / s_x).to(FP8_DTYPE), s_x.float()


def fp8_linear_fast(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
                    bias: Optional[torch.Tensor] = None, out_dtype: torch.dtype = FAST_OUT_DTYPE) -> torch.Tensor:
    """``x @ W^T + b`` as one fp8 GEMM: ``x`` quantized per tensor on the fly (``quantize_activation``), ``w_fp8``
    [N, K] float8_e4m3fn (row-major, so ``w_fp8.t()`` is the column-major operand ``_scaled_mm`` wants), ``w_scale``
    a float32 0-d tensor on ``x``'s device. No host sync, no allocation whose size depends on data."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    xq, s_x = quantize_activation(x2)
    out = _scaled_gemm(xq, w_fp8, s_x, w_scale, bias, out_dtype)
    return out.view(*shape[:-1], out.shape[-1])


def _scaled_gemm(xq: torch.Tensor, w_fp8: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                 bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    """``(xq scale_a) (w_fp8 scale_b)^T + bias`` through ``_scaled_mm``: the bias fused when it is in ``out_dtype``,
    added after otherwise."""
    fused_bias = bias is not None and bias.dtype == out_dtype
    out = torch._scaled_mm(xq, w_fp8.t(), scale_a=scale_a, scale_b=scale_b, bias=bias if fused_bias else None,
                           out_dtype=out_dtype, use_fast_accum=FAST_ACCUMULATE)
    if isinstance(out, tuple):  # torch 2.4 returns (out, amax)
        out = out[0]
    return out if bias is None or fused_bias else out + bias.to(out_dtype)


@functools.lru_cache(maxsize=None)
def _rows_run(index: int) -> bool:
    device = torch.device("cuda", index)
    a = torch.zeros(16, 16, device=device).to(FP8_DTYPE)
    ones = torch.ones(16, 1, device=device)
    try:
        torch._scaled_mm(a, a.t(), scale_a=ones, scale_b=ones.t().contiguous(), out_dtype=FAST_OUT_DTYPE,
                         use_fast_accum=FAST_ACCUMULATE)
    except (RuntimeError, NotImplementedError) as exc:
        logger.info("fp8 matmuls with per-row scales are not available on %s (%s); per-tensor scales only",
                    device, str(exc).splitlines()[0][:200])
        return False
    return True


def rows_supported(device) -> bool:
    """Whether ``fp8_linear_rows`` runs on ``device``: ``fp8_matmul_supported`` and a first per-row-scaled
    ``_scaled_mm`` there succeeds (cuBLAS / CUTLASS build per-row scaling for Hopper and newer only; tried once
    per device, outside any capture)."""
    if not fp8_matmul_supported(device):
        return False
    device = torch.device(device)
    return _rows_run(device.index if device.index is not None else torch.cuda.current_device())


def fp8_linear_rows(xq: torch.Tensor, s_x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
                    bias: Optional[torch.Tensor] = None, out_dtype: torch.dtype = FAST_OUT_DTYPE) -> torch.Tensor:
    """``(X s_x) (Q s)^T + b`` as one fp8 GEMM with per-row activation scales: ``xq`` [M, K] float8_e4m3fn and
    ``s_x`` [M, 1] float32 (``kernels.fp8_rows``), ``w_fp8`` [N, K] and its float32 0-d scale ``w_scale`` (spread
    over the N columns, as ``_scaled_mm`` takes per-row scales on both sides or on neither). Check
    ``rows_supported`` first."""
    scale_b = w_scale.reshape(1, 1).expand(1, w_fp8.shape[0]).contiguous()
    return _scaled_gemm(xq, w_fp8, s_x, scale_b, bias, out_dtype)

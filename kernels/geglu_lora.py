"""GEGLU with a LoRA delta on its projection, fused: one pass from the projected activations to the GEGLU output.

Math (``diffusers.models.activations.GEGLU`` with a LoRA on its ``proj``; shapes: ``p`` [M, 2N] the base
projection ``proj(x)`` *without* the LoRA term, ``h`` [M, r] = ``down(x)``, ``up`` [2N, r] = ``strength * up``
(rows ``[up_a ; up_g]``)):

    a'  = round(a + h @ up_a.T)        g' = round(g + h @ up_g.T)        (p = [a | g] split on the last dim)
    out = round(a' * round(gelu(g')))  gelu(t) = t / 2 * (1 + erf(t / sqrt 2))  (exact, computed in fp32)

``round`` is the activation dtype. This is, operation by operation, what the plain path computes (the LoRA term
added into the projection by a GEMM with an fp32 accumulator, ``chunk``, ``F.gelu`` on the half-precision gate,
the multiply), so the kernel matches it within one rounding of the delta (1 ulp), while reading ``p`` once and
writing only the [M, N] output: the plain path writes the [M, 2N] projection back after the delta GEMM, reads it
again for the gelu, writes the gelu, and reads both halves for the multiply.

Three implementations with one signature ``(p, h, up, out=None)``: ``geglu_lora_triton`` (the kernel: a [BM, BN]
tile of the two deltas by two ``tl.dot`` with K = rank padded to a power of two >= 16, fp32 accumulators; fp32
inputs use IEEE products, not TF32), ``geglu_lora_reference`` (plain torch: exactly the plain path above) and
``geglu_lora`` (dispatcher: the kernel for CUDA tensors when Triton imports and ``torch.compile`` is not tracing,
where inductor fuses the reference itself; the reference elsewhere; ``LEANDIFFUSION_GEGLU_LORA`` = ``reference``
| ``triton`` | ``auto`` overrides, and ``impl=`` overrides both). Nothing reads a device value on the host, so
every path is CUDA-graph capturable. Hand-written because no library fuses a low-rank update into a GEGLU.
"""
# No ``from __future__ import annotations``: the interpreter (TRITON_INTERPRET=1) of Triton 3.0-3.2, which
# PyTorch 2.4-2.6 bring, knows a ``tl.constexpr`` parameter only by its evaluated annotation; as a string it
# passed BLOCK as an array and ``tl.arange`` refused it (compiled kernels, and the Triton 3.9 interpreter CI
# uses, read either form).
import os
from typing import Optional

import torch
import torch.nn.functional as F

from . import dispatch

IMPL = dispatch.KernelChoice("LEANDIFFUSION_GEGLU_LORA")

try:  # Triton is optional: without it every call takes the reference path
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None


def _check(p: torch.Tensor, h: torch.Tensor, up: torch.Tensor, out: Optional[torch.Tensor]) -> tuple[int, int, int]:
    """Validate; return (M, N half width, rank)."""
    if p.ndim != 2 or h.ndim != 2 or up.ndim != 2:
        raise ValueError(f"p, h and up must be 2-D ([M, 2N], [M, r], [2N, r]); got shapes {tuple(p.shape)}, "
                         f"{tuple(h.shape)}, {tuple(up.shape)}; reshape the activations to 2-D first")
    m, two_n = p.shape
    if two_n % 2:
        raise ValueError(f"p has an odd last dimension {two_n}; GEGLU splits it into two equal halves")
    if h.shape[0] != m or up.shape[0] != two_n or up.shape[1] != h.shape[1]:
        raise ValueError(f"shapes do not chain: p {tuple(p.shape)}, h {tuple(h.shape)}, up {tuple(up.shape)}; "
                         f"expected h [M, r] and up [2N, r] for p [M, 2N]")
    for name, t in (("h", h), ("up", up), ("out", out)):
        if t is not None and (t.device != p.device or t.dtype != p.dtype):
            raise ValueError(f"{name} is {t.dtype} on {t.device} but p is {p.dtype} on {p.device}; "
                             f"pass every tensor in one dtype on one device")
    if out is not None and out.shape != (m, two_n // 2):
        raise ValueError(f"out has shape {tuple(out.shape)}; expected {(m, two_n // 2)}")
    return m, two_n // 2, h.shape[1]


def geglu_lora_reference(p: torch.Tensor, h: torch.Tensor, up: torch.Tensor,
                         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Plain torch, the unfused path: ``addmm`` the delta into the projection, ``chunk``, ``a * gelu(g)``."""
    _check(p, h, up, out)
    a, g = torch.addmm(p, h, up.t()).chunk(2, dim=-1)
    y = a * F.gelu(g)
    if out is None:
        return y
    return out.copy_(y)


if triton is not None:

    @triton.jit
    def _geglu_lora_kernel(p_ptr, h_ptr, up_ptr, out_ptr, M, N, R,
                           s_pm, s_pn, s_hm, s_hr, s_um, s_ur, s_om, s_on,
                           IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
        rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
        rr = tl.arange(0, BR)
        mm, mn, mr = rm < M, rn < N, rr < R
        h = tl.load(h_ptr + rm[:, None] * s_hm + rr[None, :] * s_hr, mask=mm[:, None] & mr[None, :], other=0.0)
        ua = tl.load(up_ptr + rn[None, :] * s_um + rr[:, None] * s_ur, mask=mr[:, None] & mn[None, :], other=0.0)
        ug = tl.load(up_ptr + (rn[None, :] + N) * s_um + rr[:, None] * s_ur, mask=mr[:, None] & mn[None, :],
                     other=0.0)
        if IEEE:  # fp32 products of the (exactly widened) inputs, fp32 sums
            h = h.to(tl.float32)
            da = tl.dot(h, ua.to(tl.float32), input_precision="ieee")
            dg = tl.dot(h, ug.to(tl.float32), input_precision="ieee")
        else:
            da = tl.dot(h, ua)
            dg = tl.dot(h, ug)
        mask = mm[:, None] & mn[None, :]
        a = tl.load(p_ptr + rm[:, None] * s_pm + rn[None, :] * s_pn, mask=mask, other=0.0)
        g = tl.load(p_ptr + rm[:, None] * s_pm + (rn[None, :] + N) * s_pn, mask=mask, other=0.0)
        dtype = a.dtype
        a = (a.to(tl.float32) + da).to(dtype).to(tl.float32)
        g = (g.to(tl.float32) + dg).to(dtype).to(tl.float32)
        gl = (0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))).to(dtype).to(tl.float32)
        tl.store(out_ptr + rm[:, None] * s_om + rn[None, :] * s_on, (a * gl).to(dtype), mask=mask)


_BM, _BN = 64, 64


def _interpreting() -> bool:
    """Triton's CPU interpreter (triton 3.9) computes ``tl.dot`` of bfloat16 operands wrongly (garbage ~1e10); there
    the kernel widens them to fp32 first, which gives the products a bf16 tensor-core dot computes (exact in fp32)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def geglu_lora_triton(p: torch.Tensor, h: torch.Tensor, up: torch.Tensor,
                      out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The Triton kernel (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``). Same contract as the reference;
    any strides (``h`` may be a column slice of a shared down projection)."""
    if triton is None:
        raise RuntimeError("geglu_lora_triton needs the 'triton' package; install triton or use geglu_lora_reference")
    m, n, r = _check(p, h, up, out)
    if p.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"geglu_lora_triton supports float16, bfloat16 and float32, got {p.dtype}; "
                         f"use geglu_lora_reference")
    if out is None:
        out = torch.empty((m, n), dtype=p.dtype, device=p.device)
    if m == 0 or n == 0:
        return out
    br = max(16, triton.next_power_of_2(r))
    grid = (triton.cdiv(m, _BM), triton.cdiv(n, _BN))
    _geglu_lora_kernel[grid](p, h, up, out, m, n, r, p.stride(0), p.stride(1), h.stride(0), h.stride(1),
                             up.stride(0), up.stride(1), out.stride(0), out.stride(1),
                             IEEE=p.dtype == torch.float32 or (p.dtype == torch.bfloat16 and _interpreting()),
                             BM=_BM, BN=_BN, BR=br)
    return out


def _triton_usable(p: torch.Tensor) -> bool:
    return triton is not None and p.is_cuda and dispatch.triton_unusable_reason(p.device) is None


def geglu_lora(p: torch.Tensor, h: torch.Tensor, up: torch.Tensor, out: Optional[torch.Tensor] = None,
               impl: str = "auto") -> torch.Tensor:
    """Dispatcher: the Triton kernel for CUDA tensors on a GPU Triton supports (compute capability 7.0+; eager or
    CUDA-graph capture), the reference elsewhere and while ``torch.compile`` traces. ``impl="triton"`` forces the
    kernel, ``"reference"`` the reference."""
    if impl == "auto" and torch.compiler.is_compiling():
        return geglu_lora_reference(p, h, up, out)  # inductor fuses it; no environment read while tracing
    if IMPL.pick(impl, lambda: _triton_usable(p)) == "triton":
        return geglu_lora_triton(p, h, up, out)
    return geglu_lora_reference(p, h, up, out)

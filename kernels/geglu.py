"""GEGLU in one pass: the gated half of a projection, ``a * gelu(g)``, read once, written once.

Math (``diffusers.models.activations.GEGLU`` after its ``proj``; ``p`` [M, 2N] the projection, split on its last
dimension into ``p = [a | g]``):

    out = round(a * round(gelu(g)))        gelu(t) = t / 2 * (1 + erf(t / sqrt 2))  (exact, computed in fp32)

``round`` is the activation dtype. This is, operation by operation, what PyTorch computes for diffusers' forward
(``chunk``, ``F.gelu`` on the half-precision gate, widened to fp32 and rounded once, then the multiply, in fp32
and rounded once), so the kernel gives the same bits wherever its ``erf`` agrees with PyTorch's. The two ``erf``
builds (libdevice through Triton's LLVM, PyTorch's through nvcc) may round the gelu of a few percent of fp16
elements one ulp apart (the product then about one ulp of the output; ``tests/kernels/test_geglu.py``). The plain
path reads ``g``, writes ``gelu(g)``, then reads ``a`` and ``gelu(g)`` again and writes the product: three [M, N]
passes more. ``kernels.geglu_lora`` is the same epilogue with a LoRA delta.

Three implementations with one signature ``(p, out=None)``: ``geglu_triton`` (the kernel), ``geglu_reference``
(plain torch: exactly diffusers' forward after the projection) and ``geglu`` (dispatcher: the kernel for contiguous
CUDA tensors when Triton can run there and ``torch.compile`` is not tracing, where inductor fuses the reference
itself; the reference elsewhere; ``LEANDIFFUSION_GEGLU`` = ``reference`` | ``triton`` | ``auto`` overrides, and
``impl=`` overrides both). Nothing reads a device value on the host, so every path is CUDA-graph capturable.
Hand-written because PyTorch has no fused GEGLU op and diffusers runs the three passes.
"""
# No ``from __future__ import annotations``: see kernels/geglu_lora.py (the Triton 3.0-3.2 interpreter reads a
# ``tl.constexpr`` parameter's annotation evaluated).
from typing import Optional

import torch
import torch.nn.functional as F

from . import dispatch

IMPL = dispatch.KernelChoice("LEANDIFFUSION_GEGLU")
_BLOCK = 2048

try:  # Triton is optional: without it every call takes the reference path
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None


def _check(p: torch.Tensor, out: Optional[torch.Tensor]) -> int:
    """Validate; return N (the half width)."""
    if p.ndim < 1 or p.shape[-1] % 2:
        raise ValueError(f"p has shape {tuple(p.shape)}; GEGLU splits its last dimension into two equal halves, "
                         f"so it must be even")
    n = p.shape[-1] // 2
    if out is not None and (out.shape != p.shape[:-1] + (n,) or out.dtype != p.dtype or out.device != p.device):
        raise ValueError(f"out is {tuple(out.shape)} {out.dtype} on {out.device}; expected "
                         f"{tuple(p.shape[:-1]) + (n,)} {p.dtype} on {p.device}")
    return n


def geglu_reference(p: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Plain torch, diffusers' forward after the projection: ``a, g = p.chunk(2, -1); a * gelu(g)``."""
    _check(p, out)
    a, g = p.chunk(2, dim=-1)
    y = a * F.gelu(g)
    return y if out is None else out.copy_(y)


if triton is not None:

    @triton.jit
    def _geglu_kernel(p_ptr, out_ptr, total, N, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < total
        row = offs // N
        col = offs - row * N
        a = tl.load(p_ptr + row * 2 * N + col, mask=mask, other=0.0)
        g = tl.load(p_ptr + row * 2 * N + N + col, mask=mask, other=0.0)
        dtype = a.dtype
        g = g.to(tl.float32)
        gl = (0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))).to(dtype).to(tl.float32)
        tl.store(out_ptr + offs, (a.to(tl.float32) * gl).to(dtype), mask=mask)


def geglu_triton(p: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The Triton kernel (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``); ``p`` and ``out`` contiguous."""
    if triton is None:
        raise RuntimeError("geglu_triton needs the 'triton' package; install triton or use geglu_reference")
    n = _check(p, out)
    if p.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"geglu_triton supports float16, bfloat16 and float32, got {p.dtype}; use geglu_reference")
    if not p.is_contiguous() or (out is not None and not out.is_contiguous()):
        raise ValueError("geglu_triton needs contiguous p and out; use geglu_reference for strided tensors")
    if out is None:
        out = torch.empty(p.shape[:-1] + (n,), dtype=p.dtype, device=p.device)
    total = out.numel()
    if total:
        _geglu_kernel[(triton.cdiv(total, _BLOCK),)](p, out, total, n, BLOCK=_BLOCK, num_warps=8)
    return out


def _triton_usable(p: torch.Tensor) -> bool:
    return (triton is not None and p.is_cuda and p.is_contiguous()
            and p.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and dispatch.triton_unusable_reason(p.device) is None)


def geglu(p: torch.Tensor, out: Optional[torch.Tensor] = None, impl: str = "auto") -> torch.Tensor:
    """Dispatcher: the Triton kernel for contiguous CUDA tensors on a GPU Triton supports (compute capability
    7.0+; eager or CUDA-graph capture), the reference elsewhere and while ``torch.compile`` traces. ``impl="triton"``
    forces the kernel, ``"reference"`` the reference."""
    if impl == "auto" and torch.compiler.is_compiling():
        return geglu_reference(p, out)  # inductor fuses it; no environment read while tracing
    if IMPL.pick(impl, lambda: _triton_usable(p)) == "triton":
        return geglu_triton(p, out)
    return geglu_reference(p, out)

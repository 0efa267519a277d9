"""The Fused KSampler's per-step latent updates in one pass over the latent, with ComfyUI's arithmetic.

Math (fp32, ``s*`` per-step scalars the sampler computes from the sigmas; ComfyUI's op order, one rounding per op):

    euler:      y = x + ((x - d) / s0) * s1                       (to_d, then the Euler step; s0 = sigma, s1 = dt)
                y = y + (n * f) * s2                              (optional: ancestral noise, f = s_noise)
    multistep:  y = s0 * x + s1 * (s2 * d + s3 * o)               (dpmpp_2m, res_multistep: o = the previous d)
                y = s0 * x + s1 * d                               (without ``o``: their first-order steps)

A subtraction ``a - b * c`` of ComfyUI's is written here as ``a + (-b) * c``: negation is exact, so the two round
alike. The Triton kernel disables FMA contraction and divides with IEEE rounding (``div_rn``), so on the GPU it
equals the plain ops bit for bit; the reference is those ops.

Why hand-written: between two replays of the model's CUDA graph a sampler step ran 4-6 elementwise passes over the
latent plus a dozen 0-d scalar kernels on the device; with the scalars computed on the host (the sigmas are known
before the first step) the step's own work is one launch. torch.compile would fuse the passes but not take the
scalars off the device, and cannot run where the pack's samplers run eagerly.

Three implementations per update with one signature: the Triton kernel (``x`` a contiguous fp32 CUDA tensor,
every tensor alike, scalars on the host), the reference (plain torch; scalars as 0-d tensors or floats on any device
PyTorch accepts) and the dispatcher (the kernel when ``fused_for(x)`` holds and the scalars are host values;
``LEANDIFFUSION_SAMPLER_UPDATE`` = ``reference`` | ``triton`` | ``auto`` overrides). Nothing reads a device value.
"""
# No ``from __future__ import annotations``: see kernels/geglu_lora.py (the interpreter reads constexpr annotations).
from typing import Optional, Union

import torch

from . import dispatch

IMPL = dispatch.KernelChoice("LEANDIFFUSION_SAMPLER_UPDATE")
BLOCK = 2048
Scalar = Union[float, torch.Tensor]

try:  # Triton is optional: without it every call takes the reference
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None


if triton is not None:

    @triton.jit
    def _update_kernel(x_ptr, d_ptr, o_ptr, n_ptr, y_ptr, numel, s0, s1, s2, s3, f, MULTISTEP: tl.constexpr,
                       HAS_OLD: tl.constexpr, HAS_NOISE: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        d = tl.load(d_ptr + offs, mask=mask, other=0.0)
        if MULTISTEP:
            inner = s2 * d
            if HAS_OLD:
                inner = inner + s3 * tl.load(o_ptr + offs, mask=mask, other=0.0)
                y = s0 * x + s1 * inner
            else:
                y = s0 * x + s1 * d
        else:
            y = x + tl.math.div_rn(x - d, tl.full([BLOCK], 1.0, tl.float32) * s0) * s1
            if HAS_NOISE:
                y = y + (tl.load(n_ptr + offs, mask=mask, other=0.0) * f) * s2
        tl.store(y_ptr + offs, y, mask=mask)


def _host_float(value: Scalar) -> Optional[float]:
    """``value`` as a Python float when it lives on the host (a float, or a 0-d CPU tensor), else None."""
    if isinstance(value, torch.Tensor):
        return float(value) if value.device.type == "cpu" and value.numel() == 1 else None
    return float(value)


def fused_for(x: torch.Tensor) -> bool:
    """Whether updates of ``x`` take the kernel (given host scalars): a contiguous fp32 CUDA latent where Triton runs,
    not while ``torch.compile`` traces, unless ``LEANDIFFUSION_SAMPLER_UPDATE`` says otherwise."""
    usable = lambda: (triton is not None and x.is_cuda and x.dtype == torch.float32 and x.is_contiguous()  # noqa: E731
                      and not torch.compiler.is_compiling() and dispatch.triton_unusable_reason(x.device) is None)
    return IMPL.pick("auto", usable) == "triton"


def _launch(x, d, old, noise, scalars: list, multistep: bool) -> torch.Tensor:
    tensors = [t for t in (d, old, noise) if t is not None]
    if any(t.shape != x.shape or t.dtype != x.dtype or t.device != x.device or not t.is_contiguous()
           for t in tensors) or not x.is_contiguous():
        raise ValueError(f"sampler update: every tensor must be contiguous {x.dtype} {tuple(x.shape)} on {x.device}, "
                         f"got {[(t.dtype, tuple(t.shape), str(t.device)) for t in tensors]}; use the reference")
    y = torch.empty_like(x)
    s0, s1, s2, s3, f = (scalars + [0.0] * 5)[:5]
    _update_kernel[(triton.cdiv(x.numel(), BLOCK),)](
        x, d, x if old is None else old, x if noise is None else noise, y, x.numel(), s0, s1, s2, s3, f,
        MULTISTEP=multistep, HAS_OLD=old is not None, HAS_NOISE=noise is not None, BLOCK=BLOCK, num_warps=4,
        enable_fp_fusion=False)
    return y


def euler_reference(x, d, sigma: Scalar, dt: Scalar, noise=None, s_noise: float = 1.0, up: Scalar = 0.0):
    """``x + to_d(x, sigma, d) * dt`` (+ ``noise * s_noise * up``): ComfyUI's euler / euler_ancestral update."""
    y = x + (x - d) / sigma * dt
    return y if noise is None else y + noise * s_noise * up


def euler(x, d, sigma: Scalar, dt: Scalar, noise=None, s_noise: float = 1.0, up: Scalar = 0.0):
    """Dispatcher for ``euler_reference`` (module docstring)."""
    host = [_host_float(v) for v in (sigma, dt, up)]
    if None not in host and fused_for(x):
        return _launch(x, d, None, noise, [host[0], host[1], host[2], 0.0, float(s_noise)], multistep=False)
    return euler_reference(x, d, sigma, dt, noise, s_noise, up)


def multistep_reference(x, d, a: Scalar, b: Scalar, c: Scalar = 1.0, e: Scalar = 0.0, old=None):
    """``a * x + b * (c * d + e * old)``, or ``a * x + b * d`` without ``old`` (module docstring)."""
    if old is None:
        return a * x + b * d
    return a * x + b * (c * d + e * old)


def multistep(x, d, a: Scalar, b: Scalar, c: Scalar = 1.0, e: Scalar = 0.0, old=None):
    """Dispatcher for ``multistep_reference`` (module docstring)."""
    host = [_host_float(v) for v in (a, b, c, e)]
    if None not in host and fused_for(x):
        return _launch(x, d, old, None, host, multistep=True)
    return multistep_reference(x, d, a, b, c, e, old)

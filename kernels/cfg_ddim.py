"""Fused classifier-free guidance + DDIM update: one pass over the latent per step.

Math (per element, float32, in the operation order of diffusers' pipelines and ``DDIMScheduler.step`` so the
CPU reference is bit-identical to diffusers in float32):

    m   = u + s * (c - u)          classifier-free guidance (Ho & Salimans 2022); m = c without ``pred_uncond``
    x0, eps from (x, m) by the prediction type (``sampling/ddim.py``: epsilon, v_prediction, sample)
    x'  = sqrt(a') * x0 + d * eps [+ sigma * z]          one DDIM step (Song et al. 2020, eq. 12)

``coeffs`` is a float32 tensor ``[6] = (s, sqrt a, sqrt b, sqrt a', d, sigma)`` on the latent's device (see
``pack_coefficients``). Keeping the guidance scale and the step scalars in a *device* tensor means a captured CUDA
graph reads new values on every replay: changing ``cfg`` or stepping through the schedule never recaptures.
Nothing here reads a device value on the host (no ``.item()``), so every path is CUDA-graph capturable.

Optional ``model_input``: a tensor of ``k * B`` rows (k = 1 or 2) that receives ``k`` copies of ``x'`` cast to its
dtype - the next UNet input (``[x', x']`` for batched CFG), written by the same kernel instead of a ``cat`` and a
cast per step.

Three implementations with one signature: ``cfg_ddim_triton`` (the Triton kernel), ``cfg_ddim_reference`` (plain
torch) and ``cfg_ddim_step`` (dispatcher: Triton for contiguous CUDA tensors, the reference elsewhere; the
environment variable ``LEANDIFFUSION_CFG_DDIM`` = ``reference`` | ``triton`` | ``auto`` overrides, and ``impl=``
overrides both). Hand-written because no library fuses the guidance combine with a scheduler update.
"""
# No ``from __future__ import annotations``: the interpreter (TRITON_INTERPRET=1) of Triton 3.0-3.2, which
# PyTorch 2.4-2.6 bring, knows a ``tl.constexpr`` parameter only by its evaluated annotation; as a string it
# passed BLOCK as an array and ``tl.arange`` refused it (compiled kernels, and the Triton 3.9 interpreter CI
# uses, read either form).
import logging
from typing import Optional

import torch

from . import dispatch

logger = logging.getLogger(__name__)

IMPL = dispatch.KernelChoice("LEANDIFFUSION_CFG_DDIM")
N_COEFFS = 6  # guidance, sqrt a, sqrt b, sqrt a_prev, direction d, sigma
PREDICTIONS = {"epsilon": 0, "v_prediction": 1, "sample": 2}

try:  # Triton is optional: without it every call takes the reference path
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None


def _check(sample: torch.Tensor, pred_cond: torch.Tensor, pred_uncond: Optional[torch.Tensor], coeffs: torch.Tensor,
           noise: Optional[torch.Tensor], out: Optional[torch.Tensor], model_input: Optional[torch.Tensor],
           prediction: str) -> int:
    """Validate shapes/devices; return the number of ``model_input`` copies (0 when absent)."""
    for name, t in (("pred_cond", pred_cond), ("pred_uncond", pred_uncond), ("noise", noise), ("out", out)):
        if t is not None and t.shape != sample.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)} but sample has {tuple(sample.shape)}; "
                             f"pass tensors of the latent's shape")
    for name, t in (("pred_cond", pred_cond), ("pred_uncond", pred_uncond), ("noise", noise), ("out", out),
                    ("coeffs", coeffs), ("model_input", model_input)):
        if t is not None and t.device != sample.device:
            raise ValueError(f"{name} is on {t.device} but sample is on {sample.device}; move it to one device")
    if coeffs.shape != (N_COEFFS,) or coeffs.dtype != torch.float32:
        raise ValueError(f"coeffs must be a float32 tensor of shape ({N_COEFFS},) = (guidance, sqrt a, sqrt b, "
                         f"sqrt a_prev, d, sigma), got {coeffs.dtype} {tuple(coeffs.shape)}")
    if prediction not in PREDICTIONS:
        raise ValueError(f"prediction={prediction!r}: expected one of {tuple(PREDICTIONS)}")
    if model_input is None:
        return 0
    b = sample.shape[0]
    copies = model_input.shape[0] // b if b else 0
    if copies not in (1, 2) or model_input.shape[0] != copies * b or model_input.shape[1:] != sample.shape[1:]:
        raise ValueError(f"model_input has shape {tuple(model_input.shape)}; expected 1 or 2 copies of the sample "
                         f"shape {tuple(sample.shape)} stacked on the batch axis")
    return copies


def cfg_ddim_reference(sample: torch.Tensor, pred_cond: torch.Tensor, pred_uncond: Optional[torch.Tensor],
                       coeffs: torch.Tensor, noise: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
                       model_input: Optional[torch.Tensor] = None, prediction: str = "epsilon") -> torch.Tensor:
    """Plain-torch reference of the fused step (float32 arithmetic). Returns ``out`` (allocated when None)."""
    copies = _check(sample, pred_cond, pred_uncond, coeffs, noise, out, model_input, prediction)
    s, sa, sb, sap, d, sigma = coeffs.unbind(0)
    c = pred_cond.float()
    m = c if pred_uncond is None else pred_uncond.float() + s * (c - pred_uncond.float())
    x = sample.float()
    if prediction == "epsilon":
        x0 = (x - sb * m) / sa
        eps = m
    elif prediction == "v_prediction":
        x0 = sa * x - sb * m
        eps = sa * m + sb * x
    else:
        x0 = m
        eps = (x - sa * x0) / sb
    y = sap * x0 + d * eps
    if noise is not None:
        y = y + sigma * noise.float()
    if out is None:
        out = torch.empty_like(sample)
    out.copy_(y)
    if copies:
        model_input.view(copies, *sample.shape).copy_(y.unsqueeze(0).expand(copies, *sample.shape))
    return out


if triton is not None:

    @triton.jit
    def _cfg_ddim_kernel(x_ptr, c_ptr, u_ptr, n_ptr, coef_ptr, out_ptr, mi_ptr, numel,
                         PRED: tl.constexpr, HAS_UNCOND: tl.constexpr, HAS_NOISE: tl.constexpr,
                         MI_COPIES: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        s = tl.load(coef_ptr + 0)
        sa = tl.load(coef_ptr + 1)
        sb = tl.load(coef_ptr + 2)
        sap = tl.load(coef_ptr + 3)
        d = tl.load(coef_ptr + 4)
        sigma = tl.load(coef_ptr + 5)
        c = tl.load(c_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_UNCOND:
            u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            m = u + s * (c - u)
        else:
            m = c
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if PRED == 0:  # epsilon
            x0 = (x - sb * m) / sa
            eps = m
        elif PRED == 1:  # v_prediction
            x0 = sa * x - sb * m
            eps = sa * m + sb * x
        else:  # sample
            x0 = m
            eps = (x - sa * x0) / sb
        y = sap * x0 + d * eps
        if HAS_NOISE:
            z = tl.load(n_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            y = y + sigma * z
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
        for k in tl.static_range(MI_COPIES):
            tl.store(mi_ptr + k * numel + offs, y.to(mi_ptr.dtype.element_ty), mask=mask)


_BLOCK = 1024


def cfg_ddim_triton(sample: torch.Tensor, pred_cond: torch.Tensor, pred_uncond: Optional[torch.Tensor],
                    coeffs: torch.Tensor, noise: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
                    model_input: Optional[torch.Tensor] = None, prediction: str = "epsilon") -> torch.Tensor:
    """The Triton kernel (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``). Same contract as the reference."""
    if triton is None:
        raise RuntimeError("cfg_ddim_triton needs the 'triton' package; install triton or use cfg_ddim_reference")
    copies = _check(sample, pred_cond, pred_uncond, coeffs, noise, out, model_input, prediction)
    tensors = [t for t in (sample, pred_cond, pred_uncond, noise, out, model_input, coeffs) if t is not None]
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("cfg_ddim_triton needs contiguous tensors; call .contiguous() or use cfg_ddim_reference")
    if out is None:
        out = torch.empty_like(sample)
    numel = sample.numel()
    if numel == 0:
        return out
    grid = (triton.cdiv(numel, _BLOCK),)
    _cfg_ddim_kernel[grid](
        sample, pred_cond, pred_cond if pred_uncond is None else pred_uncond, sample if noise is None else noise,
        coeffs, out, out if model_input is None else model_input, numel,
        PRED=PREDICTIONS[prediction], HAS_UNCOND=pred_uncond is not None, HAS_NOISE=noise is not None,
        MI_COPIES=copies, BLOCK=_BLOCK)
    return out


def _triton_usable(tensors) -> bool:
    return (triton is not None and all(t.is_cuda and t.is_contiguous() for t in tensors)
            and dispatch.triton_unusable_reason(tensors[0].device) is None)


def cfg_ddim_step(sample: torch.Tensor, pred_cond: torch.Tensor, pred_uncond: Optional[torch.Tensor],
                  coeffs: torch.Tensor, noise: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
                  model_input: Optional[torch.Tensor] = None, prediction: str = "epsilon",
                  impl: str = "auto") -> torch.Tensor:
    """Dispatcher: the Triton kernel for contiguous CUDA tensors on a GPU Triton supports (compute capability 7.0+),
    the torch reference elsewhere.

    ``impl="triton"`` forces the kernel (CPU tensors then need ``TRITON_INTERPRET=1``), ``"reference"`` the
    reference; ``"auto"`` follows ``$LEANDIFFUSION_CFG_DDIM`` and then the rule above.
    """
    args = (sample, pred_cond, pred_uncond, coeffs, noise, out, model_input, prediction)
    tensors = [t for t in (sample, pred_cond, pred_uncond, noise, out, model_input, coeffs) if t is not None]
    if IMPL.pick(impl, lambda: _triton_usable(tensors)) == "triton":
        return cfg_ddim_triton(*args)
    return cfg_ddim_reference(*args)


def pack_coefficients(guidance: float, sqrt_a: float, sqrt_b: float, sqrt_a_prev: float, direction: float,
                      sigma: float = 0.0, device: torch.device | str = "cpu") -> torch.Tensor:
    """The ``coeffs`` tensor (float32, shape [6]) for one step; see ``sampling.ddim.step_scalars``."""
    return torch.tensor([guidance, sqrt_a, sqrt_b, sqrt_a_prev, direction, sigma], dtype=torch.float32,
                        device=device)

"""Fused classifier-free guidance + flow-matching Euler step: one pass over the latent per step.

Math (per element, float32 arithmetic whatever the predictions' dtype - fp32, bf16 or fp16 are upcast):

    m   = u + s * (c - u)          classifier-free guidance as ComfyUI combines it; m = c without ``pred_uncond``
    x'  = x + d * m                one Euler step of the flow ODE dx/dsigma = v (Lipman et al. 2023)

``coeffs`` is a float32 tensor ``[2] = (s, d)`` on the latent's device (see ``pack_flow_coefficients``). The kernel
is sign-agnostic: for a model that predicts the velocity v, d = sigma_next - sigma (diffusers'
``FlowMatchEulerDiscreteScheduler.step``); Z-Image's transformer predicts -v, so its caller passes
d = sigma - sigma_next. diffusers' ``ZImagePipeline`` writes the same step as

    x' = x + (sigma_next - sigma) * -(c + g * (c - u)),   g = s - 1   (its ``guidance_scale``)

which equals ours up to float32 rounding (``tests/kernels/test_flow_euler_cfg.py`` holds them within 1e-6).
Keeping the guidance scale and the step size in a *device* tensor means a captured CUDA graph reads new values on
every replay: changing ``cfg`` or stepping through the schedule never recaptures. Nothing here reads a device value
on the host (no ``.item()``), so every path is CUDA-graph capturable.

``sample`` (x) and ``out`` (x') are float32 tensors of one shape (any rank, contiguous for the kernel); ``out`` may
be ``sample`` itself (the sampler's in-place state update: each element is read before it is written). Optional
``model_input``: a tensor of ``k * B`` rows (k = 1 or 2, B = ``sample.shape[0]``) that receives ``k`` copies of
``x'`` cast to its dtype, stacked on the batch axis - the next model input (``[x', x']`` for batched CFG), written
by the same kernel instead of a ``cat`` and a cast per step.

Three implementations with one signature: ``flow_euler_triton`` (the Triton kernel), ``flow_euler_reference``
(plain torch) and ``flow_euler_step`` (dispatcher: Triton for contiguous CUDA tensors on a GPU Triton supports, the
reference elsewhere; the environment variable ``LEANDIFFUSION_FLOW_EULER`` = ``reference`` | ``triton`` | ``auto``
overrides, and ``impl=`` overrides both). Hand-written because no library fuses the guidance combine with a flow
step: diffusers and ComfyUI run the combine, the negation, the scheduler's update and the next input's ``cat`` and
cast as separate elementwise ops, each a full pass over the latent.
"""
# No ``from __future__ import annotations``: the interpreter (TRITON_INTERPRET=1) of Triton 3.0-3.2, which
# PyTorch 2.4-2.6 bring, knows a ``tl.constexpr`` parameter only by its evaluated annotation; as a string it
# passed BLOCK as an array and ``tl.arange`` refused it (compiled kernels, and the Triton 3.9 interpreter CI
# uses, read either form).
import logging
import math
from typing import Optional

import torch

from . import dispatch

logger = logging.getLogger(__name__)

IMPL = dispatch.KernelChoice("LEANDIFFUSION_FLOW_EULER")
N_COEFFS = 2  # guidance s, step d
PRED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_REQUIRED = ("sample", "pred_cond", "coeffs")  # the other tensor arguments may be None

try:  # Triton is optional: without it every call takes the reference path
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None


def _check(sample: torch.Tensor, pred_cond: torch.Tensor, pred_uncond: Optional[torch.Tensor], coeffs: torch.Tensor,
           out: Optional[torch.Tensor], model_input: Optional[torch.Tensor]) -> int:
    """Validate types, shapes, dtypes and devices; return the number of ``model_input`` copies (0 when absent)."""
    for name, t in (("sample", sample), ("pred_cond", pred_cond), ("coeffs", coeffs), ("pred_uncond", pred_uncond),
                    ("out", out), ("model_input", model_input)):
        if not isinstance(t, torch.Tensor) and (t is not None or name in _REQUIRED):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in (("sample", sample), ("out", out)):
        if t is not None and t.dtype != torch.float32:
            raise ValueError(f"{name} has dtype {t.dtype} but the flow state is float32; pass a float32 tensor")
    for name, t in (("pred_cond", pred_cond), ("pred_uncond", pred_uncond), ("model_input", model_input)):
        if t is not None and t.dtype not in PRED_DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}; expected one of {PRED_DTYPES}")
    for name, t in (("pred_cond", pred_cond), ("pred_uncond", pred_uncond), ("out", out)):
        if t is not None and t.shape != sample.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)} but sample has {tuple(sample.shape)}; "
                             f"pass tensors of the latent's shape")
    for name, t in (("pred_cond", pred_cond), ("pred_uncond", pred_uncond), ("out", out), ("coeffs", coeffs),
                    ("model_input", model_input)):
        if t is not None and t.device != sample.device:
            raise ValueError(f"{name} is on {t.device} but sample is on {sample.device}; move it to one device")
    if coeffs.shape != (N_COEFFS,) or coeffs.dtype != torch.float32:
        raise ValueError(f"coeffs must be a float32 tensor of shape ({N_COEFFS},) = (guidance, step), got "
                         f"{coeffs.dtype} {tuple(coeffs.shape)}; build it with pack_flow_coefficients")
    if model_input is None:
        return 0
    if sample.dim() == 0:
        raise ValueError("model_input needs a batch axis but sample is 0-d; pass a sample of shape [B, ...]")
    b = sample.shape[0]
    copies = model_input.shape[0] // b if b else 1
    if copies not in (1, 2) or model_input.shape[0] != copies * b or model_input.shape[1:] != sample.shape[1:]:
        raise ValueError(f"model_input has shape {tuple(model_input.shape)}; expected 1 or 2 copies of the sample "
                         f"shape {tuple(sample.shape)} stacked on the batch axis")
    return copies


def flow_euler_reference(sample: torch.Tensor, pred_cond: torch.Tensor, pred_uncond: Optional[torch.Tensor],
                         coeffs: torch.Tensor, out: Optional[torch.Tensor] = None,
                         model_input: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Plain-torch reference of the fused step (float32 arithmetic). Returns ``out`` (allocated when None)."""
    copies = _check(sample, pred_cond, pred_uncond, coeffs, out, model_input)
    s, d = coeffs.unbind(0)
    c = pred_cond.float()
    m = c if pred_uncond is None else pred_uncond.float() + s * (c - pred_uncond.float())
    y = sample + d * m
    if out is None:
        out = torch.empty_like(sample)
    out.copy_(y)
    if copies:
        model_input.view(copies, *sample.shape).copy_(y.unsqueeze(0).expand(copies, *sample.shape))
    return out


if triton is not None:

    @triton.jit
    def _flow_euler_kernel(x_ptr, c_ptr, u_ptr, coef_ptr, out_ptr, mi_ptr, numel,
                           HAS_UNCOND: tl.constexpr, MI_COPIES: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        s = tl.load(coef_ptr + 0)
        d = tl.load(coef_ptr + 1)
        c = tl.load(c_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_UNCOND:
            u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            m = u + s * (c - u)
        else:
            m = c
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        y = x + d * m
        tl.store(out_ptr + offs, y, mask=mask)
        for k in tl.static_range(MI_COPIES):
            tl.store(mi_ptr + k * numel + offs, y.to(mi_ptr.dtype.element_ty), mask=mask)


_BLOCK = 1024


def flow_euler_triton(sample: torch.Tensor, pred_cond: torch.Tensor, pred_uncond: Optional[torch.Tensor],
                      coeffs: torch.Tensor, out: Optional[torch.Tensor] = None,
                      model_input: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The Triton kernel (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``). Same contract as the reference."""
    if triton is None:
        raise RuntimeError("flow_euler_triton needs the 'triton' package; install triton or use flow_euler_reference")
    copies = _check(sample, pred_cond, pred_uncond, coeffs, out, model_input)
    tensors = [t for t in (sample, pred_cond, pred_uncond, out, model_input, coeffs) if t is not None]
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("flow_euler_triton needs contiguous tensors; call .contiguous() or use flow_euler_reference")
    if out is None:
        out = torch.empty_like(sample)
    numel = sample.numel()
    if numel == 0:
        return out
    grid = (triton.cdiv(numel, _BLOCK),)
    _flow_euler_kernel[grid](
        sample, pred_cond, pred_cond if pred_uncond is None else pred_uncond, coeffs, out,
        out if model_input is None else model_input, numel,
        HAS_UNCOND=pred_uncond is not None, MI_COPIES=copies, BLOCK=_BLOCK)
    return out


def _triton_usable(tensors) -> bool:
    return (triton is not None and bool(tensors) and all(t.is_cuda and t.is_contiguous() for t in tensors)
            and dispatch.triton_unusable_reason(tensors[0].device) is None)


def flow_euler_step(sample: torch.Tensor, pred_cond: torch.Tensor, pred_uncond: Optional[torch.Tensor],
                    coeffs: torch.Tensor, out: Optional[torch.Tensor] = None,
                    model_input: Optional[torch.Tensor] = None, impl: str = "auto") -> torch.Tensor:
    """Dispatcher: the Triton kernel for contiguous CUDA tensors on a GPU Triton supports (compute capability 7.0+),
    the torch reference elsewhere.

    ``impl="triton"`` forces the kernel (CPU tensors then need ``TRITON_INTERPRET=1``), ``"reference"`` the
    reference; ``"auto"`` follows ``$LEANDIFFUSION_FLOW_EULER`` and then the rule above.
    """
    args = (sample, pred_cond, pred_uncond, coeffs, out, model_input)
    # what is not a tensor is left to the implementation's check (a TypeError naming it)
    tensors = [t for t in (sample, pred_cond, pred_uncond, out, model_input, coeffs) if isinstance(t, torch.Tensor)]
    if IMPL.pick(impl, lambda: _triton_usable(tensors)) == "triton":
        return flow_euler_triton(*args)
    return flow_euler_reference(*args)


def pack_flow_coefficients(guidance: float, step: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """The ``coeffs`` tensor (float32, shape [2]) = (guidance s, step d) for one step of ``flow_euler_step``.

    ``step`` is the multiplier of the guided prediction: sigma_next - sigma for a velocity model, sigma -
    sigma_next for Z-Image (whose transformer predicts the negative velocity)."""
    for name, value in (("guidance", guidance), ("step", step)):
        if not math.isfinite(float(value)):
            raise ValueError(f"{name}={value!r}: the step coefficients must be finite numbers")
    return torch.tensor([guidance, step], dtype=torch.float32, device=device)

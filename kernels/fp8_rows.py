"""An activation quantized to float8_e4m3fn with one scale per row, in one pass; optionally through diffusers'
tanh GELU first (the input of a feed-forward's output layer).

Math, for row ``i`` of ``x`` [M, K] (activation dtype ``d``):

    g   = round_d(gelu_tanh(x))  if gelu_tanh else x         gelu_tanh(t) = t / 2 (1 + tanh u) = t / (1 + e^(-2u)),
                                                             u = sqrt(2 / pi) (t + 0.044715 t^3), in fp32
    s_i = max(amax_j |g_ij| * ACT_SCALE_FACTOR, MIN_ACT_SCALE)                   (float32, [M, 1])
    q_ij = round_e4m3fn(g_ij * r_i),   r_i = 1 / s_i        (r_i rounded to float32 once; round to nearest even)

``ACT_SCALE_FACTOR = (1 + 2^-7) / 448``: the margin keeps ``|g / s|`` below 448 (e4m3fn's largest value), so no
clamp is needed (``r_i`` is within an ulp of ``1 / s_i``); ``MIN_ACT_SCALE`` keeps an all-zero row finite. One
reciprocal per row, not a division per element: an IEEE division is a dozen instructions, enough to make the kernel
bound by arithmetic instead of memory. ``g`` is rounded to ``d`` because diffusers' ``GELU`` returns it in the
activation dtype and the reference quantizes that tensor.

Three implementations, one signature ``(x, gelu_tanh) -> (q, s)``: ``fp8_rows_reference`` (plain torch:
``F.gelu(x, approximate="tanh")`` and the formula above), ``fp8_rows_triton`` (the kernel: one program per row
reads it once and writes its fp8 values and scale once) and ``fp8_rows`` (dispatcher, ``LEANDIFFUSION_FP8_ROWS`` =
``auto`` | ``triton`` | ``reference``). The kernel's GELU is ``t / (1 + e^(-2u))`` (Triton's interpreter has no
``tanh``), so a bf16 ``g`` may round one ulp from PyTorch's and its ``q`` one fp8 step; without the GELU the kernel
gives the reference's bits on the GPU. ``fp8_rows_op`` is the dispatcher as the custom op ``leandiffusion::fp8_rows``
(registered at import), which ``torch.compile`` keeps whole. Nothing reads a device value on the host, so every path
is CUDA-graph capturable.

Why hand-written: inductor compiles the GELU, per-row amax and cast into a looped reduction that reads a Qwen-Image
MLP activation (16k x 12288 bf16) at ~1 TB/s on an H200 (0.58 ms per block), and its per-tensor form needs two
passes; no library op quantizes per row.
"""
# No ``from __future__ import annotations``: the Triton interpreter reads a ``tl.constexpr`` parameter's annotation.
import torch
import torch.nn.functional as F

from . import dispatch

IMPL = dispatch.KernelChoice("LEANDIFFUSION_FP8_ROWS")
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
ACT_SCALE_FACTOR = (1 + 2 ** -7) / FP8_MAX  # amax -> scale, with the margin the module docstring explains
MIN_ACT_SCALE = 1e-12
MAX_ROW = 16384  # one program holds a row in registers (64 fp32 values a thread at 8 warps)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

try:  # Triton is optional: without it every call takes the reference path
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None


def _check(x: torch.Tensor) -> None:
    if x.ndim != 2:
        raise ValueError(f"x has shape {tuple(x.shape)}; expected a 2-D activation [rows, features]")
    if x.dtype not in _DTYPES:
        raise ValueError(f"x is {x.dtype}; expected one of {', '.join(map(str, _DTYPES))}")


def fp8_rows_reference(x: torch.Tensor, gelu_tanh: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch: ``(q, s)`` by the module docstring's formula, ``g`` from ``F.gelu(x, approximate="tanh")``."""
    _check(x)
    g = F.gelu(x, approximate="tanh") if gelu_tanh else x
    scale = (g.abs().amax(dim=1, keepdim=True).float() * ACT_SCALE_FACTOR).clamp_(min=MIN_ACT_SCALE)
    return (g.float() * scale.reciprocal()).to(FP8_DTYPE), scale


if triton is not None:

    @triton.jit
    def _fp8_rows_kernel(x_ptr, q_ptr, s_ptr, K, factor, min_scale, GELU: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < K
        x = tl.load(x_ptr + row * K + cols, mask=mask, other=0.0)
        g = x.to(tl.float32)
        if GELU:
            u = 0.7978845608028654 * (g + 0.044715 * (g * g * g))
            g = (g / (1.0 + tl.exp(-2.0 * u))).to(x.dtype).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(g), axis=0) * factor, min_scale)
        q = g * tl.math.div_rn(1.0, scale)
        tl.store(q_ptr + row * K + cols, q.to(tl.float8e4nv), mask=mask)
        tl.store(s_ptr + row, scale)


def _warps(block: int) -> int:
    return 8 if block >= 4096 else 4  # 16 warps at 16384 measured 10% slower on an H200


def fp8_rows_triton(x: torch.Tensor, gelu_tanh: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``): ``x`` contiguous, rows of at
    most ``MAX_ROW`` features."""
    if triton is None:
        raise RuntimeError("fp8_rows_triton needs the 'triton' package; install triton or use fp8_rows_reference")
    _check(x)
    rows, k = x.shape
    if not x.is_contiguous():
        raise ValueError("fp8_rows_triton needs a contiguous x; use fp8_rows_reference for a strided one")
    if k > MAX_ROW:
        raise ValueError(f"x has rows of {k} features; fp8_rows_triton holds at most {MAX_ROW} in one program")
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows and k:
        block = triton.next_power_of_2(k)
        _fp8_rows_kernel[(rows,)](x, q, scale, k, ACT_SCALE_FACTOR, MIN_ACT_SCALE, GELU=bool(gelu_tanh),
                                  BLOCK=block, num_warps=_warps(block))
    elif rows:
        scale.fill_(MIN_ACT_SCALE)
    return q, scale


def _triton_usable(x: torch.Tensor) -> bool:
    return (triton is not None and x.is_cuda and x.ndim == 2 and x.is_contiguous() and x.dtype in _DTYPES
            and x.shape[1] <= MAX_ROW and dispatch.triton_unusable_reason(x.device) is None)


def fp8_rows(x: torch.Tensor, gelu_tanh: bool = False, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatcher: the kernel for contiguous CUDA rows of at most ``MAX_ROW`` features on a GPU Triton supports,
    the reference elsewhere; ``impl`` (else ``LEANDIFFUSION_FP8_ROWS``) forces either."""
    if IMPL.pick(impl, lambda: _triton_usable(x)) == "triton":
        return fp8_rows_triton(x, gelu_tanh)
    return fp8_rows_reference(x, gelu_tanh)


if hasattr(torch.library, "custom_op"):  # torch >= 2.4

    @torch.library.custom_op("leandiffusion::fp8_rows", mutates_args=())
    def _fp8_rows_custom(x: torch.Tensor, gelu_tanh: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return fp8_rows(x, gelu_tanh)

    @_fp8_rows_custom.register_fake
    def _(x: torch.Tensor, gelu_tanh: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return x.new_empty(x.shape, dtype=FP8_DTYPE), x.new_empty((x.shape[0], 1), dtype=torch.float32)

else:  # pragma: no cover - older torch: dynamo traces the dispatcher
    _fp8_rows_custom = fp8_rows


def fp8_rows_op(x: torch.Tensor, gelu_tanh: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8_rows(x, gelu_tanh)`` as one opaque op for ``torch.compile`` (inductor would otherwise inline the
    reference as the slow looped reduction the module docstring names)."""
    return _fp8_rows_custom(x, bool(gelu_tanh))

"""fp8_e4m3fn_fast feed-forwards: a diffusers ``FeedForward`` whose hidden layer is a tanh ``GELU`` and whose output
layer runs fp8 matmuls takes its hidden activation through the GELU and the fp8 quantization in one pass.

diffusers' forward, with the output layer fp8-fast: ``h = proj(x)``; ``g = gelu_tanh(h)`` (written out); then
``fp8_linear_fast(g)`` reads ``g`` for its per-tensor amax and again to quantize it. The fused forward:
``h = proj(x)`` (the GELU's ``proj`` module, hooks included); ``(q, s) = kernels.fp8_rows(h, gelu_tanh=True)``
(read once, one scale per row); ``y = fp8_linear_rows(q, s, W, s_W, b)``. Numerically the output layer's input gets
a scale per row instead of one per tensor: each row's fp8 grid fits that row (on random Qwen-Image blocks the
output moved 0.0638 rel L2 from bf16 against 0.0657 per tensor), and a row's values no longer depend on other rows'
(padding rows, the other half of a CFG pair).

Invariants
- ``fuse_feedforwards(module, device)`` gives each eligible ``FeedForward`` of ``module`` the instance ``forward``
  ``fused_forward`` bound to it (the same function for all: dynamo guards its code, so a regionally compiled
  model keeps one graph for all its blocks) and returns how many; none where ``device`` cannot run per-row fp8
  GEMMs (``fp8_matmul.rows_supported``) or Triton kernels (without the kernel the op would run its plain-torch
  reference, no faster than diffusers' path). Eligible: the ``FeedForward`` class itself, ``net`` = [diffusers'
  ``GELU`` class with ``approximate="tanh"``, ``Dropout``, an fp8-fast ``Fp8Linear`` whose input rows fit one
  kernel program (``kernels.fp8_rows.MAX_ROW``)], no instance ``forward`` already (another library's override is
  left alone).
- Each call decides again (``fused_now``): the output layer still fp8-fast, no hooks on it or on the GELU module (a
  LoRA term on the output layer is a forward hook), a non-empty bf16 CUDA input, no autograd graph, the dropout
  inactive, no extra arguments. Otherwise diffusers' own forward runs, unchanged.
- Nothing reads a device value on the host: capturable in a CUDA graph; ``torch.compile`` keeps ``fp8_rows`` whole.

Why: on a Qwen-Image edit step (16k rows of 12288 hidden features per MLP) the GELU and the per-tensor quantization
cost two reads of the hidden activation more than one pass needs, ~0.55 ms of a 7.8 ms fp8 block on an H200.
"""
from __future__ import annotations

import types

import torch

from ..kernels.dispatch import triton_unusable_reason
from ..kernels.fp8_rows import MAX_ROW, fp8_rows_op
from .fp8_matmul import FAST_OUT_DTYPE, FP8_DTYPE, fp8_linear_rows, rows_supported
from .fp8_weights import Fp8Linear


def _diffusers_classes():
    from diffusers.models.activations import GELU
    from diffusers.models.attention import FeedForward
    return FeedForward, GELU


def _hooked(module: torch.nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def eligible(ff: torch.nn.Module) -> bool:
    """Whether ``ff`` is a ``FeedForward`` the fused forward may take over (module docstring)."""
    feed_forward, gelu = _diffusers_classes()
    if type(ff) is not feed_forward or "forward" in ff.__dict__ or len(ff.net) != 3:
        return False
    act, drop, out = ff.net
    return (type(act) is gelu and act.approximate == "tanh" and isinstance(drop, torch.nn.Dropout)
            and isinstance(out, Fp8Linear) and out.fp8_fast and out.in_features <= MAX_ROW)


def layers_ready(ff: torch.nn.Module) -> bool:
    """The layers' half of ``fused_now``: the output layer still fp8-fast, neither it nor the GELU module hooked,
    the dropout inactive."""
    act, drop, out = ff.net
    return (getattr(out, "fp8_fast", False) and not (drop.training and drop.p > 0)
            and not _hooked(act) and not _hooked(out))


def fused_now(ff: torch.nn.Module, x: torch.Tensor) -> bool:
    """Whether this call of an installed ``ff`` takes the fused path (module docstring)."""
    return (x.is_cuda and x.dtype == FAST_OUT_DTYPE and x.numel() > 0
            and not (torch.is_grad_enabled() and x.requires_grad) and layers_ready(ff))


def fused_forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The ``FeedForward`` forward with the GELU and the output layer's quantization in one pass, where
    ``fused_now``; diffusers' own forward otherwise."""
    if args or kwargs or not fused_now(self, hidden_states):
        return type(self).forward(self, hidden_states, *args, **kwargs)
    act, _, out = self.net
    h = act.proj(hidden_states)
    q, scale = fp8_rows_op(h.reshape(-1, h.shape[-1]).contiguous(), True)
    y = fp8_linear_rows(q, scale, out.weight_fp8.view(FP8_DTYPE), out.scale_tensor(), out.bias)
    return y.view(*h.shape[:-1], y.shape[-1])


def fuse_feedforwards(module: torch.nn.Module, device) -> int:
    """Install ``fused_forward`` on every eligible ``FeedForward`` of ``module``; how many (0 where ``device`` has no
    per-row fp8 GEMM or cannot run Triton)."""
    candidates = [m for m in module.modules() if eligible(m)]
    if not candidates or not rows_supported(device) or triton_unusable_reason(torch.device(device)) is not None:
        return 0
    for ff in candidates:
        ff.forward = types.MethodType(fused_forward, ff)
    return len(candidates)


def is_fused(ff: torch.nn.Module) -> bool:
    """Whether ``ff`` carries the fused forward."""
    forward = ff.__dict__.get("forward")
    return isinstance(forward, types.MethodType) and forward.__func__ is fused_forward

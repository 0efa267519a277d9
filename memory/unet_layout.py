"""The UNet's activation layout: channels-last (NHWC) where it is faster on the GPU, the caller's layout outside.

Invariants
- Layout never changes a value: every op of the UNet computes the same numbers whatever its operands' strides
  (convolutions, the GroupNorm kernels of both layouts, elementwise ops, ``cat``, nearest upsampling), so the
  choice is free to follow speed alone. ``LeanEngine.unet`` feeds the UNet ``unet_input(x)`` and returns its
  output contiguous: callers see the layout they always saw.
- ``use_channels_last(unet, x)`` is True exactly for a diffusers ``UNet2DConditionModel`` called on a 4-D CUDA
  latent of at least ``MIN_CHANNELS_LAST_CELLS`` latent cells (batch x height x width) when the GroupNorm kernels
  run there (PyTorch's own channels-last GroupNorm costs more than the transposes saved), unless
  ``LEANDIFFUSION_UNET_LAYOUT`` says ``contiguous`` (never) or ``channels_last`` (always on CUDA).
- Inside ``layout_following_transformers(unet)`` each continuous-input ``Transformer2DModel`` of ``unet`` returns its
  output in its residual's layout (diffusers makes it contiguous, which would turn a channels-last UNet back to
  NCHW at every transformer); for a contiguous residual that is diffusers' own computation. The override is one
  shared function bound per module and leaves the module's ``__dict__`` when the block ends; a ``forward`` or
  output method another library installed is left alone.
- Weights keep their layout: cuDNN reads a channels-last convolution's NCHW weight through one transpose of the
  weight per call, and the benchmarks' peers that share the UNet see it unchanged.

Why: cuDNN runs convolutions in NHWC; fed NCHW activations it transposes every input and output (2.3 ms of an
SDXL 1024 px step of 36 ms on an H200). Channels-last activations trade that for one transpose of each 3x3 weight
(0.9 ms there); below ``MIN_CHANNELS_LAST_CELLS`` that trade is unmeasured, so small latents stay NCHW.
"""
from __future__ import annotations

import contextlib
import os
import types
import weakref
from typing import Iterator

import torch

from ..kernels import dispatch

ENV_LAYOUT = "LEANDIFFUSION_UNET_LAYOUT"
LAYOUTS = ("auto", "channels_last", "contiguous")
MIN_CHANNELS_LAST_CELLS = 2 * 64 * 64  # latent cells (batch x height x width): the smallest measured win (SD1.5 512 px)
OVERRIDE = "_get_output_for_continuous_inputs"  # the diffusers method that makes a transformer's output contiguous


def layout_choice() -> str:
    """``LEANDIFFUSION_UNET_LAYOUT`` (default ``auto``), checked."""
    value = os.environ.get(ENV_LAYOUT, "auto").strip().lower() or "auto"
    if value not in LAYOUTS:
        raise ValueError(f"{ENV_LAYOUT}={value!r}: expected one of {LAYOUTS}")
    return value


def _is_unet2d(unet: torch.nn.Module) -> bool:
    return type(unet).__name__ == "UNet2DConditionModel"


def use_channels_last(unet: torch.nn.Module, x: torch.Tensor) -> bool:
    """Whether ``unet`` runs channels-last on the latent ``x`` (module docstring)."""
    choice = layout_choice()
    if choice == "contiguous" or not (x.is_cuda and x.dim() == 4 and _is_unet2d(unet)):
        return False
    if choice == "channels_last":
        return True
    cells = x.shape[0] * x.shape[2] * x.shape[3]
    return cells >= MIN_CHANNELS_LAST_CELLS and dispatch.triton_unusable_reason(x.device) is None


def unet_input(unet: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x`` in the layout ``unet`` runs fastest in (a copy only when the layout changes)."""
    if use_channels_last(unet, x):
        return x.contiguous(memory_format=torch.channels_last)
    return x


def _output_in_residual_layout(self, hidden_states, residual, batch_size, height, width, inner_dim):
    """diffusers' ``Transformer2DModel._get_output_for_continuous_inputs`` with the output in ``residual``'s layout."""
    channels_last = residual.dim() == 4 and not residual.is_contiguous() \
        and residual.is_contiguous(memory_format=torch.channels_last)
    layout = torch.channels_last if channels_last else torch.contiguous_format
    if not self.use_linear_projection:
        hidden_states = hidden_states.reshape(batch_size, height, width, inner_dim).permute(0, 3, 1, 2)
        hidden_states = self.proj_out(hidden_states.contiguous(memory_format=layout))
    else:
        hidden_states = self.proj_out(hidden_states)
        hidden_states = hidden_states.reshape(batch_size, height, width, inner_dim).permute(0, 3, 1, 2)
        hidden_states = hidden_states.contiguous(memory_format=layout)
    return hidden_states + residual


_TRANSFORMERS: "weakref.WeakKeyDictionary[torch.nn.Module, list]" = weakref.WeakKeyDictionary()


def _transformers(unet: torch.nn.Module) -> list:
    """``(module, bound override)`` for each continuous-input ``Transformer2DModel`` of ``unet`` (found once)."""
    if unet not in _TRANSFORMERS:
        found = [m for m in unet.modules() if type(m).__name__ == "Transformer2DModel"
                 and getattr(m, "is_input_continuous", False) and callable(getattr(type(m), OVERRIDE, None))]
        _TRANSFORMERS[unet] = [(m, types.MethodType(_output_in_residual_layout, m)) for m in found]
    return _TRANSFORMERS[unet]


@contextlib.contextmanager
def layout_following_transformers(unet: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Inside the block ``unet``'s transformers keep their residual's layout (module docstring); sessions nest."""
    installed = []
    try:
        for module, bound in _transformers(unet):
            if OVERRIDE not in module.__dict__ and "forward" not in module.__dict__:
                module.__dict__[OVERRIDE] = bound
                installed.append((module, bound))
        yield unet
    finally:
        for module, bound in installed:
            if module.__dict__.get(OVERRIDE) is bound:
                del module.__dict__[OVERRIDE]

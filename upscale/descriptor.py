"""``Upscaler``: a loaded super-resolution network plus the facts the tiled runner needs about it.

Invariant: an ``Upscaler`` is immutable and its module is never changed by the runner (the runner moves a copy to
the device). ``call(module, x, work_bytes)`` maps a [1, C, h, w] tensor to [1, C_out, h*scale, w*scale] and may
split internal work so that its temporaries stay near ``work_bytes``.

Memory model: running a window of ``h*w`` input pixels in a dtype of ``b`` bytes needs about
``bytes_per_px * b * h * w`` bytes of activations (the largest set of simultaneously live tensors, counted in
channels at input resolution); the runner sizes tiles from it. ``channels_last`` marks networks whose every op
keeps NHWC tensors (plain convolutions, activations, concatenation, nearest upsampling, pixel shuffles): the
runner's ``layout="auto"`` runs those channels-last, which cuDNN (tensor cores) and oneDNN execute without the
per-layer NCHW<->NHWC transposes and their workspace.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn


def _plain_call(module: nn.Module, x: torch.Tensor, work_bytes: int) -> torch.Tensor:
    return module(x)


@dataclass(frozen=True)
class Upscaler:
    module: nn.Module
    arch: str
    scale: int
    in_channels: int = 3
    out_channels: int = 3
    min_size: int = 1  # smallest height/width the model accepts
    multiple_of: int = 1  # window sides are aligned to this (pixel-unshuffle factor)
    supports_half: bool = True
    supports_bf16: bool = True
    context: Optional[int] = None  # receptive-field radius in input pixels when finite and small, else None
    bytes_per_px: float = 1152.0  # activation channels live at once per input pixel (times element size)
    channels_last: bool = False  # layout="auto" runs it channels-last (faster on cuDNN and oneDNN, same numbers)
    default_output_scale: Optional[float] = None  # what output_scale=0 means (None: the net's scale)
    call: Callable[[nn.Module, torch.Tensor, int], torch.Tensor] = field(default=_plain_call, repr=False)
    tags: tuple = ()

    @property
    def native_output_scale(self) -> float:
        return float(self.default_output_scale) if self.default_output_scale else float(self.scale)

    def param_count(self) -> int:
        return sum(p.numel() for p in self.module.parameters())

    def weight_bytes(self, dtype: torch.dtype) -> int:
        return self.param_count() * torch.empty((), dtype=dtype).element_size()

    def work_bytes(self, h: int, w: int, dtype: torch.dtype) -> int:
        """Estimated activation bytes for one ``h x w`` window (input plus output staging included)."""
        b = torch.empty((), dtype=dtype).element_size()
        staging = (self.in_channels + self.out_channels * self.scale ** 2) * b
        return int((self.bytes_per_px * b + staging) * h * w)

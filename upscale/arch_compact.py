"""SRVGGNetCompact (Real-ESRGAN's compact model: realesr-general-x4v3, realesr-animevideov3).

Network, with ``body`` an ``nn.ModuleList`` so the keys are ``body.0.weight`` ... ``body.{2K+2}.bias``::

    h = prelu_0(conv_0(x));  h = prelu_k(conv_k(h)) for k = 1..K;  r = conv_last(h)   (3x3 convs, padding 1)
    y = pixel_shuffle(r, s) + nearest_upsample(x, s)                                 (out channels == in channels)

realesr-animevideov3 is K = 16, F = 64, s = 4; realesr-general-x4v3 is K = 32, F = 64, s = 4. The receptive field
radius is K + 2 input pixels, which is what makes tiles with that much context exact.

Hand-written because the project imports no upscaler library at run time (spandrel is optional); the math is
Real-ESRGAN's ``SRVGGNetCompact`` with PReLU activations (the only ones the published weights use).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SRVGGNetCompact(nn.Module):
    """Compact VGG-style super-resolution network; see the module docstring."""

    def __init__(self, num_in_ch: int = 3, num_out_ch: int = 3, num_feat: int = 64, num_conv: int = 16,
                 upscale: int = 4):
        super().__init__()
        if num_out_ch != num_in_ch:
            raise ValueError(f"num_out_ch={num_out_ch} != num_in_ch={num_in_ch}: the compact net adds a nearest "
                             f"upsample of its input, so both must be equal")
        self.num_in_ch = num_in_ch
        self.num_out_ch = num_out_ch
        self.num_conv = num_conv
        self.scale = upscale
        layers: list[nn.Module] = [nn.Conv2d(num_in_ch, num_feat, 3, 1, 1), nn.PReLU(num_parameters=num_feat)]
        for _ in range(num_conv):
            layers += [nn.Conv2d(num_feat, num_feat, 3, 1, 1), nn.PReLU(num_parameters=num_feat)]
        layers.append(nn.Conv2d(num_feat, num_out_ch * upscale * upscale, 3, 1, 1))
        self.body = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x
        for layer in self.body:
            out = layer(out)
        out = F.pixel_shuffle(out, self.scale)
        return out.add_(F.interpolate(x, scale_factor=self.scale, mode="nearest"))

"""The denoiser's streamable units, whatever its architecture: one entry point for planners and streamers.

Invariant: ``trace_units`` returns the units of a UNet (``unet_units``) or of a DiT (Z-Image's: ``dit_units``;
Qwen-Image's: ``qwen_units``) in execution order, each with its flat size in ``dtype``, its FLOPs and its output
size at ``working_shape`` (for Qwen-Image also beside ``reference_images`` reference latents and with
``text_tokens`` prompt rows per call when given; other denoisers take neither).
"""
from __future__ import annotations

from typing import Optional

import torch

from .dit_units import is_zimage_transformer, trace_dit_units
from .qwen_units import is_qwen_image_transformer, trace_qwen_image_units
from .unet_units import Unit, trace_unet_units


def trace_units(denoiser: torch.nn.Module, working_shape: tuple[int, int, int], dtype: torch.dtype,
                reference_images: int = 0, text_tokens: Optional[int] = None) -> list[Unit]:
    """Units of ``denoiser`` (the ``unet`` slot of ``ModelParts``) at ``working_shape`` = (batch, latent h, w)."""
    if is_zimage_transformer(denoiser):
        return trace_dit_units(denoiser, working_shape, dtype)
    if is_qwen_image_transformer(denoiser):
        return trace_qwen_image_units(denoiser, working_shape, dtype, reference_images, text_tokens)
    return trace_unet_units(denoiser, working_shape, dtype)

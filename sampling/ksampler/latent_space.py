"""Raw VAE latents (a LATENT) <-> the model space the Fused KSampler samples in, per family (ComfyUI's latent
formats' ``process_in`` / ``process_out``).

- One scale and shift (SD families, Z-Image): ``(raw - shift) * scale`` and back ``x / scale + shift``.
- Per-channel statistics in the VAE config (Qwen-Image's ``latents_mean`` / ``latents_std``, ComfyUI's Wan 2.1
  format with scale factor 1): ``(raw - mean) / std`` and back ``x * std + mean`` (``qwen.latents``).
- ComfyUI's Qwen-Image LATENT is ``[B, 16, 1, h, w]`` (one frame): read as ``[B, 16, h, w]`` and given back in the
  layout it came in.
Invariant: ``to_raw(to_model(raw))`` is ``raw`` up to float32 rounding, and an all-zero LATENT stays zero (ComfyUI's
``inner_sample`` leaves an empty latent unprocessed; the caller decides).
"""
from __future__ import annotations

from typing import Any

import torch

from ..qwen.latents import to_model, to_raw
from ..qwen.start import frames_squeezed


def _per_channel(parts) -> bool:
    return getattr(parts.vae.config, "latents_mean", None) is not None


def to_model_space(parts, raw: torch.Tensor) -> torch.Tensor:
    if _per_channel(parts):
        return to_model(raw, parts.vae)
    return (raw - parts.vae_shift_factor) * parts.vae_scaling_factor


def to_raw_space(parts, x: torch.Tensor) -> torch.Tensor:
    if _per_channel(parts):
        return to_raw(x, parts.vae)
    return x.float() / parts.vae_scaling_factor + parts.vae_shift_factor


def four_d(latent_image: Any) -> tuple[Any, bool]:
    """``(the LATENT with [B, C, h, w] samples, whether they came as ComfyUI's one-frame [B, C, 1, h, w])``."""
    squeezed = frames_squeezed(latent_image)
    return squeezed, squeezed is not latent_image


def as_given(samples: torch.Tensor, framed: bool) -> torch.Tensor:
    """``[B, C, h, w]`` samples back in the input's layout."""
    return samples.unsqueeze(2) if framed else samples

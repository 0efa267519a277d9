"""Qwen-Image latent layouts: raw VAE latents ``[B, 16, h, w]`` <-> the transformer's packed 2x2 patches
``[B, h/2 * w/2, 64]``, and the per-channel normalisation between raw and model space.

Invariants
- ``pack`` orders each patch's 64 features channel-major then (row, column) inside the patch, and the patches
  row-major, as ``QwenImagePipeline`` packs its noise; ``unpack`` is its exact inverse.
- Model space is ``(raw - latents_mean) / latents_std`` per channel with the VAE config's two 16-value lists
  (``AutoencoderKLQwenImage`` has no scalar scaling factor); a LATENT holds raw latents (ComfyUI's convention).

Why hand-written: the pipeline's packing helpers are private static methods of ``QwenImagePipeline``, not an API.
"""
from __future__ import annotations

import torch

PATCH = 2


def pack(latents: torch.Tensor) -> torch.Tensor:
    """``[B, C, h, w]`` -> ``[B, (h/2) (w/2), 4 C]``."""
    b, c, h, w = latents.shape
    x = latents.reshape(b, c, h // PATCH, PATCH, w // PATCH, PATCH).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // PATCH) * (w // PATCH), c * PATCH * PATCH)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """``[B, (h/2) (w/2), 4 C]`` -> ``[B, C, h, w]`` (inverse of :func:`pack`)."""
    b, _, features = tokens.shape
    c = features // (PATCH * PATCH)
    x = tokens.reshape(b, h // PATCH, w // PATCH, c, PATCH, PATCH).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, h, w)


def channel_stats(vae: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean, std)`` as float32 ``[1, C, 1, 1]`` tensors from the VAE config's ``latents_mean`` / ``latents_std``."""
    mean = torch.tensor(vae.config.latents_mean, dtype=torch.float32).view(1, -1, 1, 1)
    std = torch.tensor(vae.config.latents_std, dtype=torch.float32).view(1, -1, 1, 1)
    return mean, std


def to_raw(model_latents: torch.Tensor, vae: torch.nn.Module) -> torch.Tensor:
    """Model-space ``[B, C, h, w]`` -> raw VAE latents (float32): ``latent * std + mean`` per channel."""
    mean, std = channel_stats(vae)
    return model_latents.float() * std.to(model_latents.device) + mean.to(model_latents.device)


def to_model(raw: torch.Tensor, vae: torch.nn.Module) -> torch.Tensor:
    """Raw VAE latents -> model space (float32): ``(raw - mean) / std`` per channel (inverse of :func:`to_raw`)."""
    mean, std = channel_stats(vae)
    return (raw.float() - mean.to(raw.device)) / std.to(raw.device)

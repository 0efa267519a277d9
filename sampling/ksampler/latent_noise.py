"""ComfyUI's starting noise for a LATENT (``comfy.sample.prepare_noise`` and ``fix_empty_latent_channels``, as
``nodes.common_ksampler`` applies them before KSampler).

- ``prepare_noise``: a CPU generator seeded with ``seed`` draws float32 normal noise for the whole latent shape; with
  a ``batch_index`` it draws one ``[1, ...]`` sample per index ``0..max(batch_index)`` in turn and row ``i`` takes
  draw ``batch_index[i]`` (so a latent split off a batch gets the rows it had in the batch).
- ``fix_empty_latent_channels``: an all-zero latent whose channel count is not the model's (an SD EmptyLatentImage
  fed to Z-Image) becomes zeros of the model's channel count; any other latent is returned as it is.
Invariant: the noise equals ComfyUI's bit for bit for the same latent shape, seed and batch_index, and no global
random state is touched (ComfyUI seeds torch's default generator; a private generator draws the same numbers).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..latent_input import batch_index_of, initial_noise
from ..settings import MAX_SEED, check_int


def _check_latent(latent) -> None:
    if not isinstance(latent, torch.Tensor) or latent.ndim < 2 or not latent.is_floating_point():
        raise ValueError(f"latent: expected a float tensor [B, C, ...], got "
                         f"{getattr(latent, 'shape', type(latent).__name__)}")


def prepare_noise(latent: torch.Tensor, seed: int, batch_index: Optional[Sequence[int]] = None) -> torch.Tensor:
    """The run's starting noise for ``latent`` (float32, CPU, shaped like ``latent``; module docstring)."""
    _check_latent(latent)
    check_int("seed", seed, 0, MAX_SEED)
    rows = int(latent.shape[0])
    if batch_index is not None:
        batch_index = batch_index_of({"samples": latent, "batch_index": batch_index}, rows, rows)
    return initial_noise(tuple(latent.shape), torch.Generator(device="cpu").manual_seed(seed), batch_index)


def fix_empty_latent_channels(latent: torch.Tensor, channels: int) -> torch.Tensor:
    """Zeros of ``channels`` channels for an all-zero latent of another channel count; else ``latent`` itself."""
    _check_latent(latent)
    check_int("channels", channels, 1, 1 << 16)
    if latent.shape[1] != channels and torch.count_nonzero(latent) == 0:
        return latent.new_zeros((latent.shape[0], channels) + tuple(latent.shape[2:]))
    return latent

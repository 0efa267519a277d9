"""The Fused DDIM Sampler's latent input: the LATENT's checks, its repetition to the batch, ComfyUI's
``batch_index`` rule and the starting noise.

Invariants
- A LATENT is refused, naming ``latent_image``, before anything is allocated for it when it is not a float
  ``[B, C, h, w]`` of this model's channels, when its pixel size exceeds the sampler's ``MAX_SIDE_PX`` per side (the
  width/height widgets' limit), or when the noise its ``batch_index`` asks for cannot fit in host memory.
- ``initial_noise``: one draw of the whole batch shape, or with a ``batch_index`` one ``[1, C, h, w]`` draw per index
  ``0..max`` with row ``i`` taking draw ``batch_index[i]`` (ComfyUI's ``comfy.sample.prepare_noise``).

Why a module of its own: these are the rules of ComfyUI's LATENT convention, apart from the loop that samples.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ..memory.engine import LeanEngine
from ..memory.finite import refuse_non_finite_input
from ..memory.host_memory import check_host_bytes
from .settings import MAX_SIDE_PX


def check_latent_size(shape: tuple, factor: int, batch_size: int) -> None:
    """Refuse a latent whose pixel size exceeds ``MAX_SIDE_PX`` per side, or whose batch does not fit the host."""
    b, c, h, w = shape
    if max(h, w) * factor > MAX_SIDE_PX:
        raise ValueError(f"latent_image is {w}x{h} ({w * factor}x{h * factor} px); the sampler takes at most "
                         f"{MAX_SIDE_PX} px per side (the width/height limit): downscale the latent, or sample at "
                         f"a smaller size and upscale the image")
    rows = max(b, batch_size)
    check_host_bytes(3 * rows * c * h * w * 4, "latent_image", f"a batch of {rows} latents of {w}x{h}",
                     "lower batch_size or the latent's batch")


def check_latent(engine: LeanEngine, latent_image: Any) -> torch.Tensor:
    if not isinstance(latent_image, dict) or "samples" not in latent_image:
        raise TypeError("latent_image: expected a LATENT dict with a 'samples' tensor (as VAEEncode or "
                        f"EmptyLatentImage give), got {type(latent_image).__name__}")
    if latent_image.get("noise_mask") is not None:
        raise ValueError("latent_image has a 'noise_mask' (inpainting); the pack's samplers do not inpaint - "
                         "remove the SetLatentNoiseMask node or use ComfyUI's KSampler")
    samples = latent_image["samples"]
    if not isinstance(samples, torch.Tensor) or samples.ndim != 4 or not samples.is_floating_point():
        raise ValueError(f"latent_image['samples']: expected a float tensor [B, C, h, w], got "
                         f"{getattr(samples, 'shape', type(samples).__name__)}")
    refuse_non_finite_input(samples, "latent_image", "find the node upstream that produced them (a diverged "
                            "sampler, an fp16 VAE overflow) or re-encode the image")
    channels = engine.parts.latent_channels
    if samples.shape[1] != channels:
        raise ValueError(f"latent_image has {samples.shape[1]} channels but this model's VAE uses {channels}; "
                         f"encode the image with this model's VAE (or use a latent made for this model family)")
    if samples.shape[0] < 1 or samples.shape[2] < 1 or samples.shape[3] < 1:
        raise ValueError(f"latent_image['samples'] is empty: shape {tuple(samples.shape)}")
    return samples


def batch_latents(samples: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Repeat an input latent batch to ``max(batch_size, B)`` rows (diffusers' img2img rule: a multiple of B)."""
    b = samples.shape[0]
    total = max(batch_size, b)
    if total % b:
        raise ValueError(f"batch_size={batch_size} is not a multiple of the latent_image batch ({b}); use a "
                         f"multiple of {b} or batch_size=1 to sample the latent batch as it is")
    return torch.cat([samples] * (total // b)) if total > b else samples


def batch_index_of(latent_image: dict, rows: int, total: int) -> Optional[list]:
    """The LATENT's ``batch_index`` (one non-negative int per row), repeated to ``total`` rows the way ComfyUI's
    Repeat Latent Batch extends it; ``None`` when the LATENT has none."""
    index = latent_image.get("batch_index")
    if index is None:
        return None
    if isinstance(index, torch.Tensor):
        index = index.tolist()
    if not isinstance(index, (list, tuple)) or len(index) != rows \
            or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in index):
        raise ValueError(f"latent_image['batch_index'] = {index!r}: expected {rows} non-negative ints, one per "
                         f"latent row (as Latent From Batch writes it); remove the key or rebuild the latent")
    index = list(index)
    check_host_bytes(4 * (max(index) + 1) * latent_image["samples"][0].numel(), "latent_image['batch_index']",
                     f"the noise draws up to batch index {max(index)}",
                     "use batch indices near the batch size (Latent From Batch writes 0..B-1)")
    offset = max(index) - min(index) + 1
    return index + [i + k * offset for k in range(1, total // rows) for i in index]


def initial_noise(shape: tuple, generator: torch.Generator, batch_index: Optional[list] = None) -> torch.Tensor:
    """The run's starting noise (float32, CPU): one draw of the whole ``shape``, or with a ``batch_index`` one
    ``[1, C, h, w]`` draw per index ``0..max`` with row ``i`` taking draw ``batch_index[i]`` (ComfyUI's
    ``comfy.sample.prepare_noise``)."""
    if batch_index is None:
        return torch.randn(shape, generator=generator, dtype=torch.float32)
    draws = [torch.randn((1,) + tuple(shape[1:]), generator=generator, dtype=torch.float32)
             for _ in range(max(batch_index) + 1)]
    return torch.cat([draws[i] for i in batch_index])

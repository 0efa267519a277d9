"""Where a Qwen-Image flow run starts: the seed's noise (text-to-image) or a LATENT part-way down the schedule
(img2img), with the Fused Flow Sampler's meaning of ``denoise``, the one it has for Z-Image.

Invariants
- Noise: one ``torch.Generator("cpu").manual_seed(seed)`` draw of the whole ``[B, 16, h, w]`` float32 shape, or
  ComfyUI's per-``batch_index`` draws for a LATENT that carries one (``latent_input.initial_noise``).
- Sigmas: ``flow.schedule.flow_sigmas`` (``QwenImagePipeline``'s for ``denoise`` 1); ``denoise`` < 1 keeps the last
  ``steps + 1`` sigmas of an ``int(steps / denoise)``-step schedule (ComfyUI's rule) and starts from
  ``sigma0 noise + (1 - sigma0) x0``, ``x0`` the LATENT (an all-zero one when none is connected) in model space,
  ``(raw - latents_mean) / latents_std``: ``QwenImageImg2ImgPipeline``'s start for ``strength = steps / total``.
- A LATENT is ``[B, 16, h, w]``, or ComfyUI's Qwen-Image layout ``[B, 16, 1, h, w]`` (one frame, the Wan 2.1
  latent format), read as ``[B, 16, h, w]``; its rows repeat to ``batch_size`` (a multiple of its batch); with
  ``denoise`` 1 it only sets the size, as for Z-Image.

Why its own module: the loop's denoise steps are rewritten elsewhere; where a run starts is a separate concern.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ...memory.engine import LeanEngine
from ..flow.schedule import flow_sigmas
from ..flow.settings import FlowSettings
from ..latent_input import batch_index_of, batch_latents, check_latent, check_latent_size, initial_noise
from ..loop import vae_scale_factor
from .latents import PATCH, to_model


def frames_squeezed(latent_image: Any) -> Any:
    """A LATENT whose ``samples`` are ``[B, C, 1, h, w]`` (ComfyUI's Qwen-Image layout) as ``[B, C, h, w]``; any
    other value as it is (``latent_input.check_latent`` judges it)."""
    if isinstance(latent_image, dict) and isinstance(latent_image.get("samples"), torch.Tensor):
        samples = latent_image["samples"]
        if samples.ndim == 5 and samples.shape[2] == 1:
            return {**latent_image, "samples": samples[:, :, 0]}
    return latent_image


def qwen_start(engine: LeanEngine, s: FlowSettings, latent_image: Optional[dict]
               ) -> tuple[torch.Tensor, torch.Tensor, Optional[list]]:
    """``(x [B, 16, h, w] float32 model space on the CPU at sigmas[0], sigmas [steps + 1], batch_index or None)``
    for validated settings ``s`` (module docstring)."""
    factor = vae_scale_factor(engine)
    init, batch_index = None, None
    if latent_image is not None:
        latent_image = frames_squeezed(latent_image)
        rows = check_latent(engine, latent_image)
        check_latent_size(tuple(rows.shape), factor, s.batch_size)
        if rows.shape[2] % PATCH or rows.shape[3] % PATCH:
            raise ValueError(f"latent_image is {rows.shape[3]}x{rows.shape[2]} latent cells; Qwen-Image takes 2x2 "
                             f"patches, so both must be even (images a multiple of 16 px): crop or resize the image")
        init = batch_latents(rows.float().cpu(), s.batch_size)
        batch_index = batch_index_of(latent_image, rows.shape[0], init.shape[0])
        shape = tuple(init.shape)
    else:
        shape = (s.batch_size, engine.parts.latent_channels, s.height // factor, s.width // factor)
    img2img = s.denoise < 1.0
    sigmas = flow_sigmas(engine.parts.scheduler_config, s.steps, shape[2], shape[3], s.denoise if img2img else 1.0)
    x = initial_noise(shape, torch.Generator("cpu").manual_seed(s.seed), batch_index)
    if img2img:
        x0 = to_model(init if init is not None else torch.zeros(shape), engine.parts.vae)
        x = sigmas[0] * x + (1.0 - sigmas[0]) * x0
    return x, sigmas, batch_index

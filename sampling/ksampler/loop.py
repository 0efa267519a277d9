"""The Fused KSampler: ComfyUI's KSampler (``nodes.common_ksampler`` -> ``comfy.samplers.KSampler``) on the engine.

Invariants (what makes the LATENT equal core KSampler's for the same CONDITIONING, seed, steps, cfg and denoise):
- Latent: an all-zero LATENT of another channel count becomes zeros of the model's (``fix_empty_latent_channels``);
  a non-zero one is moved into model space (``latent_space.to_model_space``: ``(x - shift) * scale``, per channel
  for Qwen-Image), an all-zero one is left at zero, as ComfyUI's ``inner_sample`` does; the result goes back with
  ``latent_space.to_raw_space``, in the layout it came in (ComfyUI's one-frame Qwen-Image LATENT included).
- Sigmas: ``schedulers.sigmas_for`` (ComfyUI's scheduler, its penultimate-sigma rule and its denoise rule); no
  sigmas (denoise 0) returns the LATENT unchanged.
- Noise: ComfyUI's ``prepare_noise`` (``latent_input.initial_noise``), scaled by the model sampling's ``noise_scaling`` at the
  first sigma with ComfyUI's ``max_denoise`` rule; the sampler's own per-step noise comes from ``registry``.
- The model call is ``denoiser.DenoiserProgram`` (captured as one CUDA graph per shape with ``cuda_graph``); the
  sampler functions do the rest, in float32 on the engine's device. The result is ``inverse_noise_scaling``'d at
  the last sigma.
- Every model call runs inside ``engine.session("unet")``; interruption is checked before each call, the progress
  bar advances per sampler step.

Why hand-written rather than calling ComfyUI (the tests' reference): the pack runs outside ComfyUI too, on its own
engine (placements, streaming, captured graphs), and ComfyUI's code never enters the project.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from ... import bridge
from ...memory.engine import LeanEngine
from ...memory.families import check_node_runs
from ..graph_runner import GraphRunner
from ..latent_input import batch_index_of, check_latent, check_latent_size, initial_noise
from ..loop import vae_scale_factor
from ..qwen.latents import PATCH
from ..qwen.loop import is_qwen_image
from .latent_space import as_given, four_d, to_model_space, to_raw_space
from .model_sampling import max_denoise, model_sampling_for
from .prepare import prepare_denoiser
from .qwen_call import check_qwen_inputs
from .registry import noise_sampler_for, sampler_spec
from .schedulers import sigmas_for
from .settings import KSamplerSettings

logger = logging.getLogger(__name__)


def check_engine(engine: Any) -> LeanEngine:
    if not isinstance(engine, LeanEngine):
        raise TypeError(f"lean_model: expected a LEAN_MODEL from a Memory Pool Loader, got {type(engine).__name__}")
    check_node_runs(engine.family, "Fused KSampler")
    return engine


def _latent_rows(engine: LeanEngine, latent_image: Any) -> torch.Tensor:
    """The LATENT's samples, with ComfyUI's empty-latent channel fix, checked (``latent_input.check_latent``)."""
    if isinstance(latent_image, dict) and isinstance(latent_image.get("samples"), torch.Tensor):
        rows = latent_image["samples"]
        channels = engine.parts.latent_channels
        if rows.ndim == 4 and rows.shape[1] != channels and rows.is_floating_point() \
                and torch.count_nonzero(rows) == 0:
            latent_image = {**latent_image, "samples": rows.new_zeros(rows.shape[0], channels, *rows.shape[2:])}
    rows = check_latent(engine, latent_image)
    check_latent_size(tuple(rows.shape), vae_scale_factor(engine), int(rows.shape[0]))
    if is_qwen_image(engine) and (rows.shape[2] % PATCH or rows.shape[3] % PATCH):
        raise ValueError(f"latent_image is {rows.shape[3]}x{rows.shape[2]} latent cells; Qwen-Image takes 2x2 "
                         f"patches, so both must be even (images a multiple of 16 px): crop or resize the image")
    return rows.float().cpu()


def sample_k(engine: LeanEngine, settings: KSamplerSettings, latent_image: Any, positive: Any = None,
             negative: Any = None, runner: Optional[GraphRunner] = None, quiet: bool = False) -> dict:
    """Run the sampler; returns the LATENT dict (``samples`` raw VAE space float32 on the CPU, other keys kept)."""
    check_engine(engine)
    s = settings.validated()
    spec = sampler_spec(s.sampler_name)
    latent_image, framed = four_d(latent_image)
    rows = _latent_rows(engine, latent_image)
    parts = engine.parts
    sampling = model_sampling_for(engine)
    sigmas = sigmas_for(sampling, s.scheduler, s.steps, s.denoise, s.sampler_name)
    out = dict(latent_image)
    if sigmas.numel() == 0:
        out["samples"] = as_given(rows, framed)
        return out
    batch_index = batch_index_of(latent_image, rows.shape[0], rows.shape[0])
    noise = initial_noise(tuple(rows.shape), torch.Generator(device="cpu").manual_seed(s.seed), batch_index)
    latent = to_model_space(parts, rows) if torch.count_nonzero(rows) > 0 else rows
    if is_qwen_image(engine):
        check_qwen_inputs(engine, s, int(rows.shape[0]), positive, negative)
    bridge.check_interrupted()
    device = engine.device
    with engine.session("unet"), torch.no_grad():
        sigmas_dev = sigmas.to(device)
        x = sampling.noise_scaling(sigmas_dev[0], noise.to(device), latent.to(device),
                                   max_denoise(sampling, sigmas_dev))
        denoiser, release = prepare_denoiser(engine, s, x, sigmas_dev, positive, negative, sampling, runner)
        try:
            noise_sampler = noise_sampler_for(spec, x, sigmas_dev, s.seed, sampling)
            with bridge.ProgressBar(sigmas.numel() - 1, desc=f"Fused KSampler ({s.sampler_name})",
                                    quiet=quiet) as bar:
                x = spec.fn(denoiser, x, sigmas_dev, sampling=sampling, noise_sampler=noise_sampler,
                            callback=lambda i, x_i, d_i: bar.update(1))
            x = sampling.inverse_noise_scaling(sigmas_dev[-1], x)
        finally:
            release()
    out["samples"] = as_given(to_raw_space(parts, x.float().cpu()), framed)
    return out

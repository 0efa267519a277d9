"""Flow-matching sigma schedules for the Fused Flow Sampler, from the model's own scheduler config.

Invariants
- ``flow_sigmas(config, steps, latent_h, latent_w, denoise)`` returns ``steps + 1`` float32 sigmas, decreasing,
  ending at 0: for ``denoise == 1`` exactly the sigmas ``ZImagePipeline`` steps through (Z-Image's default
  ``linspace(1, 1/steps, steps)`` through diffusers' ``FlowMatchEulerDiscreteScheduler.set_timesteps`` with the
  config's static or resolution-dependent shift, then the terminal 0).
- A schedule with a terminal stretch (``shift_terminal``, Qwen-Image) needs at least 2 steps: at one the stretch is
  0 / 0 (diffusers' pipelines return NaN there); it is refused naming ``steps``.
- ``denoise < 1`` follows ComfyUI's rule (``comfy.samplers.KSampler.set_steps``): build the schedule for
  ``int(steps / denoise)`` steps and keep its last ``steps + 1`` sigmas, so img2img starts part-way down.
- The DiT's timestep input is ``(1000 - 1000 sigma) / 1000`` in float32, computed as the pipeline does it, so
  fp32 runs match it to the last bit of the timestep embedding.

Why diffusers' scheduler: it owns the shift rules (static ``shift``, ``use_dynamic_shifting`` with ``mu`` from the
image sequence length); repeating them here could drift from the config a model ships.
"""
from __future__ import annotations

import math

import torch

TRAIN_TIMESTEPS = 1000.0


def _mu(config: dict, image_seq_len: int) -> float:
    """The pipeline's ``calculate_shift``: linear in the image token count between the config's two anchors."""
    base_len, max_len = config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096)
    base_shift, max_shift = config.get("base_shift", 0.5), config.get("max_shift", 1.15)
    slope = (max_shift - base_shift) / (max_len - base_len)
    return image_seq_len * slope + (base_shift - slope * base_len)


def flow_sigmas(config: dict, steps: int, latent_h: int, latent_w: int, denoise: float = 1.0) -> torch.Tensor:
    """``steps + 1`` float32 sigmas (module docstring)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r}: expected a positive int")
    if not isinstance(denoise, (int, float)) or not 0.0 < denoise <= 1.0 or math.isnan(denoise):
        raise ValueError(f"denoise={denoise!r}: expected a number in (0, 1]; 1.0 samples from pure noise")
    total = steps if denoise >= 1.0 else int(steps / denoise)
    if total < 2 and config.get("shift_terminal"):  # the stretch divides by 1 - sigma_last, which is 0 at one step
        raise ValueError(f"steps={steps!r}: this model's schedule (a terminal shift) needs at least 2 steps; "
                         f"set steps to 2 or more")
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
    base = torch.linspace(1.0, 1.0 / total, total).tolist()
    kwargs = {}
    if scheduler.config.use_dynamic_shifting:
        kwargs["mu"] = _mu(dict(scheduler.config), (latent_h // 2) * (latent_w // 2))
    scheduler.set_timesteps(sigmas=base, device="cpu", **kwargs)
    sigmas = scheduler.sigmas.to(torch.float32)
    return sigmas[-(steps + 1):].clone()


def model_timesteps(sigmas: torch.Tensor) -> torch.Tensor:
    """The DiT's timestep input per step (float32): ``(1000 - t) / 1000`` with ``t = 1000 sigma`` as diffusers
    forms it (``sigmas[:-1]``, one per step)."""
    t = sigmas[:-1].to(torch.float32) * TRAIN_TIMESTEPS
    return (TRAIN_TIMESTEPS - t) / TRAIN_TIMESTEPS

"""ComfyUI's model sampling for the engine's families: the sigma table, sigma <-> model timestep, and how noise enters
and leaves the latent (``comfy/model_sampling.py``'s meaning, re-derived from the model's own scheduler config).

- Discrete (SD1.x / SD2.x / SDXL, eps or v): betas in float64 (``scaled_linear`` = squares of a linspace of square
  roots, ComfyUI's "linear"; ``linear``; ``trained_betas``), ``sigma = sqrt((1 - abar) / abar)`` rescaled to zero
  terminal SNR when the config asks; the table and its logs are stored as float32 as ComfyUI stores them.
  ``timestep(sigma)`` is the index of the nearest log sigma; ``sigma(t)`` interpolates log sigma linearly.
  ``noise_scaling``: ``noise * sqrt(1 + sigma^2)`` at full denoise (``max_denoise``), else ``noise * sigma``, plus the
  latent.
- Flow (Z-Image, ComfyUI's ModelSamplingDiscreteFlow / CONST): ``sigma(t) = shift s / (1 + (shift - 1) s)`` with
  ``s = t / 1000`` over ``t = 1..1000``; ``noise_scaling = sigma noise + (1 - sigma) latent``; the inverse divides by
  ``1 - sigma``. ``shift`` is the scheduler config's (3.0 for Z-Image-Turbo).
Invariant: the tables equal ComfyUI's bit for bit (same dtypes, same operation order), so schedulers built on them
agree exactly.
"""
from __future__ import annotations

import math
from typing import Mapping

import torch

TIMESTEPS = 1000


def _betas64(config: Mapping) -> torch.Tensor:
    n = int(config.get("num_train_timesteps", TIMESTEPS))
    trained = config.get("trained_betas")
    if trained is not None:
        return torch.as_tensor(trained, dtype=torch.float64)
    start, end = float(config.get("beta_start", 0.00085)), float(config.get("beta_end", 0.012))
    schedule = config.get("beta_schedule", "scaled_linear")
    if schedule == "scaled_linear":
        return torch.linspace(start ** 0.5, end ** 0.5, n, dtype=torch.float64) ** 2
    if schedule == "linear":
        return torch.linspace(start, end, n, dtype=torch.float64)
    raise ValueError(f"scheduler_config['beta_schedule']={schedule!r}: the Fused KSampler takes 'scaled_linear' or "
                     f"'linear' (or trained_betas); use the Fused DDIM Sampler for this model")


def _zero_terminal_snr(sigmas: torch.Tensor) -> torch.Tensor:
    """Lin et al. 2023 applied to sigmas, as ComfyUI does for zsnr models."""
    root = (1 / (sigmas * sigmas + 1)).sqrt()
    first, last = root[0].clone(), root[-1].clone()
    root = (root - last) * (first / (first - last))
    abar = root ** 2
    abar[-1] = 4.8973451890853435e-08
    return ((1 - abar) / abar) ** 0.5


class _SigmaTable:
    """A model sampling over an ascending float32 sigma table."""

    sigmas: torch.Tensor

    @property
    def sigma_min(self) -> torch.Tensor:
        return self.sigmas[0]

    @property
    def sigma_max(self) -> torch.Tensor:
        return self.sigmas[-1]


class DiscreteSampling(_SigmaTable):
    """eps / v-prediction models over a discrete training schedule."""

    is_flow = False

    def __init__(self, config: Mapping, prediction: str):
        self.prediction = prediction
        abar = torch.cumprod(1.0 - _betas64(config), dim=0)
        sigmas = ((1 - abar) / abar) ** 0.5
        if config.get("rescale_betas_zero_snr"):
            sigmas = _zero_terminal_snr(sigmas)
        self.sigmas = sigmas.float()
        self.log_sigmas = sigmas.log().float()

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        dists = sigma.log().to(self.log_sigmas.device) - self.log_sigmas[:, None]
        return dists.abs().argmin(dim=0).view(sigma.shape).to(sigma.device)

    def sigma(self, timestep: torch.Tensor) -> torch.Tensor:
        t = torch.clamp(timestep.float().to(self.log_sigmas.device), min=0, max=len(self.sigmas) - 1)
        low, high, w = t.floor().long(), t.ceil().long(), t.frac()
        return ((1 - w) * self.log_sigmas[low] + w * self.log_sigmas[high]).exp().to(timestep.device)

    def percent_to_sigma(self, percent: float) -> float:
        if percent <= 0.0:
            return 999999999.9
        if percent >= 1.0:
            return 0.0
        return self.sigma(torch.tensor((1.0 - percent) * 999.0)).item()

    def noise_scaling(self, sigma, noise, latent, max_denoise=False):
        sigma = _reshaped(sigma, noise.ndim)
        noise = noise * torch.sqrt(1.0 + sigma ** 2.0) if max_denoise else noise * sigma
        return noise + latent

    def inverse_noise_scaling(self, sigma, latent):
        return latent


class FlowSampling(_SigmaTable):
    """Rectified-flow models (ComfyUI's CONST) with a static shift."""

    is_flow = True
    prediction = "flow"

    def __init__(self, shift: float = 1.0, multiplier: float = 1000.0):
        self.shift, self.multiplier = float(shift), float(multiplier)
        self.sigmas = self.sigma((torch.arange(1, TIMESTEPS + 1, 1) / TIMESTEPS) * multiplier)

    def _shifted(self, t):
        return t if self.shift == 1.0 else self.shift * t / (1 + (self.shift - 1) * t)

    def timestep(self, sigma):
        return sigma * self.multiplier

    def sigma(self, timestep):
        return self._shifted(timestep / self.multiplier)

    def percent_to_sigma(self, percent: float) -> float:
        if percent <= 0.0:
            return 1.0
        if percent >= 1.0:
            return 0.0
        return self._shifted(1.0 - percent)

    def noise_scaling(self, sigma, noise, latent, max_denoise=False):
        sigma = _reshaped(sigma, noise.ndim)
        return sigma * noise + (1.0 - sigma) * latent

    def inverse_noise_scaling(self, sigma, latent):
        return latent / (1.0 - _reshaped(sigma, latent.ndim))


def _reshaped(sigma, ndim: int):
    sigma = torch.as_tensor(sigma)
    return sigma.view(()) if sigma.nelement() == 1 else sigma.view(sigma.shape[:1] + (1,) * (ndim - 1))


def model_sampling_for(engine):
    """The model sampling of the engine's family (flow for a DiT, else discrete with the config's prediction)."""
    config = engine.parts.scheduler_config
    if engine.parts.is_flow:
        return FlowSampling(shift=float(config.get("shift", 1.0)))
    prediction = engine.parts.prediction_type
    if prediction not in ("epsilon", "v_prediction"):
        raise ValueError(f"lean_model predicts {prediction!r}; the Fused KSampler runs epsilon and v_prediction "
                         f"models")
    return DiscreteSampling(config, prediction)


def max_denoise(sampling, sigmas: torch.Tensor) -> bool:
    """ComfyUI's rule: the first sigma is (close to) the model's largest, so the start is pure noise."""
    return math.isclose(float(sampling.sigma_max), float(sigmas[0]), rel_tol=1e-05) or \
        float(sigmas[0]) > float(sampling.sigma_max)

"""ComfyUI's model sampling for the engine's families: the sigma table, sigma <-> model timestep, the model's input
scaling and denoised estimate, and how noise enters and leaves the latent (``comfy/model_sampling.py``'s meaning,
re-derived from the model's own scheduler config).

- Discrete (SD1.x / SD2.x / SDXL; eps or v, sigma_data 1): betas in float64 (``scaled_linear`` = squares of a
  linspace of square roots, ComfyUI's "linear"; ``linear`` = ComfyUI's "sqrt_linear"; ``trained_betas``),
  ``sigma = sqrt((1 - abar) / abar)``, rescaled to zero terminal SNR when the config asks; the table and its logs
  are stored as float32. ``timestep(sigma)``: index of the nearest log sigma; ``sigma(t)``: log sigma interpolated
  linearly. Input ``x / sqrt(sigma^2 + 1)``; denoised ``x - out sigma`` (eps) or
  ``x / (sigma^2 + 1) - out sigma / sqrt(sigma^2 + 1)`` (v, Salimans & Ho 2022). ``noise_scaling``: the latent plus
  ``noise sqrt(1 + sigma^2)`` at a pure-noise start (``max_denoise``), else ``noise sigma``.
- Flow (Z-Image; ComfyUI's ModelSamplingDiscreteFlow + CONST): ``sigma(t) = shift s / (1 + (shift - 1) s)``,
  ``s = t / multiplier``, table over ``t = multiplier * (1..1000) / 1000``; input unscaled; denoised
  ``x - out sigma``; ``noise_scaling = sigma noise + (1 - sigma) latent``, the inverse divides by ``1 - sigma``.
- Flux-style flow (Qwen-Image: ComfyUI loads it as ``ModelType.FLUX``, ModelSamplingFlux + CONST, ``shift`` 1.15 from
  its sampling settings, declared in ``families.json`` ``comfy_sampling``): ``sigma(t) = e^shift / (e^shift +
  (1 / t - 1))`` over ``t = (1..10000) / 10000``, timestep = sigma; otherwise as the flow above.
Invariant: the tables equal ComfyUI's bit for bit (float64 schedule, float32 storage, the same operation order), so
the schedulers built on them agree exactly. Why not ``ddim.alphas_cumprod``: it is diffusers' float32 cumprod, which
moves 999 of the 1000 sigmas by up to 6e-6 from ComfyUI's.
"""
from __future__ import annotations

import math
from typing import Mapping, Optional

import torch

from ...memory.families import family_defaults, is_dit_family

TIMESTEPS = 1000
PREDICTIONS = ("epsilon", "v_prediction")
# ComfyUI's defaults for a discrete model whose settings leave a key out (every SD family's schedule).
_SD_SCHEDULE = {"beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012}
_FIX = "correct the model's scheduler_config.json"


def _train_timesteps(config: Mapping) -> int:
    key = "num_train_timesteps"
    value = config.get(key, TIMESTEPS)
    if isinstance(value, bool) or not isinstance(value, int) or value < 2:
        raise ValueError(f"scheduler_config[{key!r}]={value!r}: expected an int >= 2; {_FIX}")
    return value


def _beta(config: Mapping, key: str) -> float:
    value = config.get(key, _SD_SCHEDULE[key])
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < 1.0:
        raise ValueError(f"scheduler_config[{key!r}]={value!r}: expected a number in (0, 1); {_FIX}")
    return float(value)


def _betas64(config: Mapping) -> torch.Tensor:
    """The training betas in float64, as ComfyUI's ``make_beta_schedule`` forms them."""
    n = _train_timesteps(config)
    trained = config.get("trained_betas")
    if trained is not None:
        try:
            betas = torch.as_tensor(trained, dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError):
            betas = torch.empty(0)
        if betas.shape != (n,) or not bool(((betas > 0) & (betas < 1)).all()):
            raise ValueError(f"scheduler_config['trained_betas']: expected {n} numbers in (0, 1) (one per training "
                             f"timestep), got {str(trained)[:80]}; {_FIX} or remove trained_betas")
        return betas
    schedule = config.get("beta_schedule", _SD_SCHEDULE["beta_schedule"])
    start, end = _beta(config, "beta_start"), _beta(config, "beta_end")
    if schedule == "scaled_linear":
        return torch.linspace(start ** 0.5, end ** 0.5, n, dtype=torch.float64) ** 2
    if schedule == "linear":
        return torch.linspace(start, end, n, dtype=torch.float64)
    raise ValueError(f"scheduler_config['beta_schedule']={schedule!r}: the Fused KSampler takes 'scaled_linear' or "
                     f"'linear' (or trained_betas); use the Fused DDIM Sampler for this model")


def _zero_terminal_snr(sigmas: torch.Tensor) -> torch.Tensor:
    """Lin et al. 2023 (zero terminal SNR) on a float64 sigma table, with ComfyUI's finite last alpha_bar."""
    root = (1 / (sigmas * sigmas + 1)).sqrt()
    first, last = root[0].clone(), root[-1].clone()
    root = (root - last) * (first / (first - last))
    abar = root ** 2
    abar[-1] = 4.8973451890853435e-08
    return ((1 - abar) / abar) ** 0.5


def _tensor(value) -> torch.Tensor:
    """A tensor argument as it is; a Python number as a float32 scalar (what ComfyUI's table entries are)."""
    return value if isinstance(value, torch.Tensor) else torch.tensor(float(value), dtype=torch.float32)


def _reshaped(sigma, ndim: int) -> torch.Tensor:
    """One sigma as a scalar, or one per batch row broadcast over the other ``ndim - 1`` dims."""
    sigma = _tensor(sigma)
    return sigma.view(()) if sigma.nelement() == 1 else sigma.view(sigma.shape[:1] + (1,) * (ndim - 1))


class _SigmaTable:
    """A model sampling over an ascending float32 sigma table; ``sigma_min`` / ``sigma_max`` are its ends as floats
    (exact: a float32 fits a Python float)."""

    sigmas: torch.Tensor

    def _set_table(self, sigmas: torch.Tensor) -> None:
        self.sigmas = sigmas
        self.sigma_min, self.sigma_max = float(sigmas[0]), float(sigmas[-1])


class DiscreteSampling(_SigmaTable):
    """eps / v-prediction models over a discrete training schedule (ComfyUI's ModelSamplingDiscrete)."""

    is_flow = False
    sigma_data = 1.0

    def __init__(self, config: Mapping, prediction: str = "epsilon"):
        if not isinstance(config, Mapping):
            raise TypeError(f"scheduler_config: expected a dict, got {type(config).__name__}")
        if prediction not in PREDICTIONS:
            raise ValueError(f"prediction={prediction!r}: the Fused KSampler runs {' and '.join(PREDICTIONS)} "
                             f"models; use the Fused DDIM Sampler for this model")
        self.prediction = prediction
        abar = torch.cumprod(1.0 - _betas64(config), dim=0)
        sigmas = ((1 - abar) / abar) ** 0.5
        if config.get("rescale_betas_zero_snr"):
            sigmas = _zero_terminal_snr(sigmas)
        self._set_table(sigmas.float())
        self.log_sigmas = sigmas.log().float()

    def timestep(self, sigma) -> torch.Tensor:
        """The training timestep whose log sigma is nearest (an int64 tensor shaped like ``sigma``)."""
        sigma = _tensor(sigma)
        dists = sigma.log().to(self.log_sigmas.device) - self.log_sigmas[:, None]
        return dists.abs().argmin(dim=0).view(sigma.shape).to(sigma.device)

    def sigma(self, timestep) -> torch.Tensor:
        """The sigma at a (fractional) timestep: log sigma interpolated linearly, clamped to the table."""
        timestep = _tensor(timestep)
        t = torch.clamp(timestep.float().to(self.log_sigmas.device), min=0, max=len(self.sigmas) - 1)
        low, high, w = t.floor().long(), t.ceil().long(), t.frac()
        return ((1 - w) * self.log_sigmas[low] + w * self.log_sigmas[high]).exp().to(timestep.device)

    def percent_to_sigma(self, percent: float) -> float:
        """The sigma ``percent`` of the way through sampling (ComfyUI maps percent over timesteps 999..0)."""
        if percent <= 0.0:
            return 999999999.9
        if percent >= 1.0:
            return 0.0
        return self.sigma(torch.tensor((1.0 - percent) * 999.0)).item()

    def calculate_input(self, sigma, x: torch.Tensor) -> torch.Tensor:
        return x / (_reshaped(sigma, x.ndim) ** 2 + self.sigma_data ** 2) ** 0.5

    def calculate_denoised(self, sigma, model_output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        sigma = _reshaped(sigma, model_output.ndim)
        if self.prediction == "epsilon":
            return x - model_output * sigma
        total = sigma ** 2 + self.sigma_data ** 2
        return x * self.sigma_data ** 2 / total - model_output * sigma * self.sigma_data / total ** 0.5

    def noise_scaling(self, sigma, noise: torch.Tensor, latent: torch.Tensor, max_denoise: bool = False):
        sigma = _reshaped(sigma, noise.ndim)
        noise = noise * torch.sqrt(1.0 + sigma ** 2.0) if max_denoise else noise * sigma
        return noise + latent

    def inverse_noise_scaling(self, sigma, latent: torch.Tensor) -> torch.Tensor:
        return latent


class FlowSampling(_SigmaTable):
    """Rectified-flow models (ComfyUI's ModelSamplingDiscreteFlow with CONST) with a static shift."""

    is_flow = True
    prediction = "flow"

    def __init__(self, shift: float = 1.0, multiplier: float = 1000.0):
        for name, value in (("shift", shift), ("multiplier", multiplier)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{name}={value!r}: expected a positive finite number (Z-Image-Turbo's shift is 3.0)")
        self.shift, self.multiplier = float(shift), float(multiplier)
        self._set_table(self.sigma((torch.arange(1, TIMESTEPS + 1, 1) / TIMESTEPS) * self.multiplier))

    def _shifted(self, t):
        return t if self.shift == 1.0 else self.shift * t / (1 + (self.shift - 1) * t)

    def timestep(self, sigma) -> torch.Tensor:
        return _tensor(sigma) * self.multiplier

    def sigma(self, timestep) -> torch.Tensor:
        return self._shifted(_tensor(timestep) / self.multiplier)

    def percent_to_sigma(self, percent: float) -> float:
        if percent <= 0.0:
            return 1.0
        if percent >= 1.0:
            return 0.0
        return self._shifted(1.0 - percent)

    def calculate_input(self, sigma, x: torch.Tensor) -> torch.Tensor:
        return x

    def calculate_denoised(self, sigma, model_output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x - model_output * _reshaped(sigma, model_output.ndim)

    def noise_scaling(self, sigma, noise: torch.Tensor, latent: torch.Tensor, max_denoise: bool = False):
        sigma = _reshaped(sigma, noise.ndim)
        return sigma * noise + (1.0 - sigma) * latent

    def inverse_noise_scaling(self, sigma, latent: torch.Tensor) -> torch.Tensor:
        return latent / (1.0 - _reshaped(sigma, latent.ndim))


class FluxSampling(FlowSampling):
    """Flow models ComfyUI samples as Flux (ModelSamplingFlux with CONST): ``shift`` is the exponent ``mu``, the table
    has 10000 entries and the timestep is sigma itself."""

    TABLE = 10000

    def __init__(self, shift: float = 1.15):
        if isinstance(shift, bool) or not isinstance(shift, (int, float)) or not -50 < shift < 50:
            raise ValueError(f"shift={shift!r}: expected a finite number (Qwen-Image's is 1.15)")
        self.shift, self.multiplier = float(shift), 1.0
        self._set_table(self.sigma(torch.arange(1, self.TABLE + 1, 1) / self.TABLE))

    def _shifted(self, t):
        return math.exp(self.shift) / (math.exp(self.shift) + (1 / t - 1) ** 1.0)

    def timestep(self, sigma) -> torch.Tensor:
        return _tensor(sigma)

    def sigma(self, timestep) -> torch.Tensor:
        return self._shifted(_tensor(timestep))


COMFY_SAMPLINGS = {"flux": FluxSampling}


def model_sampling_for_family(family: str, scheduler_config: Optional[Mapping] = None):
    """The model sampling of a family (``memory/configs/families.json``): its ``comfy_sampling`` when it declares one
    (ComfyUI's for that model, whatever the scheduler config), else flow for a DiT family (static ``shift`` from the
    scheduler config), else discrete with the config's ``prediction_type``. ``scheduler_config`` defaults to the
    family's shipped one."""
    defaults = family_defaults(family)
    declared = defaults.get("comfy_sampling")
    if declared is not None:
        return COMFY_SAMPLINGS[declared["kind"]](shift=declared["shift"])
    config = defaults["scheduler"] if scheduler_config is None else scheduler_config
    if not isinstance(config, Mapping):
        raise TypeError(f"scheduler_config: expected a dict, got {type(config).__name__}")
    if is_dit_family(family):
        if config.get("use_dynamic_shifting"):
            raise ValueError("scheduler_config['use_dynamic_shifting']=True: ComfyUI's discrete-flow sampling has a "
                             "static shift; give the model's static 'shift' and set use_dynamic_shifting to false")
        return FlowSampling(shift=config.get("shift", 1.0))
    prediction = config.get("prediction_type", "epsilon")
    if prediction not in PREDICTIONS:
        raise ValueError(f"scheduler_config['prediction_type']={prediction!r}: the Fused KSampler runs "
                         f"{' and '.join(PREDICTIONS)} models; use the Fused DDIM Sampler for this model")
    return DiscreteSampling(config, prediction)


def model_sampling_for(engine):
    """The model sampling of an engine (its family and its own scheduler config)."""
    return model_sampling_for_family(engine.parts.family, engine.parts.scheduler_config)


def max_denoise(sampling, sigmas) -> bool:
    """ComfyUI's rule: the first sigma is the model's largest (relative 1e-5) or above it, so the start is pure
    noise."""
    largest, first = float(sampling.sigma_max), float(sigmas[0])
    return math.isclose(largest, first, rel_tol=1e-05) or first > largest

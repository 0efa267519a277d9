"""DDIM schedule math (Song, Meng & Ermon 2020, "Denoising Diffusion Implicit Models", arXiv:2010.02502).

Invariant: for a diffusers scheduler config, every number here equals what diffusers' ``DDIMScheduler`` computes
(betas, ``alphas_cumprod`` in float32, ``set_timesteps`` spacing, ``prev_timestep = t - T // steps`` for every
spacing, ``set_alpha_to_one``, eta variance) - the per-step scalars are computed with the same float32 torch
operations in the same order, so a loop built on them reproduces ``DDIMScheduler.step`` to the last bit on the CPU.

The math. With a = alpha_bar_t, a' = alpha_bar_{t_prev}, b = 1 - a, b' = 1 - a' and the model output m:

    sigma_t = eta * sqrt(b' / b * (1 - a / a'))                                   (eq. 16)
    epsilon:      x0 = (x - sqrt(b) m) / sqrt(a),   eps = m
    v_prediction: x0 = sqrt(a) x - sqrt(b) m,       eps = sqrt(a) m + sqrt(b) x   (Salimans & Ho 2022)
    sample:       x0 = m,                           eps = (x - sqrt(a) x0) / sqrt(b)
    x'  = sqrt(a') x0 + sqrt(1 - a' - sigma_t^2) eps + sigma_t z,   z ~ N(0, I)   (eq. 12)

A step is therefore five scalars per timestep - (sqrt a, sqrt b, sqrt a', sqrt(1 - a' - sigma^2), sigma) - that
``DDIMSchedule.coefficients`` tabulates; the fused kernel (``kernels/cfg_ddim.py``) applies them together with
classifier-free guidance in one pass over the latent, in diffusers' operation order.

Hand-written rather than calling ``DDIMScheduler.step`` because the fused kernel and the CUDA-graph loop need the
step as device scalars; diffusers stays the reference in the tests.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch

logger = logging.getLogger(__name__)

SPACINGS = ("leading", "trailing", "linspace")
PREDICTION_TYPES = ("epsilon", "v_prediction", "sample")

# diffusers' DDIMScheduler defaults, used for keys a config leaves out.
_DEFAULTS: dict[str, Any] = dict(num_train_timesteps=1000, beta_start=0.0001, beta_end=0.02, beta_schedule="linear",
                                 trained_betas=None, clip_sample=True, set_alpha_to_one=True, steps_offset=0,
                                 prediction_type="epsilon", thresholding=False, timestep_spacing="leading",
                                 rescale_betas_zero_snr=False)


def _cfg(config: Mapping[str, Any], key: str):
    value = config.get(key, _DEFAULTS[key])
    return _DEFAULTS[key] if value is None and key != "trained_betas" else value


def check_config(config: Mapping[str, Any]) -> None:
    """Reject configs whose step is not the linear DDIM update this module implements."""
    if not isinstance(config, Mapping):
        raise TypeError(f"scheduler_config must be a dict, got {type(config).__name__}")
    if _cfg(config, "clip_sample"):
        raise ValueError("scheduler_config['clip_sample']=True is not supported by the fused DDIM step (clipping x0 "
                         "is not linear); Stable Diffusion configs use clip_sample=False - set it to False")
    if _cfg(config, "thresholding"):
        raise ValueError("scheduler_config['thresholding']=True is not supported by the fused DDIM step; "
                         "set it to False (latent diffusion models do not use dynamic thresholding)")
    pred = _cfg(config, "prediction_type")
    if pred not in PREDICTION_TYPES:
        raise ValueError(f"scheduler_config['prediction_type']={pred!r}: expected one of {PREDICTION_TYPES}")
    n = _cfg(config, "num_train_timesteps")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"scheduler_config['num_train_timesteps']={n!r}: expected a positive int")
    if config.get("trained_betas") is not None:
        _trained_betas(config["trained_betas"], n)


def _trained_betas(trained, n: int) -> torch.Tensor:
    """``trained_betas`` as float32: one beta in 0..1 per training timestep, else ``ValueError`` (diffusers takes
    any list and fails later with an index error deep inside sampling)."""
    try:
        out = torch.as_tensor(trained, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError) as exc:
        got = f"values that are not numbers ({exc})"
    else:
        in_range = bool(((out >= 0) & (out <= 1)).all())  # NaN is in no range
        if out.ndim == 1 and out.numel() == n and in_range:
            return out.to(torch.float32)
        got = f"{out.numel()} values of shape {tuple(out.shape)}, from {out.min().item():g} to {out.max().item():g}" \
            if out.numel() else "no values"
    raise ValueError(f"scheduler_config['trained_betas']: expected {n} numbers in 0..1 (one per training timestep, "
                     f"num_train_timesteps={n}), got {got}; correct or remove trained_betas in the model's "
                     f"scheduler_config.json")


def _cosine_betas(n: int, max_beta: float = 0.999) -> torch.Tensor:
    """Glide's squaredcos_cap_v2 betas (Nichol & Dhariwal 2021, eq. 17), as diffusers' ``betas_for_alpha_bar``."""
    def alpha_bar(t: float) -> float:
        return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2

    return torch.tensor([min(1 - alpha_bar((i + 1) / n) / alpha_bar(i / n), max_beta) for i in range(n)],
                        dtype=torch.float32)


def _rescale_zero_terminal_snr(betas: torch.Tensor) -> torch.Tensor:
    """Lin et al. 2023 ("Common Diffusion Noise Schedules and Sample Steps are Flawed"), Algorithm 1."""
    abar_sqrt = torch.cumprod(1.0 - betas, dim=0).sqrt()
    first, last = abar_sqrt[0].clone(), abar_sqrt[-1].clone()
    abar_sqrt = (abar_sqrt - last) * (first / (first - last))
    abar = abar_sqrt ** 2
    alphas = torch.cat([abar[0:1], abar[1:] / abar[:-1]])
    return 1 - alphas


def betas(config: Mapping[str, Any]) -> torch.Tensor:
    """The training betas (float32), for ``linear``, ``scaled_linear``, ``squaredcos_cap_v2`` or ``trained_betas``."""
    check_config(config)
    n = _cfg(config, "num_train_timesteps")
    trained = config.get("trained_betas")
    schedule = _cfg(config, "beta_schedule")
    start, end = float(_cfg(config, "beta_start")), float(_cfg(config, "beta_end"))
    if trained is not None:
        out = _trained_betas(trained, n)
    elif schedule == "linear":
        out = torch.linspace(start, end, n, dtype=torch.float32)
    elif schedule == "scaled_linear":
        out = torch.linspace(start ** 0.5, end ** 0.5, n, dtype=torch.float32) ** 2
    elif schedule == "squaredcos_cap_v2":
        out = _cosine_betas(n)
    else:
        raise ValueError(f"scheduler_config['beta_schedule']={schedule!r}: expected 'linear', 'scaled_linear' or "
                         f"'squaredcos_cap_v2' (or give trained_betas)")
    if _cfg(config, "rescale_betas_zero_snr"):
        out = _rescale_zero_terminal_snr(out)
    return out


def alphas_cumprod(config: Mapping[str, Any]) -> torch.Tensor:
    """alpha_bar_t = prod_{s<=t} (1 - beta_s), float32 exactly as diffusers computes it."""
    return torch.cumprod(1.0 - betas(config), dim=0)


def final_alpha_cumprod(config: Mapping[str, Any], abar: Optional[torch.Tensor] = None) -> float:
    """alpha_bar used past the last step: 1 when ``set_alpha_to_one``, else alpha_bar_0."""
    if _cfg(config, "set_alpha_to_one"):
        return 1.0
    abar = alphas_cumprod(config) if abar is None else abar
    return float(abar[0])


def timesteps(config: Mapping[str, Any], steps: int, spacing: Optional[str] = None) -> list[int]:
    """Inference timesteps, descending, as ``DDIMScheduler.set_timesteps`` (Lin et al. 2023, Table 2 spacings).

    ``spacing`` overrides ``config['timestep_spacing']``. ``steps_offset`` applies to ``leading`` only.
    """
    check_config(config)
    n = _cfg(config, "num_train_timesteps")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r}: expected an int >= 1")
    if steps > n:
        raise ValueError(f"steps={steps} is more than the model's {n} training timesteps; use at most {n}")
    spacing = _cfg(config, "timestep_spacing") if spacing is None else spacing
    if spacing == "linspace":
        ts = np.linspace(0, n - 1, steps).round()[::-1].copy().astype(np.int64)
    elif spacing == "leading":
        ratio = n // steps
        ts = (np.arange(0, steps) * ratio).round()[::-1].copy().astype(np.int64)
        ts += int(_cfg(config, "steps_offset"))
    elif spacing == "trailing":
        ratio = n / steps
        ts = np.round(np.arange(n, 0, -ratio)).astype(np.int64)
        ts -= 1
    else:
        raise ValueError(f"timestep_spacing={spacing!r}: expected one of {SPACINGS}")
    out = [int(t) for t in ts]
    if max(out) >= n or min(out) < 0:
        raise ValueError(f"steps={steps} with timestep_spacing={spacing!r} and steps_offset="
                         f"{_cfg(config, 'steps_offset')} gives timestep {max(out)} outside 0..{n - 1}; "
                         f"use fewer steps or another spacing")
    return out


def img2img_start(steps: int, denoise: float) -> int:
    """Index of the first timestep an img2img run uses (diffusers' ``get_timesteps`` with ``strength=denoise``).

    The run keeps ``int(steps * denoise)`` of the ``steps`` timesteps (the last, least noisy ones).
    """
    if not (isinstance(denoise, (int, float)) and 0.0 <= denoise <= 1.0):
        raise ValueError(f"denoise={denoise!r}: expected a number in 0..1")
    kept = min(int(steps * denoise), steps)
    if kept < 1:
        raise ValueError(f"steps * denoise = {steps} * {denoise} = {steps * denoise:g} leaves no step to run "
                         f"(diffusers keeps int(steps * denoise) steps); raise steps or denoise so the product "
                         f"is at least 1")
    return steps - kept


def step_scalars(abar: torch.Tensor, final: torch.Tensor, t: int, prev: int, eta: float) -> list[float]:
    """(sqrt a, sqrt b, sqrt a', sqrt(1 - a' - sigma^2), sigma) of one step, float32 as ``DDIMScheduler.step``.

    ``abar`` is the float32 ``alphas_cumprod``, ``final`` the float32 0-d alpha_bar past the last step.
    """
    if not (eta >= 0.0 and math.isfinite(eta)):
        raise ValueError(f"eta={eta!r}: expected a finite number >= 0")
    a = abar[t]
    ap = abar[prev] if prev >= 0 else final
    b = 1 - a
    bp = 1 - ap
    variance = (bp / b) * (1 - a / ap)
    sigma = eta * variance ** 0.5
    d = (1 - ap - sigma ** 2) ** 0.5
    out = [float(v) for v in (a ** 0.5, b ** 0.5, ap ** 0.5, d, sigma)]
    if not all(math.isfinite(v) for v in out):
        raise ValueError(f"DDIM step scalars are not finite at t={t} (alpha_bar_t={float(a):.3g}, eta={eta}); "
                         f"eta must be <= 1, and zero-terminal-SNR schedules need eta < 1 (1 - alpha_bar_prev - sigma^2 "
                         f"is 0 up to rounding at eta = 1)")
    return out


@dataclass(frozen=True)
class DDIMSchedule:
    """The steps one run executes: timesteps and the per-step scalar table (see the module docstring)."""

    timesteps: tuple[int, ...]
    coefficients: torch.Tensor  # [n, 5] float32: sqrt a, sqrt b, sqrt a', sqrt(1 - a' - sigma^2), sigma
    total_steps: int  # the ``steps`` the schedule was built for (img2img runs a suffix of it)
    prediction_type: str
    eta: float

    @property
    def start_timestep(self) -> int:
        """The timestep img2img noises the input latent to (diffusers' ``latent_timestep``)."""
        return self.timesteps[0]

    def __len__(self) -> int:
        return len(self.timesteps)


def make_schedule(config: Mapping[str, Any], steps: int, eta: float = 0.0, spacing: Optional[str] = None,
                  denoise: float = 1.0) -> DDIMSchedule:
    """The DDIM schedule of ``steps`` steps (the last ``int(steps * denoise)`` of them when ``denoise < 1``)."""
    ts = timesteps(config, steps, spacing)
    start = img2img_start(steps, denoise) if denoise != 1.0 else 0
    abar = alphas_cumprod(config)
    final = torch.tensor(1.0) if _cfg(config, "set_alpha_to_one") else abar[0]
    n = _cfg(config, "num_train_timesteps")
    pred = _cfg(config, "prediction_type")
    rows = [step_scalars(abar, final, t, t - n // steps, float(eta))  # diffusers: prev = t - T // steps, always
            for t in ts[start:]]
    return DDIMSchedule(tuple(ts[start:]), torch.tensor(rows, dtype=torch.float32), steps, pred, float(eta))


def add_noise(config: Mapping[str, Any], original: torch.Tensor, noise: torch.Tensor, timestep: int) -> torch.Tensor:
    """Forward diffusion q(x_t | x_0) = sqrt(a_t) x_0 + sqrt(1 - a_t) z (Ho et al. 2020, eq. 4).

    Computed in ``original``'s dtype from float32 ``alphas_cumprod`` as diffusers' ``add_noise`` does.
    """
    if original.shape != noise.shape:
        raise ValueError(f"noise shape {tuple(noise.shape)} does not match the latent shape {tuple(original.shape)}")
    abar = alphas_cumprod(config).to(device=original.device, dtype=original.dtype)[int(timestep)]
    return abar ** 0.5 * original + (1 - abar) ** 0.5 * noise


def ddim_step(config: Mapping[str, Any], steps: int, model_output: torch.Tensor, timestep: int, sample: torch.Tensor,
              eta: float = 0.0, noise: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One textbook DDIM step in the paper's form (x0, direction, noise): a readable reference for tests."""
    check_config(config)
    n = _cfg(config, "num_train_timesteps")
    abar = alphas_cumprod(config).double()
    a = float(abar[timestep])
    prev = timestep - n // steps
    ap = float(abar[prev]) if prev >= 0 else final_alpha_cumprod(config, abar.float())
    x, m = sample.double(), model_output.double()
    pred = _cfg(config, "prediction_type")
    if pred == "epsilon":
        x0, eps = (x - (1 - a) ** 0.5 * m) / a ** 0.5, m
    elif pred == "v_prediction":
        x0, eps = a ** 0.5 * x - (1 - a) ** 0.5 * m, a ** 0.5 * m + (1 - a) ** 0.5 * x
    else:
        x0, eps = m, (x - a ** 0.5 * m) / (1 - a) ** 0.5
    sigma = eta * (((1 - ap) / (1 - a)) * (1 - a / ap)) ** 0.5
    out = ap ** 0.5 * x0 + (1 - ap - sigma ** 2) ** 0.5 * eps
    if eta > 0:
        if noise is None:
            raise ValueError("eta > 0 needs noise")
        out = out + sigma * noise.double()
    return out.to(sample.dtype)


def pipeline_config(config: Mapping[str, Any], sdxl: bool) -> dict:
    """The scheduler config diffusers' pipeline of the family really samples with (a copy; ``config`` is untouched).

    ``StableDiffusionPipeline`` and ``StableDiffusionImg2ImgPipeline`` (SD1.x / SD2.x) rewrite an outdated config
    when they are built: ``steps_offset`` != 1 becomes 1 and ``clip_sample=True`` becomes False (a missing key counts
    as ``DDIMScheduler``'s default, 0 and True), with a deprecation warning. The SDXL pipelines keep the config.
    """
    out = dict(config)
    if not sdxl:
        if _cfg(out, "steps_offset") != 1 or _cfg(out, "clip_sample") is True:
            logger.info("scheduler config steps_offset=%r clip_sample=%r is outdated; sampling with steps_offset=1 "
                        "and clip_sample=False as diffusers' Stable Diffusion pipelines do",
                        _cfg(out, "steps_offset"), _cfg(out, "clip_sample"))
        out["steps_offset"] = 1
        if _cfg(out, "clip_sample") is True:
            out["clip_sample"] = False
    return out


def config_with(config: Mapping[str, Any], **overrides) -> dict:
    """A copy of ``config`` with ``overrides`` (never mutates the model's config)."""
    out = dict(config)
    out.update(overrides)
    return out


__all__: Sequence[str] = ("SPACINGS", "PREDICTION_TYPES", "DDIMSchedule", "make_schedule", "timesteps", "betas",
                          "alphas_cumprod", "final_alpha_cumprod", "img2img_start", "step_scalars", "add_noise",
                          "ddim_step", "check_config", "config_with", "pipeline_config")

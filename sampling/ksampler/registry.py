"""The samplers the Fused KSampler runs, by ComfyUI name: each sampler function with the per-step noise it draws.

Invariant: every name in ``settings.SAMPLER_NAMES`` maps to exactly one sampler function, and its noise sampler is
built as ComfyUI builds it for that sampler (a seeded Gaussian generator on the latent's device, or a Brownian tree
for the SDE samplers), so the same seed gives the same noise.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from . import samplers_basic, samplers_dpm, unipc
from .settings import SAMPLER_NAMES
from .step_noise import brownian_noise_sampler, gaussian_noise_sampler

SAMPLERS = {**samplers_basic.SAMPLERS, **samplers_dpm.SAMPLERS, **unipc.SAMPLERS}


def sampler_spec(name: str):
    if name not in SAMPLER_NAMES or name not in SAMPLERS:
        raise ValueError(f"sampler_name={name!r}: expected one of {', '.join(SAMPLER_NAMES)}")
    return SAMPLERS[name]


def noise_sampler_for(spec, x: torch.Tensor, sigmas: torch.Tensor, seed: int, sampling) -> Optional[Callable]:
    """The per-step noise ComfyUI gives this sampler (None for deterministic samplers)."""
    if spec.noise == "gaussian":
        return gaussian_noise_sampler(x, seed)
    if spec.noise == "brownian":
        return brownian_noise_sampler(x, sigmas, seed, sampling)
    return None

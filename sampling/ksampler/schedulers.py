"""ComfyUI's schedulers (``comfy.samplers.SCHEDULER_HANDLERS``) and KSampler's rules around them, on a model sampling
from ``model_sampling``: the same names give the same sigmas.

- ``simple``: every ``len(table) / steps``-th sigma from the top; ``sgm_uniform`` / ``normal``: sigmas at timesteps
  evenly spaced between the largest and smallest sigma's timesteps (``normal`` ends on the smallest, or on zero when
  the table reaches zero; ``sgm_uniform`` drops the last point); ``karras`` (rho 7) and ``exponential`` between
  sigma_min and sigma_max; ``ddim_uniform``: every ``len // steps``-th table entry from index 1; ``beta``: table
  entries at the beta(0.6, 0.6) quantiles, repeats dropped. All end with a zero (as ComfyUI's do).
- ``sigmas_for``: samplers that discard the penultimate sigma (dpm_2, uni_pc) get one more step and lose it;
  ``denoise`` < 1 keeps the last ``steps + 1`` sigmas of an ``int(steps / denoise)``-step schedule; denoise 0
  gives no sigmas (the latent comes back unchanged).
Invariant: float32 tables and the operation order of ComfyUI's code, so the sigmas are ComfyUI's bit for bit.
"""
from __future__ import annotations

import math

import numpy
import torch

from .settings import SCHEDULER_NAMES

DISCARD_PENULTIMATE = frozenset({"dpm_2", "uni_pc"})


def _simple(ms, steps: int) -> torch.Tensor:
    stride = len(ms.sigmas) / steps
    return torch.FloatTensor([float(ms.sigmas[-(1 + int(i * stride))]) for i in range(steps)] + [0.0])


def _ddim_uniform(ms, steps: int) -> torch.Tensor:
    i = 1
    if math.isclose(float(ms.sigmas[i]), 0, abs_tol=0.00001):
        steps, sigs = steps + 1, []
    else:
        sigs = [0.0]
    stride = max(len(ms.sigmas) // steps, 1)
    while i < len(ms.sigmas):
        sigs.append(float(ms.sigmas[i]))
        i += stride
    return torch.FloatTensor(sigs[::-1])


def _normal(ms, steps: int, sgm: bool = False) -> torch.Tensor:
    start, end = ms.timestep(ms.sigma_max), ms.timestep(ms.sigma_min)
    append_zero = True
    if sgm:
        timesteps = torch.linspace(start, end, steps + 1)[:-1]
    else:
        if math.isclose(float(ms.sigma(end)), 0, abs_tol=0.00001):
            steps, append_zero = steps + 1, False
        timesteps = torch.linspace(start, end, steps)
    sigs = [float(ms.sigma(t)) for t in timesteps]
    return torch.FloatTensor(sigs + ([0.0] if append_zero else []))


def _karras(ms, steps: int, rho: float = 7.0) -> torch.Tensor:
    lo, hi = float(ms.sigma_min), float(ms.sigma_max)
    ramp = torch.linspace(0, 1, steps)
    sigmas = (hi ** (1 / rho) + ramp * (lo ** (1 / rho) - hi ** (1 / rho))) ** rho
    return torch.cat([sigmas, sigmas.new_zeros([1])])


def _exponential(ms, steps: int) -> torch.Tensor:
    lo, hi = float(ms.sigma_min), float(ms.sigma_max)
    sigmas = torch.linspace(math.log(hi), math.log(lo), steps).exp()
    return torch.cat([sigmas, sigmas.new_zeros([1])])


def _beta(ms, steps: int, alpha: float = 0.6, beta: float = 0.6) -> torch.Tensor:
    import scipy.stats

    total = len(ms.sigmas) - 1
    ts = numpy.rint(scipy.stats.beta.ppf(1 - numpy.linspace(0, 1, steps, endpoint=False), alpha, beta) * total)
    sigs, last = [], -1
    for t in ts:
        if t != last:
            sigs.append(float(ms.sigmas[int(t)]))
        last = t
    return torch.FloatTensor(sigs + [0.0])


SCHEDULERS = {"simple": _simple, "sgm_uniform": lambda ms, n: _normal(ms, n, sgm=True), "karras": _karras,
              "exponential": _exponential, "ddim_uniform": _ddim_uniform, "beta": _beta, "normal": _normal}
assert tuple(SCHEDULERS) == SCHEDULER_NAMES


def calculate_sigmas(ms, scheduler: str, steps: int, sampler_name: str = "") -> torch.Tensor:
    """The scheduler's sigmas for ``steps`` (with the penultimate-sigma rule of ``sampler_name``)."""
    if scheduler not in SCHEDULERS:
        raise ValueError(f"scheduler={scheduler!r}: expected one of {', '.join(SCHEDULER_NAMES)}")
    discard = sampler_name in DISCARD_PENULTIMATE
    sigmas = SCHEDULERS[scheduler](ms, steps + 1 if discard else steps)
    return torch.cat([sigmas[:-2], sigmas[-1:]]) if discard else sigmas


def sigmas_for(ms, scheduler: str, steps: int, denoise: float, sampler_name: str) -> torch.Tensor:
    """KSampler's sigmas for a run (``KSampler.set_steps``: the denoise rule; module docstring)."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r}: expected a positive int")
    if not 0.0 <= float(denoise) <= 1.0:
        raise ValueError(f"denoise={denoise!r}: expected a number in 0..1")
    if denoise > 0.9999:
        return calculate_sigmas(ms, scheduler, steps, sampler_name)
    if denoise <= 0.0:
        return torch.FloatTensor([])
    return calculate_sigmas(ms, scheduler, int(steps / denoise), sampler_name)[-(steps + 1):]

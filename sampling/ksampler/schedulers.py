"""ComfyUI's schedulers (``comfy.samplers.SCHEDULER_HANDLERS``: its first seven, in its order) and KSampler's rules
around them, on a model sampling from ``model_sampling``: the same names give the same sigmas.

- ``simple``: every ``len(table) / steps``-th sigma from the top; ``sgm_uniform`` / ``normal``: sigmas at timesteps
  evenly spaced between the largest and smallest sigma's timesteps (``normal`` ends on the smallest, or on zero when
  the table reaches zero; ``sgm_uniform`` drops the last point); ``karras`` (Karras et al. 2022, rho 7) and
  ``exponential`` (evenly spaced log sigmas) between sigma_min and sigma_max; ``ddim_uniform``: every
  ``len // steps``-th table entry from index 1; ``beta`` (Lee et al. 2024, arXiv:2407.12173): table entries at the
  beta(0.6, 0.6) quantiles, repeats dropped. All end with a zero.
- ``sigmas_for`` (``KSampler.calculate_sigmas`` / ``set_steps``): samplers that discard the penultimate sigma
  (dpm_2, dpm_2_ancestral, uni_pc, uni_pc_bh2) get one more step and lose its penultimate sigma; ``denoise`` < 1
  keeps the last ``steps + 1`` sigmas of an ``int(steps / denoise)``-step schedule; denoise 0 gives no sigmas.
Invariant: float32 tables and ComfyUI's operation order, so the sigmas are ComfyUI's bit for bit (float32, CPU).
"""
from __future__ import annotations

import math

import numpy
import torch

from ..settings import check_float, check_int

DISCARD_PENULTIMATE = frozenset({"dpm_2", "dpm_2_ancestral", "uni_pc", "uni_pc_bh2"})
MAX_STEPS = 10000  # ComfyUI's KSampler widget limit
MAX_SCHEDULE = 1_000_000  # int(steps / denoise) beyond this takes minutes to tabulate and is never meant


def simple_sigmas(ms, steps: int) -> torch.Tensor:
    stride = len(ms.sigmas) / steps
    return torch.FloatTensor([float(ms.sigmas[-(1 + int(i * stride))]) for i in range(steps)] + [0.0])


def ddim_uniform_sigmas(ms, steps: int) -> torch.Tensor:
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


def normal_sigmas(ms, steps: int, sgm: bool = False) -> torch.Tensor:
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


def sgm_uniform_sigmas(ms, steps: int) -> torch.Tensor:
    return normal_sigmas(ms, steps, sgm=True)


def karras_sigmas(ms, steps: int, rho: float = 7.0) -> torch.Tensor:
    lo, hi = float(ms.sigma_min), float(ms.sigma_max)
    ramp = torch.linspace(0, 1, steps)
    sigmas = (hi ** (1 / rho) + ramp * (lo ** (1 / rho) - hi ** (1 / rho))) ** rho
    return torch.cat([sigmas, sigmas.new_zeros([1])])


def exponential_sigmas(ms, steps: int) -> torch.Tensor:
    lo, hi = float(ms.sigma_min), float(ms.sigma_max)
    sigmas = torch.linspace(math.log(hi), math.log(lo), steps).exp()
    return torch.cat([sigmas, sigmas.new_zeros([1])])


def beta_sigmas(ms, steps: int, alpha: float = 0.6, beta: float = 0.6) -> torch.Tensor:
    import scipy.stats

    total = len(ms.sigmas) - 1
    ts = numpy.rint(scipy.stats.beta.ppf(1 - numpy.linspace(0, 1, steps, endpoint=False), alpha, beta) * total)
    sigs, last = [], -1
    for t in ts:
        if t != last:
            sigs.append(float(ms.sigmas[int(t)]))
        last = t
    return torch.FloatTensor(sigs + [0.0])


SCHEDULERS = {"simple": simple_sigmas, "sgm_uniform": sgm_uniform_sigmas, "karras": karras_sigmas,
              "exponential": exponential_sigmas, "ddim_uniform": ddim_uniform_sigmas, "beta": beta_sigmas,
              "normal": normal_sigmas}
SCHEDULER_NAMES = tuple(SCHEDULERS)  # ComfyUI's list order


def _check_scheduler(scheduler) -> None:
    if scheduler not in SCHEDULERS:
        raise ValueError(f"scheduler={scheduler!r}: expected one of {', '.join(SCHEDULER_NAMES)}")


def calculate_sigmas(ms, scheduler: str, steps: int, sampler_name: str = "") -> torch.Tensor:
    """The scheduler's sigmas for ``steps`` steps (``steps + 1`` values, fewer for ``beta`` / ``ddim_uniform``),
    with the penultimate-sigma rule of ``sampler_name`` (module docstring)."""
    _check_scheduler(scheduler)
    check_int("steps", steps, 1, MAX_SCHEDULE)
    discard = sampler_name in DISCARD_PENULTIMATE
    sigmas = SCHEDULERS[scheduler](ms, steps + 1 if discard else steps)
    return torch.cat([sigmas[:-2], sigmas[-1:]]) if discard else sigmas


def sigmas_for(ms, scheduler: str, steps: int, denoise: float, sampler_name: str) -> torch.Tensor:
    """KSampler's float32 CPU sigmas for a run (``KSampler.set_steps``: the denoise rule; module docstring)."""
    _check_scheduler(scheduler)
    check_int("steps", steps, 1, MAX_STEPS)
    denoise = check_float("denoise", denoise, 0.0, 1.0)
    if not isinstance(sampler_name, str):
        raise TypeError(f"sampler_name={sampler_name!r}: expected a ComfyUI sampler name (a string)")
    if denoise > 0.9999:
        return calculate_sigmas(ms, scheduler, steps, sampler_name)
    if denoise <= 0.0:
        return torch.FloatTensor([])
    total = int(steps / denoise)
    if total > MAX_SCHEDULE:
        raise ValueError(f"denoise={denoise:g} with steps={steps} asks for an int(steps / denoise) = {total}-step "
                         f"schedule; keep it at most {MAX_SCHEDULE}: raise denoise or lower steps")
    return calculate_sigmas(ms, scheduler, total, sampler_name)[-(steps + 1):]

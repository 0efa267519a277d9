"""ComfyUI's first-order, second-order and linear-multistep samplers with its meaning: euler (which ComfyUI's KSampler
also runs for ``ddim``), euler_ancestral (its rectified-flow form on flow models), heun, dpm_2, lms, lcm and
res_multistep.

Math (k-diffusion / Karras et al. 2022): ``denoiser(x, sigma[B]) -> x0``, the ODE slope is ``d = (x - x0) / sigma``;
each sampler advances ``x`` from ``sigmas[i]`` to ``sigmas[i + 1]`` and ends on the denoiser's estimate where the next
sigma is 0.
Invariant: for the same denoiser, sigmas and noise sampler the result equals ComfyUI 0.3.64's sampler of the same
name; every per-step scalar is a 0-d tensor in the sigmas' dtype on their device, computed with the same operations
in the same order, so the updates round as ComfyUI's do.
Why the host copy of the sigmas: branch decisions (``next sigma == 0``, the ancestral step reaching 0) read Python
floats taken once per run, so no step waits on the device; ``callback(i, x, denoised)`` runs once per step, before
the update, and may raise to interrupt.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch


@dataclass(frozen=True)
class SamplerSpec:
    fn: Callable
    noise: Optional[str]  # "gaussian", "brownian" or None: the per-step noise ComfyUI gives the sampler


def to_d(x, sigma, denoised):
    """The Karras ODE slope ``(x - x0) / sigma``."""
    return (x - denoised) / sigma


def ancestral_step(sigma_from, sigma_to, eta=1.0):
    """``(sigma_down, sigma_up)`` of an ancestral step: ``sigma_up = min(sigma_to, eta sigma_to sqrt(1 - sigma_to^2 /
    sigma_from^2))`` (Python ``min``'s choice on ties and NaN), ``sigma_down = sqrt(sigma_to^2 - sigma_up^2)``.
    Elementwise on tensors; eta 0 gives ``(sigma_to, 0.0)``."""
    if not eta:
        return sigma_to, 0.0
    spread = eta * (sigma_to ** 2 * (sigma_from ** 2 - sigma_to ** 2) / sigma_from ** 2) ** 0.5
    sigma_up = torch.where(spread < sigma_to, spread, sigma_to)
    return (sigma_to ** 2 - sigma_up ** 2) ** 0.5, sigma_up


def _ones(x):
    return x.new_ones([x.shape[0]])


def _report(callback, i, x, denoised):
    if callback is not None:
        callback(i, x, denoised)


def check_sigmas(name: str, sigmas) -> None:
    """Raise unless ``sigmas`` is the 1-D float tensor every sampler takes (one check, one message for all)."""
    if not isinstance(sigmas, torch.Tensor) or sigmas.ndim != 1 or not sigmas.is_floating_point():
        got = tuple(sigmas.shape) if isinstance(sigmas, torch.Tensor) else type(sigmas).__name__
        raise ValueError(f"sigmas={got}: {name} takes a 1-D float tensor of sigmas (schedulers.sigmas_for)")


def _check_run(name: str, denoiser, x, sigmas) -> list:
    """Validate a sampler's common inputs; returns the sigmas as Python floats (the run's one host copy)."""
    if not callable(denoiser):
        raise ValueError(f"denoiser={denoiser!r}: {name} needs a callable denoiser(x, sigma[B]) -> x0")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.ndim < 1:
        got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x: {name} takes the noise-scaled floating-point latent [B, ...], got {got}")
    check_sigmas(name, sigmas)
    return sigmas.tolist()


def _needs(name: str, what: str, value, fix: str):
    if value is None:
        raise ValueError(f"{what}=None: {name} needs it; {fix}")


def _no_churn(name: str, s_churn: float):
    """ComfyUI draws churn noise from torch's global generator, which no seed reproduces: only its default runs."""
    if s_churn != 0:
        raise ValueError(f"s_churn={s_churn!r}: {name} runs without churn (ComfyUI's default s_churn=0, whose noise "
                         f"would come from torch's unseeded global generator); pass s_churn=0")


def sample_euler(denoiser, x, sigmas, *, sampling, noise_sampler=None, callback=None, s_churn=0.0, s_tmin=0.0,
                 s_tmax=float("inf"), s_noise=1.0):
    """Euler steps on the probability-flow ODE (Karras et al. 2022, Algorithm 2 without churn)."""
    _check_run("euler", denoiser, x, sigmas)
    _no_churn("euler", s_churn)
    s_in = _ones(x)
    for i in range(len(sigmas) - 1):
        sigma = sigmas[i]
        denoised = denoiser(x, sigma * s_in)
        slope = to_d(x, sigma, denoised)
        _report(callback, i, x, denoised)
        x = x + slope * (sigmas[i + 1] - sigma)
    return x


def _check_ancestral(name, sampling, noise_sampler, eta, s_noise):
    if not isinstance(eta, (int, float)) or isinstance(eta, bool) or not math.isfinite(eta) or eta < 0:
        raise ValueError(f"eta={eta!r}: {name} takes a finite eta >= 0 (ComfyUI's default 1.0)")
    if not isinstance(s_noise, (int, float)) or isinstance(s_noise, bool) or not math.isfinite(s_noise):
        raise ValueError(f"s_noise={s_noise!r}: {name} takes a finite noise multiplier (ComfyUI's default 1.0)")
    _needs(name, "sampling", sampling, "pass the model sampling (model_sampling.model_sampling_for(engine))")
    if eta > 0:
        _needs(name, "noise_sampler", noise_sampler, "pass step_noise.gaussian_noise_sampler(x, seed)")


def _euler_ancestral_flow(denoiser, x, sigmas, host, noise_sampler, callback, eta, s_noise):
    """Rectified flow: step down to ``sigma_down = sigma_next (1 + (sigma_next / sigma - 1) eta)`` along the straight
    path to the estimate, rescale to ``alpha_next = 1 - sigma_next`` and add the noise that brings the variance back
    to ``sigma_next^2``."""
    s_in = _ones(x)
    for i in range(len(host) - 1):
        sigma, sigma_next = sigmas[i], sigmas[i + 1]
        denoised = denoiser(x, sigma * s_in)
        _report(callback, i, x, denoised)
        if host[i + 1] == 0:
            x = denoised
            continue
        sigma_down = sigma_next * (1 + (sigma_next / sigma - 1) * eta)
        alpha_next, alpha_down = 1 - sigma_next, 1 - sigma_down
        renoise = (sigma_next ** 2 - sigma_down ** 2 * alpha_next ** 2 / alpha_down ** 2) ** 0.5
        toward = sigma_down / sigma
        x = toward * x + (1 - toward) * denoised
        if eta > 0:
            x = (alpha_next / alpha_down) * x + noise_sampler(sigma, sigma_next) * s_noise * renoise
    return x


def sample_euler_ancestral(denoiser, x, sigmas, *, sampling, noise_sampler=None, callback=None, eta=1.0,
                           s_noise=1.0):
    """Ancestral Euler: an Euler step down to ``sigma_down``, then fresh noise of std ``sigma_up`` (the flow form on
    models whose ``sampling.is_flow``)."""
    host = _check_run("euler_ancestral", denoiser, x, sigmas)
    _check_ancestral("euler_ancestral", sampling, noise_sampler, eta, s_noise)
    if sampling.is_flow:
        return _euler_ancestral_flow(denoiser, x, sigmas, host, noise_sampler, callback, eta, s_noise)
    if len(host) < 2:
        return x
    downs, ups = ancestral_step(sigmas[:-1], sigmas[1:], eta)  # elementwise: the same bits as step by step
    downs_host = downs.tolist()
    s_in = _ones(x)
    for i in range(len(host) - 1):
        sigma = sigmas[i]
        denoised = denoiser(x, sigma * s_in)
        _report(callback, i, x, denoised)
        if downs_host[i] == 0:
            x = denoised
            continue
        x = x + to_d(x, sigma, denoised) * (downs[i] - sigma)
        if eta > 0:  # at eta 0 ComfyUI adds noise * 0, which leaves x unchanged
            x = x + noise_sampler(sigma, sigmas[i + 1]) * s_noise * ups[i]
    return x


def _two_stage(name, denoiser, x, sigmas, callback, s_churn, second_stage):
    """A slope at each sigma, then ``second_stage`` (one more model call) finishes the step; Euler into zero."""
    host = _check_run(name, denoiser, x, sigmas)
    _no_churn(name, s_churn)
    s_in = _ones(x)
    for i in range(len(host) - 1):
        sigma, sigma_next = sigmas[i], sigmas[i + 1]
        denoised = denoiser(x, sigma * s_in)
        slope = to_d(x, sigma, denoised)
        _report(callback, i, x, denoised)
        if host[i + 1] == 0:
            x = x + slope * (sigma_next - sigma)
        else:
            x = second_stage(denoiser, x, slope, sigma, sigma_next, s_in)
    return x


def _heun_stage(denoiser, x, slope, sigma, sigma_next, s_in):
    dt = sigma_next - sigma
    x_euler = x + slope * dt
    slope_next = to_d(x_euler, sigma_next, denoiser(x_euler, sigma_next * s_in))
    return x + (slope + slope_next) / 2 * dt


def _dpm_2_stage(denoiser, x, slope, sigma, sigma_next, s_in):
    sigma_mid = sigma.log().lerp(sigma_next.log(), 0.5).exp()
    x_mid = x + slope * (sigma_mid - sigma)
    slope_mid = to_d(x_mid, sigma_mid, denoiser(x_mid, sigma_mid * s_in))
    return x + slope_mid * (sigma_next - sigma)


def sample_heun(denoiser, x, sigmas, *, sampling, noise_sampler=None, callback=None, s_churn=0.0, s_tmin=0.0,
                s_tmax=float("inf"), s_noise=1.0):
    """Heun's second-order method (Karras et al. 2022, Algorithm 2 without churn): the mean of the slopes at both
    ends of the Euler step."""
    return _two_stage("heun", denoiser, x, sigmas, callback, s_churn, _heun_stage)


def sample_dpm_2(denoiser, x, sigmas, *, sampling, noise_sampler=None, callback=None, s_churn=0.0, s_tmin=0.0,
                 s_tmax=float("inf"), s_noise=1.0):
    """DPM-Solver-2 in Karras form: the slope at the log-midpoint sigma carries the whole step."""
    return _two_stage("dpm_2", denoiser, x, sigmas, callback, s_churn, _dpm_2_stage)


def lms_coefficients(knots, i: int, order: int) -> list:
    """The Adams-Bashforth weights of step ``i``: the integral over ``[knots[i], knots[i+1]]`` of the Lagrange basis
    polynomial of each of the last ``order`` knots (newest first), by ``scipy.integrate.quad`` (epsrel 1e-4)."""
    from scipy import integrate

    if not 1 <= order <= i + 1:
        raise ValueError(f"order={order}: step {i} has only {i + 1} earlier slopes; pass 1 <= order <= {i + 1}")

    def basis(tau, j):
        value = 1.0
        for k in range(order):
            if k != j:
                value *= (tau - knots[i - k]) / (knots[i - j] - knots[i - k])
        return value

    return [integrate.quad(basis, knots[i], knots[i + 1], args=(j,), epsrel=1e-4)[0] for j in range(order)]


def sample_lms(denoiser, x, sigmas, *, sampling, noise_sampler=None, callback=None, order=4):
    """Linear multistep (Adams-Bashforth in sigma) over the last ``order`` slopes; the estimate at a zero sigma."""
    host = _check_run("lms", denoiser, x, sigmas)
    if isinstance(order, bool) or not isinstance(order, int) or order < 1:
        raise ValueError(f"order={order!r}: lms takes an int order >= 1 (ComfyUI's default 4)")
    knots = sigmas.detach().cpu().numpy()  # the sigmas' own dtype, as the weights' integrand sees them
    weights = [lms_coefficients(knots, i, min(i + 1, order)) if host[i + 1] != 0 else []
               for i in range(len(host) - 1)]  # all on the host before the first model call
    s_in, slopes = _ones(x), []
    for i in range(len(host) - 1):
        denoised = denoiser(x, sigmas[i] * s_in)
        slopes = (slopes + [to_d(x, sigmas[i], denoised)])[-order:]
        _report(callback, i, x, denoised)
        if host[i + 1] == 0:
            x = denoised
        else:
            x = x + sum(w * slope for w, slope in zip(weights[i], reversed(slopes)))
    return x


def sample_lcm(denoiser, x, sigmas, *, sampling, noise_sampler=None, callback=None):
    """Latent consistency sampling: jump to the estimate, then re-noise it to the next sigma with the model
    sampling's ``noise_scaling`` and fresh noise."""
    host = _check_run("lcm", denoiser, x, sigmas)
    _needs("lcm", "sampling", sampling, "pass the model sampling (model_sampling.model_sampling_for(engine))")
    if any(value > 0 for value in host[1:]):
        _needs("lcm", "noise_sampler", noise_sampler, "pass step_noise.gaussian_noise_sampler(x, seed)")
    s_in = _ones(x)
    for i in range(len(host) - 1):
        denoised = denoiser(x, sigmas[i] * s_in)
        _report(callback, i, x, denoised)
        x = denoised
        if host[i + 1] > 0:
            x = sampling.noise_scaling(sigmas[i + 1], noise_sampler(sigmas[i], sigmas[i + 1]), x)
    return x


def _res_second_order(x, sigmas, i, denoised, old_denoised):
    """The RES two-step exponential-integrator update (Zhang et al., arXiv 2308.02157) in ``t = -log sigma``."""
    t, t_prev, t_next = sigmas[i].log().neg(), sigmas[i - 1].log().neg(), sigmas[i + 1].log().neg()
    h = t_next - t
    c2 = (t_prev - t) / h
    phi1 = torch.expm1(-h) / -h
    phi2 = (phi1 - 1.0) / -h
    b1 = torch.nan_to_num(phi1 - phi2 / c2, nan=0.0)
    b2 = torch.nan_to_num(phi2 / c2, nan=0.0)
    return h.neg().exp() * x + h * (b1 * denoised + b2 * old_denoised)


def sample_res_multistep(denoiser, x, sigmas, *, sampling, noise_sampler=None, callback=None, s_noise=1.0):
    """ComfyUI's res_multistep (its eta is 0, so no noise is added): Euler on the first step and into a zero sigma,
    the second-order RES multistep update in between."""
    host = _check_run("res_multistep", denoiser, x, sigmas)
    s_in, old_denoised = _ones(x), None
    for i in range(len(host) - 1):
        denoised = denoiser(x, sigmas[i] * s_in)
        _report(callback, i, x, denoised)
        if host[i + 1] == 0 or old_denoised is None:
            x = x + to_d(x, sigmas[i], denoised) * (sigmas[i + 1] - sigmas[i])
        else:
            x = _res_second_order(x, sigmas, i, denoised, old_denoised)
        old_denoised = denoised
    return x


SAMPLERS = {
    "euler": SamplerSpec(sample_euler, None),
    "euler_ancestral": SamplerSpec(sample_euler_ancestral, "gaussian"),
    "heun": SamplerSpec(sample_heun, None),
    "dpm_2": SamplerSpec(sample_dpm_2, None),
    "lms": SamplerSpec(sample_lms, None),
    "lcm": SamplerSpec(sample_lcm, "gaussian"),
    "res_multistep": SamplerSpec(sample_res_multistep, None),
    "ddim": SamplerSpec(sample_euler, None),  # ComfyUI's KSampler runs "ddim" as euler (random inpaint noise only)
}

"""ComfyUI's first-order and linear-multistep samplers with its meaning: euler (and ``ddim``, which ComfyUI runs as
euler), euler_ancestral (its rectified-flow form on flow models), heun, dpm_2, lms, lcm and res_multistep.

Conventions (``k_diffusion.sampling``): ``denoiser(x, sigma_vector) -> x0``; ``d = (x - x0) / sigma``; scalars stay
0-d float32 tensors on the latent's device, so each update rounds as ComfyUI's does; branch decisions read Python
floats of the same sigmas, so no step waits on the device. ``callback(i, x, denoised)`` runs once per step.
Invariant: for the same denoiser, sigmas and noise sampler the result equals ComfyUI's sampler of the same name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch


@dataclass(frozen=True)
class SamplerSpec:
    fn: Callable
    noise: Optional[str]  # "gaussian", "brownian" or None: the per-step noise ComfyUI gives the sampler


def to_d(x, sigma, denoised):
    return (x - denoised) / sigma


def ancestral_step(sigma_from, sigma_to, eta=1.0):
    """(sigma_down, sigma_up) of an ancestral step (Karras et al. 2022 with ComfyUI's clamp)."""
    if not eta:
        return sigma_to, 0.0
    sigma_up = torch.minimum(sigma_to, eta * (sigma_to ** 2 * (sigma_from ** 2 - sigma_to ** 2) / sigma_from ** 2) ** 0.5)
    sigma_down = (sigma_to ** 2 - sigma_up ** 2) ** 0.5
    return sigma_down, sigma_up


def _ones(x):
    return x.new_ones([x.shape[0]])


def _report(callback, i, x, denoised):
    if callback is not None:
        callback(i, x, denoised)


def sample_euler(denoiser, x, sigmas, *, sampling=None, noise_sampler=None, callback=None):
    s_in = _ones(x)
    for i in range(len(sigmas) - 1):
        denoised = denoiser(x, sigmas[i] * s_in)
        d = to_d(x, sigmas[i], denoised)
        _report(callback, i, x, denoised)
        x = x + d * (sigmas[i + 1] - sigmas[i])
    return x


def _euler_ancestral_rf(denoiser, x, sigmas, noise_sampler, callback, eta=1.0, s_noise=1.0):
    s_in, last = _ones(x), sigmas.tolist()
    for i in range(len(sigmas) - 1):
        denoised = denoiser(x, sigmas[i] * s_in)
        _report(callback, i, x, denoised)
        if last[i + 1] == 0:
            x = denoised
            continue
        sigma_down = sigmas[i + 1] * (1 + (sigmas[i + 1] / sigmas[i] - 1) * eta)
        alpha_next, alpha_down = 1 - sigmas[i + 1], 1 - sigma_down
        renoise = (sigmas[i + 1] ** 2 - sigma_down ** 2 * alpha_next ** 2 / alpha_down ** 2) ** 0.5
        ratio = sigma_down / sigmas[i]
        x = ratio * x + (1 - ratio) * denoised
        if eta > 0:
            x = (alpha_next / alpha_down) * x + noise_sampler(sigmas[i], sigmas[i + 1]) * s_noise * renoise
    return x


def sample_euler_ancestral(denoiser, x, sigmas, *, sampling=None, noise_sampler=None, callback=None, eta=1.0,
                           s_noise=1.0):
    if sampling is not None and sampling.is_flow:
        return _euler_ancestral_rf(denoiser, x, sigmas, noise_sampler, callback, eta, s_noise)
    s_in, values = _ones(x), sigmas.tolist()
    for i in range(len(sigmas) - 1):
        denoised = denoiser(x, sigmas[i] * s_in)
        sigma_down, sigma_up = ancestral_step(sigmas[i], sigmas[i + 1], eta)
        _report(callback, i, x, denoised)
        if values[i + 1] == 0:  # exactly when sigma_down is 0 (eta <= 1), decided without waiting for the device
            x = denoised
        else:
            d = to_d(x, sigmas[i], denoised)
            x = x + d * (sigma_down - sigmas[i]) + noise_sampler(sigmas[i], sigmas[i + 1]) * s_noise * sigma_up
    return x


def sample_heun(denoiser, x, sigmas, *, sampling=None, noise_sampler=None, callback=None):
    s_in, values = _ones(x), sigmas.tolist()
    for i in range(len(sigmas) - 1):
        sigma_hat = sigmas[i] * 1
        denoised = denoiser(x, sigma_hat * s_in)
        d = to_d(x, sigma_hat, denoised)
        _report(callback, i, x, denoised)
        dt = sigmas[i + 1] - sigma_hat
        if values[i + 1] == 0:
            x = x + d * dt
        else:
            x_2 = x + d * dt
            d_2 = to_d(x_2, sigmas[i + 1], denoiser(x_2, sigmas[i + 1] * s_in))
            x = x + (d + d_2) / 2 * dt
    return x


def sample_dpm_2(denoiser, x, sigmas, *, sampling=None, noise_sampler=None, callback=None):
    s_in, values = _ones(x), sigmas.tolist()
    for i in range(len(sigmas) - 1):
        sigma_hat = sigmas[i]
        denoised = denoiser(x, sigma_hat * s_in)
        d = to_d(x, sigma_hat, denoised)
        _report(callback, i, x, denoised)
        if values[i + 1] == 0:
            x = x + d * (sigmas[i + 1] - sigma_hat)
        else:
            sigma_mid = sigma_hat.log().lerp(sigmas[i + 1].log(), 0.5).exp()
            x_2 = x + d * (sigma_mid - sigma_hat)
            d_2 = to_d(x_2, sigma_mid, denoiser(x_2, sigma_mid * s_in))
            x = x + d_2 * (sigmas[i + 1] - sigma_hat)
    return x


def _lms_coefficient(order: int, t, i: int, j: int) -> float:
    """The integral over [t_i, t_i+1] of the Lagrange basis polynomial j of the last ``order`` sigmas."""
    from scipy import integrate

    def basis(tau):
        prod = 1.0
        for k in range(order):
            if j != k:
                prod *= (tau - t[i - k]) / (t[i - j] - t[i - k])
        return prod

    return integrate.quad(basis, t[i], t[i + 1], epsrel=1e-4)[0]


def sample_lms(denoiser, x, sigmas, *, sampling=None, noise_sampler=None, callback=None, order=4):
    s_in, t = _ones(x), sigmas.detach().cpu().numpy()
    ds = []
    for i in range(len(sigmas) - 1):
        denoised = denoiser(x, sigmas[i] * s_in)
        ds = (ds + [to_d(x, sigmas[i], denoised)])[-order:]
        _report(callback, i, x, denoised)
        if t[i + 1] == 0:
            x = denoised
        else:
            n = min(i + 1, order)
            coeffs = [_lms_coefficient(n, t, i, j) for j in range(n)]
            x = x + sum(c * d for c, d in zip(coeffs, reversed(ds)))
    return x


def sample_lcm(denoiser, x, sigmas, *, sampling=None, noise_sampler=None, callback=None):
    s_in, values = _ones(x), sigmas.tolist()
    for i in range(len(sigmas) - 1):
        denoised = denoiser(x, sigmas[i] * s_in)
        _report(callback, i, x, denoised)
        x = denoised
        if values[i + 1] > 0:
            x = sampling.noise_scaling(sigmas[i + 1], noise_sampler(sigmas[i], sigmas[i + 1]), x)
    return x


def sample_res_multistep(denoiser, x, sigmas, *, sampling=None, noise_sampler=None, callback=None, s_noise=1.0):
    """ComfyUI's res_multistep (eta 0): Euler first, then the second-order multistep update of arXiv 2308.02157."""
    s_in, values = _ones(x), sigmas.tolist()
    old_sigma_down = old_denoised = None
    for i in range(len(sigmas) - 1):
        denoised = denoiser(x, sigmas[i] * s_in)
        sigma_down = sigmas[i + 1]  # eta 0: no ancestral split
        _report(callback, i, x, denoised)
        if values[i + 1] == 0 or old_denoised is None:
            x = x + to_d(x, sigmas[i], denoised) * (sigma_down - sigmas[i])
        else:
            t, t_old = sigmas[i].log().neg(), old_sigma_down.log().neg()
            t_next, t_prev = sigma_down.log().neg(), sigmas[i - 1].log().neg()
            h = t_next - t
            c2 = (t_prev - t_old) / h
            phi1 = torch.expm1(-h) / -h
            phi2 = (phi1 - 1.0) / -h
            b1 = torch.nan_to_num(phi1 - phi2 / c2, nan=0.0)
            b2 = torch.nan_to_num(phi2 / c2, nan=0.0)
            x = (-h).exp() * x + h * (b1 * denoised + b2 * old_denoised)
        old_denoised, old_sigma_down = denoised, sigma_down
    return x


SAMPLERS = {
    "euler": SamplerSpec(sample_euler, None),
    "euler_ancestral": SamplerSpec(sample_euler_ancestral, "gaussian"),
    "heun": SamplerSpec(sample_heun, None),
    "dpm_2": SamplerSpec(sample_dpm_2, None),
    "lms": SamplerSpec(sample_lms, None),
    "lcm": SamplerSpec(sample_lcm, "gaussian"),
    "res_multistep": SamplerSpec(sample_res_multistep, None),
    "ddim": SamplerSpec(sample_euler, None),
}

"""ComfyUI's DPM-Solver++ samplers with its meaning: dpmpp_2m, dpmpp_sde, dpmpp_2m_sde (midpoint; heun by
option) and dpmpp_3m_sde.

The SDE samplers work in half-log-SNR ``lambda = log(alpha / sigma)``: ``-log sigma`` for discrete models and
``-logit sigma`` for flow models (whose first sigma of 1 is moved to ``percent_to_sigma(1e-4)`` so lambda stays
finite), and draw Brownian-tree noise (``step_noise``). Scalars stay 0-d float32 tensors as in ComfyUI, branch
decisions read Python floats. Invariant: for the same denoiser, sigmas and noise sampler the result equals ComfyUI's
sampler of the same name. Why the checks: a sampler that lacks its noise sampler or model sampling fails before the
first model call with a ValueError naming the fix, instead of a TypeError mid-run.
"""
from __future__ import annotations

import torch

from .samplers_basic import SamplerSpec, _ones, _report, ancestral_step, check_sigmas


def _lambda(sigma, sampling):
    return sigma.logit().neg() if sampling.is_flow else sigma.log().neg()


def _sigma_of_lambda(half_log_snr, sampling):
    return half_log_snr.neg().sigmoid() if sampling.is_flow else half_log_snr.neg().exp()


def _check_sde(name, sigmas, sampling, noise_sampler, eta, s_noise):
    """The SDE samplers' inputs: sigmas, the model sampling (lambda depends on it) and, when they add noise, the
    noise sampler ComfyUI would build (a Brownian tree seeded with the run's seed)."""
    check_sigmas(name, sigmas)
    if not hasattr(sampling, "is_flow") or not hasattr(sampling, "percent_to_sigma"):
        raise ValueError(f"sampling={sampling!r}: {name} needs the model sampling (is_flow, percent_to_sigma); pass "
                         f"model_sampling.model_sampling_for(engine)")
    if noise_sampler is None and eta > 0 and s_noise > 0:
        raise ValueError(f"noise_sampler=None: {name} adds noise at eta={eta}, s_noise={s_noise}; pass "
                         f"registry.noise_sampler_for(spec, x, sigmas, seed, sampling) (a Brownian tree, as ComfyUI), "
                         f"or eta=0 for the deterministic solver")


def _offset_first(sigmas, sampling):
    """A flow model's first sigma of 1 (infinite lambda) moved just below it, as ComfyUI does; plus the floats."""
    values = sigmas.tolist()
    if len(values) > 1 and sampling.is_flow and values[0] >= 1:
        sigmas = sigmas.clone()
        sigmas[0] = values[0] = sampling.percent_to_sigma(1e-4)
    return sigmas, values


def sample_dpmpp_2m(denoiser, x, sigmas, *, sampling=None, noise_sampler=None, callback=None):
    """Deterministic; ``-log sigma`` time on every model, as ComfyUI's (it has no flow branch)."""
    check_sigmas("dpmpp_2m", sigmas)
    s_in, values = _ones(x), sigmas.tolist()
    old_denoised = None
    for i in range(len(sigmas) - 1):
        denoised = denoiser(x, sigmas[i] * s_in)
        _report(callback, i, x, denoised)
        t, t_next = sigmas[i].log().neg(), sigmas[i + 1].log().neg()
        h = t_next - t
        if old_denoised is not None and values[i + 1] != 0:
            r = (t - sigmas[i - 1].log().neg()) / h
            denoised_d = (1 + 1 / (2 * r)) * denoised - (1 / (2 * r)) * old_denoised
        else:
            denoised_d = denoised
        x = (t_next.neg().exp() / t.neg().exp()) * x - (-h).expm1() * denoised_d
        old_denoised = denoised
    return x


def sample_dpmpp_sde(denoiser, x, sigmas, *, sampling=None, noise_sampler=None, callback=None, eta=1.0, s_noise=1.0,
                     r=1 / 2):
    _check_sde("dpmpp_sde", sigmas, sampling, noise_sampler, eta, s_noise)
    if len(sigmas) <= 1:
        return x
    s_in = _ones(x)
    sigmas, values = _offset_first(sigmas, sampling)
    for i in range(len(sigmas) - 1):
        denoised = denoiser(x, sigmas[i] * s_in)
        _report(callback, i, x, denoised)
        if values[i + 1] == 0:
            x = denoised
            continue
        lambda_s, lambda_t = _lambda(sigmas[i], sampling), _lambda(sigmas[i + 1], sampling)
        h = lambda_t - lambda_s
        lambda_s_1 = lambda_s + r * h
        fac = 1 / (2 * r)
        sigma_s_1 = _sigma_of_lambda(lambda_s_1, sampling)
        alpha_s = sigmas[i] * lambda_s.exp()
        alpha_s_1 = sigma_s_1 * lambda_s_1.exp()
        alpha_t = sigmas[i + 1] * lambda_t.exp()
        sd, su = ancestral_step(lambda_s.neg().exp(), lambda_s_1.neg().exp(), eta)
        h_ = sd.log().neg() - lambda_s
        x_2 = (alpha_s_1 / alpha_s) * (-h_).exp() * x - alpha_s_1 * (-h_).expm1() * denoised
        if eta > 0 and s_noise > 0:
            x_2 = x_2 + alpha_s_1 * noise_sampler(sigmas[i], sigma_s_1) * s_noise * su
        denoised_2 = denoiser(x_2, sigma_s_1 * s_in)
        sd, su = ancestral_step(lambda_s.neg().exp(), lambda_t.neg().exp(), eta)
        h_ = sd.log().neg() - lambda_s
        denoised_d = (1 - fac) * denoised + fac * denoised_2
        x = (alpha_t / alpha_s) * (-h_).exp() * x - alpha_t * (-h_).expm1() * denoised_d
        if eta > 0 and s_noise > 0:
            x = x + alpha_t * noise_sampler(sigmas[i], sigmas[i + 1]) * s_noise * su
    return x


def _sde_base_step(x, denoised, sigmas, i, h, h_eta, lambda_t, eta):
    alpha_t = sigmas[i + 1] * lambda_t.exp()
    x = sigmas[i + 1] / sigmas[i] * (-h * eta).exp() * x + alpha_t * (-h_eta).expm1().neg() * denoised
    return x, alpha_t


def _sde_noise(x, noise_sampler, sigmas, i, h, eta, s_noise):
    if eta > 0 and s_noise > 0:
        x = x + noise_sampler(sigmas[i], sigmas[i + 1]) * sigmas[i + 1] * (-2 * h * eta).expm1().neg().sqrt() * s_noise
    return x


def sample_dpmpp_2m_sde(denoiser, x, sigmas, *, sampling=None, noise_sampler=None, callback=None, eta=1.0,
                        s_noise=1.0, solver_type="midpoint"):
    """Second-order correction 'midpoint' (ComfyUI's default for this name) or 'heun'."""
    if solver_type not in ("midpoint", "heun"):
        raise ValueError(f"solver_type={solver_type!r}: dpmpp_2m_sde takes 'midpoint' (ComfyUI's default) or 'heun'")
    _check_sde("dpmpp_2m_sde", sigmas, sampling, noise_sampler, eta, s_noise)
    if len(sigmas) <= 1:
        return x
    s_in = _ones(x)
    sigmas, values = _offset_first(sigmas, sampling)
    old_denoised, h, h_last = None, None, None
    for i in range(len(sigmas) - 1):
        denoised = denoiser(x, sigmas[i] * s_in)
        _report(callback, i, x, denoised)
        if values[i + 1] == 0:
            x = denoised
        else:
            lambda_s, lambda_t = _lambda(sigmas[i], sampling), _lambda(sigmas[i + 1], sampling)
            h = lambda_t - lambda_s
            h_eta = h * (eta + 1)
            x, alpha_t = _sde_base_step(x, denoised, sigmas, i, h, h_eta, lambda_t, eta)
            if old_denoised is not None:
                r = h_last / h
                if solver_type == "heun":
                    x = x + alpha_t * ((-h_eta).expm1().neg() / (-h_eta) + 1) * (1 / r) * (denoised - old_denoised)
                else:
                    x = x + 0.5 * alpha_t * (-h_eta).expm1().neg() * (1 / r) * (denoised - old_denoised)
            x = _sde_noise(x, noise_sampler, sigmas, i, h, eta, s_noise)
        old_denoised, h_last = denoised, h
    return x


def sample_dpmpp_3m_sde(denoiser, x, sigmas, *, sampling=None, noise_sampler=None, callback=None, eta=1.0,
                        s_noise=1.0):
    _check_sde("dpmpp_3m_sde", sigmas, sampling, noise_sampler, eta, s_noise)
    if len(sigmas) <= 1:
        return x
    s_in = _ones(x)
    sigmas, values = _offset_first(sigmas, sampling)
    denoised_1 = denoised_2 = None
    h = h_1 = h_2 = None
    for i in range(len(sigmas) - 1):
        denoised = denoiser(x, sigmas[i] * s_in)
        _report(callback, i, x, denoised)
        if values[i + 1] == 0:
            x = denoised
        else:
            lambda_s, lambda_t = _lambda(sigmas[i], sampling), _lambda(sigmas[i + 1], sampling)
            h = lambda_t - lambda_s
            h_eta = h * (eta + 1)
            x, alpha_t = _sde_base_step(x, denoised, sigmas, i, h, h_eta, lambda_t, eta)
            if h_2 is not None:
                r0, r1 = h_1 / h, h_2 / h
                d1_0 = (denoised - denoised_1) / r0
                d1_1 = (denoised_1 - denoised_2) / r1
                d1 = d1_0 + (d1_0 - d1_1) * r0 / (r0 + r1)
                d2 = (d1_0 - d1_1) / (r0 + r1)
                phi_2 = h_eta.neg().expm1() / h_eta + 1
                phi_3 = phi_2 / h_eta - 0.5
                x = x + (alpha_t * phi_2) * d1 - (alpha_t * phi_3) * d2
            elif h_1 is not None:
                phi_2 = h_eta.neg().expm1() / h_eta + 1
                x = x + (alpha_t * phi_2) * ((denoised - denoised_1) / (h_1 / h))
            x = _sde_noise(x, noise_sampler, sigmas, i, h, eta, s_noise)
        denoised_1, denoised_2 = denoised, denoised_1
        h_1, h_2 = h, h_1
    return x


SAMPLERS = {
    "dpmpp_sde": SamplerSpec(sample_dpmpp_sde, "brownian"),
    "dpmpp_2m": SamplerSpec(sample_dpmpp_2m, None),
    "dpmpp_2m_sde": SamplerSpec(sample_dpmpp_2m_sde, "brownian"),
    "dpmpp_3m_sde": SamplerSpec(sample_dpmpp_3m_sde, "brownian"),
}

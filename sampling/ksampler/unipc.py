"""ComfyUI's ``uni_pc`` sampler: UniPC (Zhao et al. 2023), variant B(h) = h ("bh1"), data prediction, multistep of
order ``min(3, len(sigmas) - 2)`` with lower orders first and last, corrector on every step but the final one,
written for the one path ComfyUI's KSampler takes (its general UniPC class has many other options).

Time is sigma (ComfyUI's ``SigmaConvert``): ``alpha = 1 / sqrt(sigma^2 + 1)``, ``std = sigma / sqrt(sigma^2 + 1)``,
``lambda = log alpha - log std``; the model is read as data prediction through the noise the denoiser implies at
the scaled input. A final sigma of 0 is replaced by 0.001 in the caller's own sigma tensor, as ComfyUI does, so
the caller's ``inverse_noise_scaling`` sees that value too (it matters for flow models). The step coefficients
are 0-d tensors stacked on the latent's device and solved without an error check, so no step waits on the device
(ComfyUI builds them with ``torch.tensor`` and ``linalg.solve``: same numbers, a host sync each). Invariant: for
the same denoiser and sigmas the result equals ComfyUI's ``sample_unipc``.
"""
from __future__ import annotations

import torch

from .samplers_basic import SamplerSpec, check_sigmas


def _log_alpha(sigma):
    return 0.5 * torch.log(1 / ((sigma * sigma) + 1))


def _std(sigma):
    return torch.sqrt(1. - torch.exp(2. * _log_alpha(sigma)))


def _lambda(sigma):
    log_alpha = _log_alpha(sigma)
    return log_alpha - 0.5 * torch.log(1. - torch.exp(2. * log_alpha))


def _b4(v, dims):
    return v.reshape(v.shape + (1,) * (dims - v.dim()))


def _solve(a, b):
    return torch.linalg.solve_ex(a, b, check_errors=False)[0]


class _DataModel:
    """Data prediction at ``x`` (UniPC's scaled space) from the denoiser, as ComfyUI's wrappers compute it."""

    def __init__(self, denoiser):
        self.denoiser = denoiser

    def __call__(self, x, t):
        s = t.view(t.shape[:1] + (1,) * (x.ndim - 1))
        inp = x * ((s ** 2 + 1.0) ** 0.5)
        eps = (inp - self.denoiser(inp, t)) / s
        return (x - _b4(_std(t), x.dim()) * eps) / _b4(torch.exp(_log_alpha(t)), x.dim())


def _coefficients(h, rks, order):
    """B(h) = h: ``hh = -h``, ``h phi_1``, the Vandermonde rows ``rks^k`` and the right-hand side ``b``."""
    hh = -h[0]
    h_phi_1 = torch.expm1(hh)
    h_phi_k = h_phi_1 / hh - 1
    factorial, rows, b = 1, [], []
    for i in range(1, order + 1):
        rows.append(torch.pow(rks, i - 1))
        b.append(h_phi_k * factorial / hh)
        factorial *= i + 1
        h_phi_k = h_phi_k / hh - 1 / factorial
    return hh, h_phi_1, torch.stack(rows), torch.stack(b)


def _update(model, x, models, times, t, order, use_corrector, half):
    """One UniPC-B(h) predictor(-corrector) step to ``t``; returns (x_t, model at x_t or None)."""
    dims = x.dim()
    t0, m0 = times[-1], models[-1]
    lam0 = _lambda(t0)
    h = _lambda(t) - lam0
    rks, d1s = [], []
    for i in range(1, order):
        rk = ((_lambda(times[-(i + 1)]) - lam0) / h)[0]
        rks.append(rk)
        d1s.append((models[-(i + 1)] - m0) / rk)
    rks = torch.stack(rks + [torch.ones((), dtype=h.dtype, device=h.device)])
    hh, h_phi_1, R, b = _coefficients(h, rks, order)
    alpha_t = torch.exp(_log_alpha(t))
    D1s = torch.stack(d1s, dim=1) if d1s else None
    x_t_ = _b4(_std(t) / _std(t0), dims) * x - _b4(alpha_t * h_phi_1, dims) * m0
    pred_res = 0
    if D1s is not None:
        rhos_p = half if order == 2 else _solve(R[:-1, :-1], b[:-1])
        pred_res = torch.tensordot(D1s, rhos_p, dims=([1], [0]))
    x_t = x_t_ - _b4(alpha_t * hh, dims) * pred_res
    if not use_corrector:
        return x_t, None
    rhos_c = half if order == 1 else _solve(R, b)
    model_t = model(x_t, t)
    corr_res = torch.tensordot(D1s, rhos_c[:-1], dims=([1], [0])) if D1s is not None else 0
    x_t = x_t_ - _b4(alpha_t * hh, dims) * (corr_res + rhos_c[-1] * (model_t - m0))
    return x_t, model_t


def sample_uni_pc(denoiser, x, sigmas, *, sampling=None, noise_sampler=None, callback=None):
    """Deterministic; ``callback(i, x, denoised)`` after each step with the latest data prediction."""
    check_sigmas("uni_pc", sigmas)
    if sigmas.numel() == 0:
        raise ValueError("sigmas=[]: uni_pc needs at least one sigma (no sigmas means nothing to sample)")
    if float(sigmas[-1]) == 0:
        sigmas[-1] = 0.001  # in place, as ComfyUI (module docstring)
    x = x / torch.sqrt(1.0 + sigmas[0] ** 2.0)
    model, half = _DataModel(denoiser), torch.full((1,), 0.5, dtype=sigmas.dtype, device=sigmas.device)
    steps, order = len(sigmas) - 1, min(3, len(sigmas) - 2)
    vec = lambda k: sigmas[k].expand(x.shape[0])  # noqa: E731
    models, times = [], []
    for index in range(steps):
        if index == 0:
            models, times = [model(x, vec(0))], [vec(0)]
        elif index < order:
            x, m = _update(model, x, models, times, vec(index), index, True, half)
            models.append(m)
            times.append(vec(index))
        else:
            for step in range(index, index + 1 + (1 if index == steps - 1 else 0)):
                x, m = _update(model, x, models, times, vec(step), min(order, steps + 1 - step), step != steps, half)
                times[:-1], models[:-1] = times[1:], models[1:]
                times[-1] = vec(step)
                if step < steps:
                    models[-1] = m
        if callback is not None:
            callback(index, x, models[-1])
    return x / torch.exp(_log_alpha(sigmas[-1]))


SAMPLERS = {"uni_pc": SamplerSpec(sample_uni_pc, None)}

"""ComfyUI's ``uni_pc`` sampler: UniPC (Zhao et al. 2023), variant B(h) = h ("bh1"), data prediction, multistep of
order ``min(3, len(sigmas) - 2)`` with lower orders first and last, corrector on every step but the final one,
written for the one path ComfyUI's KSampler takes (its general UniPC class has many other options).

Time is sigma (ComfyUI's ``SigmaConvert``): ``alpha = 1 / sqrt(sigma^2 + 1)``, ``std = sigma / sqrt(sigma^2 + 1)``,
``lambda = log alpha - log std``; the model is read as data prediction through the noise the denoiser implies at
the scaled input. A final sigma of 0 is replaced by 0.001 in the caller's own sigma tensor, as ComfyUI does, so
the caller's ``inverse_noise_scaling`` sees that value too (it matters for flow models). Invariant: for the same
denoiser and sigmas the result equals ComfyUI's ``sample_unipc``.
"""
from __future__ import annotations

import torch

from .samplers_basic import SamplerSpec


def _log_alpha(sigma):
    return 0.5 * torch.log(1 / ((sigma * sigma) + 1))


def _std(sigma):
    return torch.sqrt(1. - torch.exp(2. * _log_alpha(sigma)))


def _lambda(sigma):
    log_alpha = _log_alpha(sigma)
    return log_alpha - 0.5 * torch.log(1. - torch.exp(2. * log_alpha))


def _b4(v, dims):
    return v.reshape(v.shape + (1,) * (dims - v.dim()))


class _Model:
    """Data prediction at ``x`` (UniPC's scaled space) from the denoiser, as ComfyUI's wrappers compute it."""

    def __init__(self, denoiser, callback):
        self.denoiser, self.callback = denoiser, callback

    def __call__(self, x, t):
        s = t.view(t.shape[:1] + (1,) * (x.ndim - 1))
        inp = x * ((s ** 2 + 1.0) ** 0.5)
        eps = (inp - self.denoiser(inp, t)) / s
        return (x - _b4(_std(t), x.dim()) * eps) / _b4(torch.exp(_log_alpha(t)), x.dim())


def _coefficients(h, rks, order, device):
    hh = -h[0]
    h_phi_1 = torch.expm1(hh)
    h_phi_k = h_phi_1 / hh - 1
    factorial, rows, b = 1, [], []
    for i in range(1, order + 1):
        rows.append(torch.pow(rks, i - 1))
        b.append(h_phi_k * factorial / hh)
        factorial *= i + 1
        h_phi_k = h_phi_k / hh - 1 / factorial
    return hh, h_phi_1, torch.stack(rows), torch.tensor(b, device=device)


def _update(model, x, models, times, t, order, use_corrector):
    """One UniPC-B(h) predictor(-corrector) step to ``t``; returns (x_t, model at x_t or None)."""
    dims = x.dim()
    t0, m0 = times[-1], models[-1]
    lam0, lam_t = _lambda(t0), _lambda(t)
    h = lam_t - lam0
    rks, d1s = [], []
    for i in range(1, order):
        rk = ((_lambda(times[-(i + 1)]) - lam0) / h)[0]
        rks.append(rk)
        d1s.append((models[-(i + 1)] - m0) / rk)
    rks.append(1.)
    rks = torch.tensor(rks, device=x.device)
    hh, h_phi_1, R, b = _coefficients(h, rks, order, x.device)
    alpha_t = torch.exp(_log_alpha(t))
    D1s = torch.stack(d1s, dim=1) if d1s else None
    x_t_ = _b4(_std(t) / _std(t0), dims) * x - _b4(alpha_t * h_phi_1, dims) * m0
    pred_res = 0
    if D1s is not None:
        rhos_p = torch.tensor([0.5], device=b.device) if order == 2 else torch.linalg.solve(R[:-1, :-1], b[:-1])
        pred_res = torch.tensordot(D1s, rhos_p, dims=([1], [0]))
    x_t = x_t_ - _b4(alpha_t * hh, dims) * pred_res
    if not use_corrector:
        return x_t, None
    rhos_c = torch.tensor([0.5], device=b.device) if order == 1 else torch.linalg.solve(R, b)
    model_t = model(x_t, t)
    corr_res = torch.tensordot(D1s, rhos_c[:-1], dims=([1], [0])) if D1s is not None else 0
    x_t = x_t_ - _b4(alpha_t * hh, dims) * (corr_res + rhos_c[-1] * (model_t - m0))
    return x_t, model_t


def sample_uni_pc(denoiser, x, sigmas, *, sampling=None, noise_sampler=None, callback=None):
    if float(sigmas[-1]) == 0:
        sigmas[-1] = 0.001  # in place, as ComfyUI (module docstring)
    timesteps = sigmas
    x = x / torch.sqrt(1.0 + timesteps[0] ** 2.0)
    model = _Model(denoiser, callback)
    steps = len(timesteps) - 1
    order = min(3, len(timesteps) - 2)
    vec = lambda k: timesteps[k].expand(x.shape[0])  # noqa: E731
    models, times = [model(x, vec(0))], [vec(0)]
    for index in range(steps):
        if index == 0:
            pass
        elif index < order:
            x, m = _update(model, x, models, times, vec(index), index, True)
            models.append(m if m is not None else model(x, vec(index)))
            times.append(vec(index))
        elif index >= order:
            for step in range(index, index + 1 + (1 if index == steps - 1 else 0)):
                step_order = min(order, steps + 1 - step)
                x, m = _update(model, x, models, times, vec(step), step_order, step != steps)
                times[:-1], models[:-1] = times[1:], models[1:]
                times[-1] = vec(step)
                if step < steps:
                    models[-1] = m if m is not None else model(x, vec(step))
        if callback is not None:
            callback(index, x, models[-1])
    return x / torch.exp(_log_alpha(timesteps[-1]))


SAMPLERS = {"uni_pc": SamplerSpec(sample_uni_pc, None)}

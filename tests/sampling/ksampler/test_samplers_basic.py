"""``samplers_basic`` solves the equations it names, without ComfyUI (equality with ComfyUI is the comfyui-marked
worker test's): on data ``N(m, S^2)``, whose ideal denoiser is affine in x, the probability-flow ODE has a closed-form
solution and each deterministic sampler converges to it at its order (Euler 1, Heun / DPM-2 / RES multistep 2, LMS >=
2) on discrete and flow sigma scales; ancestral steps land on the next sigma's noise level; LCM re-noises the estimate
to each sigma; LMS weights are integrals of Lagrange polynomials; callbacks, call counts and input errors are as
documented."""
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy.interpolate import lagrange

from leandiffusion.sampling.ksampler.samplers_basic import SAMPLERS, ancestral_step, lms_coefficients

MEAN, S = 0.4, 0.7  # the data's mean and standard deviation
EPS = SimpleNamespace(is_flow=False, noise_scaling=lambda sigma, noise, latent, max_denoise=False: noise * sigma + latent)
FLOW = SimpleNamespace(is_flow=True,
                       noise_scaling=lambda sigma, noise, latent, max_denoise=False: sigma * noise + (1 - sigma) * latent)
ORDERS = {"euler": 1, "ddim": 1, "heun": 2, "dpm_2": 2, "res_multistep": 2, "lms": 2}


def _alpha(sigma, flow):
    return 1 - sigma if flow else torch.ones_like(sigma)


def ideal_denoiser(flow: bool, calls=None):
    """E[x0 | x] for x = alpha x0 + sigma n, x0 ~ N(MEAN, S^2): affine in x."""
    def denoise(x, sigma):
        if calls is not None:
            calls.append(sigma.clone())
        s = sigma.view(-1, 1, 1, 1)
        a = _alpha(s, flow)
        return MEAN + a * S ** 2 * (x - a * MEAN) / (a ** 2 * S ** 2 + s ** 2)
    return denoise


def exact_end(x, sigma_from, sigma_to, flow):
    """The ODE keeps (x - alpha MEAN) / marginal std constant."""
    a0, a1 = _alpha(sigma_from, flow), _alpha(sigma_to, flow)
    std0, std1 = (a0 ** 2 * S ** 2 + sigma_from ** 2).sqrt(), (a1 ** 2 * S ** 2 + sigma_to ** 2).sqrt()
    return a1 * MEAN + (x - a0 * MEAN) * std1 / std0


def _log_sigmas(flow, steps):
    high, low = (0.95, 0.05) if flow else (12.0, 0.1)
    return torch.linspace(math.log(high), math.log(low), steps + 1, dtype=torch.float64).exp()


def _error(name, flow, steps):
    x0 = torch.randn(2, 3, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    sigmas = _log_sigmas(flow, steps)
    start = _alpha(sigmas[0], flow) * MEAN + x0 * (_alpha(sigmas[0], flow) ** 2 * S ** 2 + sigmas[0] ** 2).sqrt()
    out = SAMPLERS[name].fn(ideal_denoiser(flow), start, sigmas, sampling=FLOW if flow else EPS)
    return (out - exact_end(start, sigmas[0], sigmas[-1], flow)).abs().max().item()


@pytest.mark.parametrize("flow", [False, True], ids=["eps", "flow"])
@pytest.mark.parametrize("name", sorted(ORDERS))
def test_deterministic_samplers_converge_at_their_order(name, flow):
    coarse, fine = _error(name, flow, 32), _error(name, flow, 128)
    order = math.log(coarse / fine) / math.log(4)
    assert fine < (0.05 if ORDERS[name] == 1 else 1e-3) and order > ORDERS[name] - 0.15, (coarse, fine, order)
    if ORDERS[name] == 1:
        assert order < 1.5, order  # Euler is not secretly a higher-order method


def test_registry_names_and_noise():
    assert set(SAMPLERS) == {"euler", "euler_ancestral", "heun", "dpm_2", "lms", "ddim", "lcm", "res_multistep"}
    assert {name for name, spec in SAMPLERS.items() if spec.noise == "gaussian"} == {"euler_ancestral", "lcm"}
    assert all(spec.noise in (None, "gaussian") for spec in SAMPLERS.values())
    assert SAMPLERS["ddim"].fn is SAMPLERS["euler"].fn  # ComfyUI's KSampler runs "ddim" as euler


class FixedNoise:
    """A noise sampler returning one fixed draw, recording its calls."""

    def __init__(self, like):
        self.draw, self.calls = torch.randn(like.shape, dtype=like.dtype, generator=torch.Generator().manual_seed(9)), []

    def __call__(self, sigma, sigma_next):
        self.calls.append((float(sigma), float(sigma_next)))
        return self.draw


@pytest.mark.parametrize("flow", [False, True], ids=["eps", "flow"])
@pytest.mark.parametrize("eta", [1.0, 0.5])
def test_an_ancestral_step_lands_on_the_next_noise_level(flow, eta):
    """Point data m: from x = alpha m + sigma n0 the step must give alpha' m + (c n0 + r n) with c^2 + r^2 =
    sigma'^2 (the next sigma's noise variance, as the two noises are independent)."""
    sigma, sigma_next = (torch.tensor([0.8, 0.5], dtype=torch.float64) if flow else
                         torch.tensor([6.0, 2.5], dtype=torch.float64)).unbind()
    n0 = torch.randn(1, 4, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    x = _alpha(sigma, flow) * MEAN + sigma * n0
    noise = FixedNoise(x)
    out = SAMPLERS["euler_ancestral"].fn(lambda x_, s_: torch.full_like(x_, MEAN), x, torch.stack([sigma, sigma_next]),
                                         sampling=FLOW if flow else EPS, noise_sampler=noise, eta=eta)
    rest = out - _alpha(sigma_next, flow) * MEAN
    basis = torch.stack([n0.flatten(), noise.draw.flatten()], dim=1)
    (c, r), *_ = torch.linalg.lstsq(basis, rest.flatten().unsqueeze(1))
    torch.testing.assert_close(basis @ torch.stack([c, r]), rest.flatten().unsqueeze(1), rtol=0, atol=1e-12)
    assert (c ** 2 + r ** 2).item() == pytest.approx(sigma_next.item() ** 2, rel=1e-9)
    assert r.abs().item() > 0.1 * sigma_next.item() and noise.calls == [(sigma.item(), sigma_next.item())]


def test_ancestral_eta_zero_is_euler_and_needs_no_noise():
    sigmas = _log_sigmas(False, 6)
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    common = dict(sampling=EPS)
    euler = SAMPLERS["euler"].fn(ideal_denoiser(False), x, sigmas, **common)
    ancestral = SAMPLERS["euler_ancestral"].fn(ideal_denoiser(False), x, sigmas, eta=0.0, **common)
    assert torch.equal(ancestral, euler)
    flow_sigmas = _log_sigmas(True, 6)
    euler = SAMPLERS["euler"].fn(ideal_denoiser(True), x, flow_sigmas, sampling=FLOW)
    ancestral = SAMPLERS["euler_ancestral"].fn(ideal_denoiser(True), x, flow_sigmas, sampling=FLOW, eta=0.0)
    torch.testing.assert_close(ancestral, euler, rtol=0, atol=1e-12)


def test_ancestral_step_splits_the_next_variance():
    sigma_from, sigma_to = torch.tensor([9.0, 3.0, 1.0]), torch.tensor([3.0, 1.0, 0.0])
    down, up = ancestral_step(sigma_from, sigma_to, 1.0)
    torch.testing.assert_close(down ** 2 + up ** 2, sigma_to ** 2)
    assert down[-1] == 0 and up[-1] == 0
    down, up = ancestral_step(sigma_from, sigma_to, 5.0)  # an eta this large uses all of sigma_to for noise
    assert torch.equal(up, sigma_to) and torch.equal(down, torch.zeros(3))
    assert ancestral_step(sigma_from, sigma_to, 0.0) == (sigma_to, 0.0)


@pytest.mark.parametrize("sampling", [EPS, FLOW], ids=["eps", "flow"])
def test_lcm_renoises_the_estimate_to_each_sigma(sampling):
    sigmas = torch.tensor([0.9, 0.6, 0.3, 0.0], dtype=torch.float64)
    x = torch.randn(2, 4, 3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    noise, seen = FixedNoise(x), []
    out = SAMPLERS["lcm"].fn(lambda x_, s_: torch.full_like(x_, MEAN), x, sigmas, sampling=sampling,
                             noise_sampler=noise, callback=lambda i, x_i, d_i: seen.append(x_i))
    for i in (1, 2):
        expected = sampling.noise_scaling(sigmas[i], noise.draw, torch.full_like(x, MEAN))
        torch.testing.assert_close(seen[i], expected, rtol=0, atol=1e-15)
    assert torch.equal(out, torch.full_like(x, MEAN)) and len(noise.calls) == 2  # no noise into the final zero


@pytest.mark.parametrize("order", [1, 2, 3, 4])
def test_lms_weights_integrate_the_lagrange_basis(order):
    knots = np.array([10.0, 6.5, 4.0, 2.2, 1.1, 0.4], dtype=np.float64)
    i = 4
    weights = lms_coefficients(knots, i, order)
    past = [knots[i - k] for k in range(order)]  # newest first
    for j, weight in enumerate(weights):
        basis = lagrange(past, [1.0 if k == j else 0.0 for k in range(order)])
        antiderivative = np.polyint(basis)
        assert weight == pytest.approx(antiderivative(knots[i + 1]) - antiderivative(knots[i]), rel=1e-9, abs=1e-12)
    assert sum(weights) == pytest.approx(knots[i + 1] - knots[i], rel=1e-9)
    with pytest.raises(ValueError, match="order=6"):
        lms_coefficients(knots, i, 6)


@pytest.mark.parametrize("name,per_step", [("euler", 1), ("heun", 2), ("dpm_2", 2), ("lms", 1), ("res_multistep", 1),
                                           ("euler_ancestral", 1), ("lcm", 1)])
def test_one_callback_per_step_before_the_update(name, per_step):
    sigmas = torch.tensor([8.0, 3.0, 1.0, 0.3, 0.0])
    x = torch.randn(2, 4, 3, 3, generator=torch.Generator().manual_seed(3))
    calls, seen = [], []
    out = SAMPLERS[name].fn(ideal_denoiser(False, calls), x, sigmas, sampling=EPS, noise_sampler=FixedNoise(x),
                            callback=lambda i, x_i, d_i: seen.append((i, x_i, d_i)))
    assert [i for i, _, _ in seen] == [0, 1, 2, 3]
    assert torch.equal(seen[0][1], x) and all(d.shape == x.shape for _, _, d in seen)
    assert len(calls) == per_step * 3 + 1  # second-order steps take one call into the final zero sigma
    assert torch.equal(calls[0], sigmas[0].repeat(2)) and out.shape == x.shape and torch.isfinite(out).all()


def test_a_callback_can_interrupt():
    calls = []

    def stop(i, x, denoised):
        if i == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        SAMPLERS["heun"].fn(ideal_denoiser(False, calls), torch.ones(1, 4, 2, 2), torch.tensor([5.0, 2.0, 1.0, 0.0]),
                            sampling=EPS, callback=stop)
    assert len(calls) == 3  # step 0 (two calls) and step 1's first call, nothing after


def test_a_single_sigma_returns_the_start():
    x = torch.randn(1, 4, 2, 2)
    for name, spec in SAMPLERS.items():
        assert torch.equal(spec.fn(ideal_denoiser(False), x, torch.tensor([3.0]), sampling=EPS,
                                   noise_sampler=FixedNoise(x)), x), name


@pytest.mark.parametrize("name,kwargs,match", [
    ("euler", dict(sigmas=torch.ones(2, 3)), r"sigmas=\(2, 3\): euler takes a 1-D"),
    ("heun", dict(x=torch.ones(1, 4, 2, 2, dtype=torch.long)), "x: heun takes"),
    ("dpm_2", dict(denoiser="unet"), "denoiser='unet'"),
    ("euler_ancestral", dict(noise_sampler=None), "noise_sampler=None: euler_ancestral needs it"),
    ("euler_ancestral", dict(sampling=None), "sampling=None"),
    ("euler_ancestral", dict(eta=-0.5), "eta=-0.5"),
    ("euler_ancestral", dict(s_noise=float("nan")), "s_noise=nan"),
    ("lcm", dict(noise_sampler=None), "noise_sampler=None: lcm"),
    ("lms", dict(order=0), "order=0"),
    ("euler", dict(s_churn=0.5), "s_churn=0.5"),
])
def test_bad_input_fails_before_the_first_model_call(name, kwargs, match):
    calls = []
    args = dict(denoiser=ideal_denoiser(False, calls), x=torch.ones(1, 4, 2, 2), sigmas=torch.tensor([5.0, 1.0, 0.0]),
                sampling=EPS, noise_sampler=FixedNoise(torch.ones(1, 4, 2, 2)))
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        SAMPLERS[name].fn(args.pop("denoiser"), args.pop("x"), args.pop("sigmas"), **args)
    assert calls == []

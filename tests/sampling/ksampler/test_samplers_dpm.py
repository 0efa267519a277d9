"""``samplers_dpm`` without ComfyUI (its equality to ComfyUI is ``test_comfyui_dpm_unipc.py``'s): the solvers are
second order on a linear ODE with a known solution (eta 0 turns the SDE samplers into ODE solvers), the noise enters
through the noise sampler at the sigma pairs ComfyUI queries, a flow model's first sigma of 1 is moved below 1
(ComfyUI's CONST branch), batch rows stay independent, the callback sees every step and can interrupt, and bad
input fails before the first model call with a ValueError naming the fix."""
import math

import pytest
import torch

from leandiffusion.sampling.ksampler import samplers_dpm as dpm
from leandiffusion.sampling.ksampler.model_sampling import DiscreteSampling, FlowSampling
from leandiffusion.tests.sampling.ksampler.gaussian_toy import exact_end, ideal_denoiser, log_sigmas

SD = {"beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012, "num_train_timesteps": 1000}
SAMPLING = {False: DiscreteSampling(SD, "epsilon"), True: FlowSampling(3.0)}
RANGE = {False: (10.0, 0.05), True: (0.9, 0.05)}
ODE = {"dpmpp_2m": {}, "dpmpp_sde": {"eta": 0.0}, "dpmpp_2m_sde": {"eta": 0.0},
       "dpmpp_2m_sde-heun": {"eta": 0.0, "solver_type": "heun"}, "dpmpp_3m_sde": {"eta": 0.0}}
SDE = ["dpmpp_sde", "dpmpp_2m_sde", "dpmpp_3m_sde"]


def _fn(name):
    return dpm.SAMPLERS[name.split("-")[0]].fn


def _toy(x, sigma):
    """A nonlinear per-row map (rows must not mix)."""
    s = sigma.view(-1, 1, 1, 1)
    return torch.tanh(x * 1.3 + 0.2) / (1 + 0.1 * s) - 0.05 * x * s.sin()


class _RecordingNoise:
    def __init__(self, shape, seed=0):
        self.shape, self.g, self.calls = shape, torch.Generator().manual_seed(seed), []

    def __call__(self, sigma, sigma_next):
        self.calls.append((float(sigma), float(sigma_next)))
        return torch.randn(self.shape, generator=self.g)


@pytest.mark.parametrize("flow", [False, True], ids=["eps", "flow"])
@pytest.mark.parametrize("name", sorted(ODE))
def test_solvers_are_second_order_on_the_linear_ode(name, flow):
    """float64 so the order shows: a first-order solver shrinks the error 4x from 16 to 64 steps, these >= 10x."""
    x = torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    errors = []
    for steps in (16, 64):
        sigmas = log_sigmas(*RANGE[flow], steps)
        out = _fn(name)(ideal_denoiser(flow), x.clone(), sigmas, sampling=SAMPLING[flow], **ODE[name])
        exact = exact_end(x, sigmas, flow)
        errors.append(((out - exact).norm() / exact.norm()).item())
    assert errors[0] / errors[1] > 10, errors
    assert errors[1] < 2e-3, errors


def test_the_sigma_zero_step_returns_the_denoised_estimate():
    x = torch.randn(2, 4, 5, 5, generator=torch.Generator().manual_seed(1))
    sigmas = torch.tensor([3.0, 1.0, 0.0])
    seen = []
    for name in ODE:
        out = _fn(name)(_toy, x, sigmas, sampling=SAMPLING[False], callback=lambda i, xi, d: seen.append((i, xi, d)),
                        **ODE[name])
        i, x_last, denoised = seen[-1]
        assert i == 1 and torch.equal(out, denoised)
        torch.testing.assert_close(out, _toy(x_last, torch.full((2,), 1.0)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", SDE)
def test_noise_enters_through_the_noise_sampler_at_comfyuis_sigma_pairs(name):
    x = torch.randn(2, 4, 5, 5, generator=torch.Generator().manual_seed(2))
    sigmas = torch.tensor([8.0, 3.0, 1.0, 0.3, 0.0])
    a, b = _RecordingNoise(x.shape, seed=5), _RecordingNoise(x.shape, seed=6)
    out_a = _fn(name)(_toy, x, sigmas, sampling=SAMPLING[False], noise_sampler=a)
    out_b = _fn(name)(_toy, x, sigmas, sampling=SAMPLING[False], noise_sampler=b)
    quiet = _fn(name)(_toy, x, sigmas, sampling=SAMPLING[False], noise_sampler=a, s_noise=0.0)
    pairs = [(8.0, 3.0), (3.0, 1.0), (1.0, 0.3)]  # no noise into the final sigma-0 step
    if name == "dpmpp_sde":  # two half steps: to the midpoint sigma (in lambda), then to the next sigma
        pairs = [p for s, t in pairs for p in ((s, math.sqrt(s * t)), (s, t))]
    assert len(a.calls) == len(pairs)  # and none at s_noise 0
    assert [v for p in a.calls for v in p] == pytest.approx([v for p in pairs for v in p], rel=1e-6)
    assert (out_a - out_b).abs().max() > 1e-3 and (out_a - quiet).abs().max() > 1e-3


@pytest.mark.parametrize("name", SDE)
def test_a_flow_models_first_sigma_of_one_is_moved_below_one(name):
    """-logit(1) is infinite: ComfyUI starts a CONST model at percent_to_sigma(1e-4); the caller's sigmas stay."""
    x = torch.randn(2, 4, 5, 5, generator=torch.Generator().manual_seed(3))
    sigmas = torch.tensor([1.0, 0.7, 0.3, 0.0])
    asked = []

    def denoiser(x_in, sigma):
        asked.append(sigma.clone())
        return _toy(x_in, sigma)

    out = _fn(name)(denoiser, x, sigmas, sampling=SAMPLING[True], noise_sampler=_RecordingNoise(x.shape))
    assert torch.isfinite(out).all() and sigmas[0] == 1.0
    assert asked[0].tolist() == pytest.approx([SAMPLING[True].percent_to_sigma(1e-4)] * 2) and asked[0][0] < 1
    asked.clear()
    _fn(name)(denoiser, x, sigmas * 10, sampling=SAMPLING[False], noise_sampler=_RecordingNoise(x.shape))
    assert asked[0].tolist() == [10.0, 10.0]  # discrete models start where the schedule says


@pytest.mark.parametrize("name", sorted(ODE))
def test_batch_rows_are_independent_and_shapes_kept(name):
    x = torch.randn(3, 4, 6, 5, generator=torch.Generator().manual_seed(4))
    sigmas = torch.tensor([9.0, 4.0, 1.5, 0.5, 0.1, 0.0])
    run = lambda rows: _fn(name)(_toy, rows, sigmas, sampling=SAMPLING[False], **ODE[name])  # noqa: E731
    whole = run(x)
    assert whole.shape == x.shape and whole.dtype == x.dtype
    for row in range(3):
        torch.testing.assert_close(whole[row:row + 1], run(x[row:row + 1]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", sorted(ODE))
def test_the_callback_sees_every_step_and_can_interrupt(name):
    x = torch.randn(2, 4, 5, 5)
    sigmas = torch.tensor([9.0, 4.0, 1.5, 0.5, 0.0])
    steps, calls = [], []

    def denoiser(x_in, sigma):
        calls.append(1)
        return _toy(x_in, sigma)

    _fn(name)(denoiser, x, sigmas, sampling=SAMPLING[False], callback=lambda i, xi, d: steps.append(i), **ODE[name])
    assert steps == [0, 1, 2, 3]

    def stop(i, xi, d):
        if i == 1:
            raise InterruptedError("stop")

    calls.clear()
    with pytest.raises(InterruptedError):
        _fn(name)(denoiser, x, sigmas, sampling=SAMPLING[False], callback=stop, **ODE[name])
    assert len(calls) == (3 if name == "dpmpp_sde" else 2)  # dpmpp_sde's first step makes two model calls


@pytest.mark.parametrize("name", SDE)
def test_sde_samplers_without_noise_sampler_or_model_sampling_fail_first(name):
    x, sigmas, calls = torch.randn(1, 4, 4, 4), torch.tensor([5.0, 1.0, 0.0]), []
    denoiser = lambda x_in, s: calls.append(1) or x_in  # noqa: E731
    with pytest.raises(ValueError, match=r"noise_sampler=None: .*registry\.noise_sampler_for.*eta=0"):
        _fn(name)(denoiser, x, sigmas, sampling=SAMPLING[False])
    with pytest.raises(ValueError, match=r"sampling=None: .*model_sampling_for"):
        _fn(name)(denoiser, x, sigmas, sampling=None, noise_sampler=_RecordingNoise(x.shape))
    assert not calls
    _fn(name)(denoiser, x, sigmas, sampling=SAMPLING[False], eta=0.0)  # no noise drawn: none needed


def test_bad_sigmas_and_solver_type_are_refused():
    x = torch.randn(1, 4, 4, 4)
    with pytest.raises(ValueError, match=r"sigmas=\(2, 2\): dpmpp_2m takes a 1-D float tensor"):
        dpm.sample_dpmpp_2m(_toy, x, torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"sigmas=list: dpmpp_3m_sde"):
        dpm.sample_dpmpp_3m_sde(_toy, x, [1.0, 0.0], sampling=SAMPLING[False], eta=0.0)
    with pytest.raises(ValueError, match=r"solver_type='euler': dpmpp_2m_sde takes 'midpoint' .* or 'heun'"):
        dpm.sample_dpmpp_2m_sde(_toy, x, torch.tensor([1.0, 0.0]), sampling=SAMPLING[False], eta=0.0,
                                solver_type="euler")


def test_the_sde_samplers_ask_for_comfyuis_brownian_noise():
    assert {name: spec.noise for name, spec in dpm.SAMPLERS.items()} == {
        "dpmpp_2m": None, "dpmpp_sde": "brownian", "dpmpp_2m_sde": "brownian", "dpmpp_3m_sde": "brownian"}

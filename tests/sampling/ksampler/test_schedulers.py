"""ComfyUI's scheduler names and KSampler's rules around them (``sampling.ksampler.schedulers``), checked against
their definitions computed independently here (float64 formulas), and the penultimate-sigma and denoise rules.
The bit-for-bit equality with ComfyUI's own functions is the integration tests' (tests/integration)."""
import math

import numpy
import pytest
import torch

from leandiffusion.sampling.ksampler.model_sampling import DiscreteSampling, FlowSampling
from leandiffusion.sampling.ksampler import settings
from leandiffusion.sampling.ksampler.schedulers import DISCARD_PENULTIMATE, SCHEDULER_NAMES, calculate_sigmas, \
    sigmas_for

SD = {"beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012, "num_train_timesteps": 1000}
MODELS = {"eps": DiscreteSampling(SD, "epsilon"), "flow": FlowSampling(3.0)}


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("scheduler", SCHEDULER_NAMES)
@pytest.mark.parametrize("steps", [1, 4, 9, 30])
def test_every_schedule_descends_from_about_sigma_max_to_zero(model, scheduler, steps):
    ms = MODELS[model]
    sigmas = calculate_sigmas(ms, scheduler, steps)
    assert sigmas.dtype == torch.float32 and float(sigmas[-1]) == 0.0
    assert torch.all(sigmas[:-1] > sigmas[1:])
    if scheduler == "beta":  # repeated quantiles are dropped
        assert len(sigmas) <= steps + 1
    elif scheduler == "ddim_uniform":  # every (1000 // steps)-th table entry from index 1, and the zero
        indices = range(1, 1000, 1000 // steps)
        assert len(sigmas) == len(indices) + 1 and float(sigmas[0]) == float(ms.sigmas[indices[-1]])
        return
    else:
        assert len(sigmas) == steps + 1
    assert float(sigmas[0]) == pytest.approx(float(ms.sigma_max), rel=0.02)


def test_karras_and_exponential_follow_their_formulas():
    ms = MODELS["eps"]
    lo, hi, n = float(ms.sigma_min), float(ms.sigma_max), 10
    rho = 7.0
    karras = [(hi ** (1 / rho) + i / (n - 1) * (lo ** (1 / rho) - hi ** (1 / rho))) ** rho for i in range(n)]
    exponential = [math.exp(math.log(hi) + i / (n - 1) * (math.log(lo) - math.log(hi))) for i in range(n)]
    assert calculate_sigmas(ms, "karras", n)[:-1].double().numpy() == pytest.approx(karras, rel=1e-5)
    assert calculate_sigmas(ms, "exponential", n)[:-1].double().numpy() == pytest.approx(exponential, rel=1e-5)


def test_simple_takes_evenly_strided_table_entries_from_the_top():
    ms = MODELS["flow"]
    sigmas = calculate_sigmas(ms, "simple", 4)
    assert sigmas.tolist() == [float(ms.sigmas[-1]), float(ms.sigmas[-251]), float(ms.sigmas[-501]),
                               float(ms.sigmas[-751]), 0.0]


def test_beta_places_steps_at_beta_quantiles():
    from scipy.stats import beta

    ms = MODELS["eps"]
    sigmas = calculate_sigmas(ms, "beta", 5)
    ts = numpy.rint(beta.ppf(1 - numpy.linspace(0, 1, 5, endpoint=False), 0.6, 0.6) * 999).astype(int)
    assert sigmas[:-1].tolist() == [float(ms.sigmas[t]) for t in ts]


def test_the_names_are_comfyuis_in_its_order_and_the_nodes_offer_the_same():
    assert SCHEDULER_NAMES == ("simple", "sgm_uniform", "karras", "exponential", "ddim_uniform", "beta", "normal")
    assert tuple(settings.SCHEDULER_NAMES) == SCHEDULER_NAMES


def test_normal_and_sgm_uniform_space_timesteps_evenly():
    ms = MODELS["eps"]
    normal = calculate_sigmas(ms, "normal", 4)
    ts = numpy.linspace(999, 0, 4)  # from sigma_max's timestep down to sigma_min's, both ends included
    assert normal[:-1].tolist() == [float(ms.sigma(torch.tensor(float(t)))) for t in ts]
    sgm = calculate_sigmas(ms, "sgm_uniform", 4)
    assert sgm[:-1].tolist() == [float(ms.sigma(torch.tensor(float(t)))) for t in numpy.linspace(999, 0, 5)[:-1]]
    flow = MODELS["flow"]  # timestep = 1000 sigma, sigma(t) = shift(t / 1000): the smallest sigma is shifted twice
    got = calculate_sigmas(flow, "normal", 3)[:-1].double().numpy()
    s = numpy.linspace(1.0, flow.sigma_min, 3)
    assert got == pytest.approx(3 * s / (1 + 2 * s), abs=1e-6)


@pytest.mark.parametrize("sampler", sorted(DISCARD_PENULTIMATE))
def test_samplers_that_discard_the_penultimate_sigma_get_one_more_step_and_lose_it(sampler):
    ms = MODELS["eps"]
    plain = calculate_sigmas(ms, "karras", 6)
    longer = calculate_sigmas(ms, "karras", 7)
    assert torch.equal(calculate_sigmas(ms, "karras", 6, sampler), torch.cat([longer[:-2], longer[-1:]]))
    assert len(calculate_sigmas(ms, "karras", 6, sampler)) == len(plain)


def test_the_penultimate_sigma_rule_names_comfyuis_four_samplers():
    assert DISCARD_PENULTIMATE == {"dpm_2", "dpm_2_ancestral", "uni_pc", "uni_pc_bh2"}
    assert len(sigmas_for(MODELS["eps"], "simple", 5, 1.0, "euler")) == 6
    assert torch.equal(sigmas_for(MODELS["eps"], "simple", 5, 0.5, "dpm_2"),
                       calculate_sigmas(MODELS["eps"], "simple", 10, "dpm_2")[-6:])


def test_denoise_keeps_the_tail_of_a_longer_schedule_and_zero_keeps_nothing():
    ms = MODELS["eps"]
    tail = sigmas_for(ms, "normal", 6, 0.5, "euler")
    assert torch.equal(tail, calculate_sigmas(ms, "normal", 12)[-7:])
    assert torch.equal(sigmas_for(ms, "normal", 6, 1.0, "euler"), calculate_sigmas(ms, "normal", 6))
    assert sigmas_for(ms, "normal", 6, 0.0, "euler").numel() == 0
    assert torch.equal(sigmas_for(ms, "karras", 3, 0.6, "euler"), calculate_sigmas(ms, "karras", 5)[-4:])  # int(5.0)
    assert torch.equal(sigmas_for(ms, "karras", 3, 0.99995, "euler"), calculate_sigmas(ms, "karras", 3))


@pytest.mark.parametrize("kwargs, error, match", [
    ({"scheduler": "linear_quadratic"}, ValueError, "scheduler='linear_quadratic'"),
    ({"steps": 0}, ValueError, "steps=0"), ({"steps": 2.5}, TypeError, "steps=2.5"),
    ({"steps": True}, TypeError, "steps=True"), ({"denoise": 1.5}, ValueError, "denoise=1.5"),
    ({"denoise": -0.1}, ValueError, "denoise=-0.1"), ({"denoise": float("nan")}, TypeError, "denoise=nan"),
    ({"denoise": 1e-7}, ValueError, "denoise=1e-07"), ({"sampler_name": None}, TypeError, "sampler_name=None")])
def test_bad_inputs_are_refused_by_name(kwargs, error, match):
    args = {"scheduler": "karras", "steps": 4, "denoise": 1.0, "sampler_name": "euler", **kwargs}
    with pytest.raises(error, match=match):
        sigmas_for(MODELS["eps"], args["scheduler"], args["steps"], args["denoise"], args["sampler_name"])

"""The samplers (``samplers_basic``, ``samplers_dpm``, ``unipc``) solve the right equation: on Gaussian data, whose
ideal denoiser is known in closed form, the deterministic samplers converge to the exact solution of the
probability-flow ODE as steps grow, and the stochastic ones produce samples of the data's spread. Independent of
ComfyUI (whose equality, sampler by sampler, is the integration tests'); discrete (eps) and flow sigma scales."""
import pytest
import torch

from leandiffusion.sampling.ksampler import registry
from leandiffusion.sampling.ksampler.model_sampling import DiscreteSampling, FlowSampling
from leandiffusion.sampling.ksampler.schedulers import sigmas_for
from leandiffusion.sampling.ksampler.settings import SAMPLER_NAMES

SD = {"beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012, "num_train_timesteps": 1000}
S = 0.8  # the data's standard deviation
DETERMINISTIC = ["euler", "heun", "dpm_2", "lms", "dpmpp_2m", "res_multistep", "ddim", "uni_pc"]
STOCHASTIC = ["euler_ancestral", "dpmpp_sde", "dpmpp_2m_sde", "dpmpp_3m_sde", "lcm"]
# lcm re-noises the denoiser's estimate, which only keeps the data's spread for a consistency model, not for the
# ideal (mean) denoiser used here: its spread test does not apply
SPREAD = [name for name in STOCHASTIC if name != "lcm"]


def _ideal(flow: bool):
    """E[x0 | x] for x0 ~ N(0, S^2): x = x0 + sigma n (discrete) or (1 - sigma) x0 + sigma n (flow)."""
    def denoise(x, sigma):
        s = sigma.view(-1, 1, 1, 1)
        if flow:
            return x * (1 - s) * S ** 2 / ((1 - s) ** 2 * S ** 2 + s ** 2)
        return x * S ** 2 / (S ** 2 + s ** 2)
    return denoise


def _marginal_std(sigma: float, flow: bool) -> float:
    return (((1 - sigma) * S) ** 2 + sigma ** 2) ** 0.5 if flow else (S ** 2 + sigma ** 2) ** 0.5


def _run(name: str, flow: bool, steps: int, x: torch.Tensor, seed: int = 0):
    ms = FlowSampling(3.0) if flow else DiscreteSampling(SD, "epsilon")
    sigmas = sigmas_for(ms, "karras" if not flow else "simple", steps, 1.0, name)
    spec = registry.sampler_spec(name)
    start = x * _marginal_std(float(sigmas[0]), flow)
    noise = registry.noise_sampler_for(spec, start, sigmas, seed, ms)
    return spec.fn(_ideal(flow), start, sigmas.clone(), sampling=ms, noise_sampler=noise), sigmas


def test_every_sampler_name_is_registered():
    assert set(registry.SAMPLERS) == set(SAMPLER_NAMES)
    assert set(DETERMINISTIC + STOCHASTIC) == set(SAMPLER_NAMES)


@pytest.mark.parametrize("flow", [False, True], ids=["eps", "flow"])
@pytest.mark.parametrize("name", DETERMINISTIC)
def test_deterministic_samplers_converge_to_the_ode_solution(name, flow):
    x = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    errors = []
    for steps in (10, 80):
        out, sigmas = _run(name, flow, steps, x)
        exact = x * S  # the ODE keeps x / marginal std constant: it ends at the data's spread
        errors.append(((out - exact).norm() / exact.norm()).item())
    assert errors[1] < errors[0] / 3 or errors[1] < 1e-4, errors
    assert errors[1] < 0.05, errors


@pytest.mark.parametrize("flow", [False, True], ids=["eps", "flow"])
@pytest.mark.parametrize("name", SPREAD)
def test_stochastic_samplers_give_samples_of_the_datas_spread(name, flow):
    x = torch.randn(1, 4, 96, 96, generator=torch.Generator().manual_seed(1))
    out, _ = _run(name, flow, 100, x, seed=5)
    assert out.std().item() == pytest.approx(S, rel=0.08)  # first-order ancestral steps still shrink it a little
    assert abs(torch.corrcoef(torch.stack([out.flatten(), x.flatten()]))[0, 1].item()) < 0.9  # noise was added


@pytest.mark.parametrize("name", STOCHASTIC)
def test_the_same_seed_gives_the_same_samples_and_another_seed_others(name):
    x = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(2))
    a, _ = _run(name, False, 6, x, seed=3)
    b, _ = _run(name, False, 6, x, seed=3)
    c, _ = _run(name, False, 6, x, seed=4)
    assert torch.equal(a, b) and not torch.allclose(a, c)

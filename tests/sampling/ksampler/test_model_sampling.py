"""Model sampling (``sampling.ksampler.model_sampling``): the sigma tables equal the training schedules diffusers
defines for the same config (independent implementation), timesteps round-trip, and noise enters and leaves the
latent as ComfyUI's EPS / CONST rules say."""
import pytest
import torch
from diffusers import DDPMScheduler, FlowMatchEulerDiscreteScheduler

from leandiffusion.memory.tiny_zimage import ZIMAGE_SCHEDULER
from leandiffusion.sampling.ksampler.model_sampling import DiscreteSampling, FlowSampling, max_denoise, \
    model_sampling_for
from leandiffusion.tests.kit import tiny_engine

SD = {"beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012, "num_train_timesteps": 1000}


def test_discrete_sigmas_are_the_training_schedules():
    abar = DDPMScheduler(**SD).alphas_cumprod.double()
    expected = ((1 - abar) / abar) ** 0.5
    ms = DiscreteSampling(SD, "epsilon")
    assert ms.sigmas.dtype == torch.float32
    assert torch.allclose(ms.sigmas.double(), expected, rtol=1e-4)  # diffusers' alphas_cumprod is float32
    t = torch.tensor([0, 17, 500, 999])
    assert torch.equal(ms.timestep(ms.sigma(t)), t)


def test_flow_sigmas_are_the_shifted_schedule():
    ms = FlowSampling(shift=3.0)
    scheduler = FlowMatchEulerDiscreteScheduler(**ZIMAGE_SCHEDULER)
    scheduler.set_timesteps(sigmas=[1.0, 0.5, 0.25], device="cpu")
    ours = ms.sigma(torch.tensor([1000.0, 500.0, 250.0]))
    assert torch.allclose(ours, scheduler.sigmas[:3].float(), atol=1e-6)
    assert float(ms.sigma_max) == 1.0 and float(ms.timestep(torch.tensor(0.5))) == 500.0


def test_noise_scaling_rules():
    noise, latent = torch.ones(1, 1, 2, 2), torch.full((1, 1, 2, 2), 3.0)
    eps = DiscreteSampling(SD, "epsilon")
    s = torch.tensor(2.0)
    assert torch.allclose(eps.noise_scaling(s, noise, latent, max_denoise=True), 3.0 + 5.0 ** 0.5 * noise)
    assert torch.allclose(eps.noise_scaling(s, noise, latent), 3.0 + 2.0 * noise)
    flow = FlowSampling(3.0)
    s = torch.tensor(0.25)
    assert torch.allclose(flow.noise_scaling(s, noise, latent), 0.25 + 0.75 * latent)
    assert torch.allclose(flow.inverse_noise_scaling(s, latent), latent / 0.75)


def test_max_denoise_is_a_start_at_the_largest_sigma():
    ms = DiscreteSampling(SD, "epsilon")
    assert max_denoise(ms, torch.tensor([float(ms.sigma_max), 1.0]))
    assert not max_denoise(ms, torch.tensor([float(ms.sigma_max) * 0.5, 1.0]))


def test_the_engine_family_picks_the_model_sampling():
    assert isinstance(model_sampling_for(tiny_engine("sd1")), DiscreteSampling)
    from leandiffusion.memory.load import TINY_ZIMAGE_CHOICE, load_engine

    flow = model_sampling_for(load_engine(TINY_ZIMAGE_CHOICE, device="cpu"))
    assert isinstance(flow, FlowSampling) and flow.shift == pytest.approx(3.0)

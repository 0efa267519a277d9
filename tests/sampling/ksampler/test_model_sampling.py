"""Model sampling (``sampling.ksampler.model_sampling``): the sigma tables equal the training schedules diffusers
defines for the same config (independent implementation), timesteps round-trip, the denoised estimate inverts the
forward noising of eps, v and flow models, and noise enters and leaves the latent as ComfyUI's EPS / CONST rules say.
Bit equality with ComfyUI's own classes is ``tests/integration/test_comfyui_ksampler_sigmas.py``'s."""
import math

import numpy
import pytest
import torch
from diffusers import DDPMScheduler, FlowMatchEulerDiscreteScheduler

from leandiffusion.memory.tiny_zimage import ZIMAGE_SCHEDULER
from leandiffusion.sampling.ksampler.model_sampling import DiscreteSampling, FlowSampling, max_denoise, \
    model_sampling_for, model_sampling_for_family
from leandiffusion.tests.kit import tiny_engine

SD = {"beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012, "num_train_timesteps": 1000}


def test_discrete_sigmas_are_the_training_schedules():
    abar = DDPMScheduler(**SD).alphas_cumprod.double()
    expected = ((1 - abar) / abar) ** 0.5
    ms = DiscreteSampling(SD, "epsilon")
    assert ms.sigmas.dtype == torch.float32 and ms.sigmas.shape == (1000,)
    assert torch.allclose(ms.sigmas.double(), expected, rtol=1e-4)  # diffusers' alphas_cumprod is float32
    # float64 schedule, float32 storage: numpy's float64 formula lands on the same float32 values
    betas = numpy.linspace(0.00085 ** 0.5, 0.012 ** 0.5, 1000) ** 2
    abar64 = numpy.cumprod(1.0 - betas)
    ref = torch.from_numpy(numpy.sqrt((1 - abar64) / abar64)).float()
    assert torch.equal(ms.sigmas, ref)  # a float32 cumprod (diffusers') moves 999 of them by up to 6e-6
    assert isinstance(ms.sigma_min, float) and ms.sigma_max == float(ms.sigmas[-1]) and 14.6 < ms.sigma_max < 14.7
    linear = DiscreteSampling({**SD, "beta_schedule": "linear"}, "epsilon")
    abar = DDPMScheduler(**{**SD, "beta_schedule": "linear"}).alphas_cumprod.double()
    assert torch.allclose(linear.sigmas.double(), ((1 - abar) / abar) ** 0.5, rtol=1e-4)


def test_timestep_is_the_nearest_log_sigma_and_sigma_interpolates_log_sigma():
    ms = DiscreteSampling(SD, "epsilon")
    logs = numpy.log(ms.sigmas.double().numpy())
    probe = torch.tensor([0.03, 0.5, 1.0, 3.3, 9.9, 14.0, 100.0])
    want = [int(numpy.abs(math.log(float(s)) - logs).argmin()) for s in probe]
    assert ms.timestep(probe).tolist() == want and ms.timestep(probe).dtype == torch.int64
    t = torch.tensor([0, 17, 500, 999])
    assert torch.equal(ms.timestep(ms.sigma(t)), t)
    frac = torch.tensor([10.25, 600.5, -3.0, 2000.0])
    ref = [math.exp(0.75 * logs[10] + 0.25 * logs[11]), math.exp(0.5 * logs[600] + 0.5 * logs[601]),
           math.exp(logs[0]), math.exp(logs[999])]  # clamped to the table's ends
    assert ms.sigma(frac).double().numpy() == pytest.approx(ref, rel=1e-6)
    assert ms.percent_to_sigma(0.0) > 1e8 and ms.percent_to_sigma(1.0) == 0.0
    assert ms.percent_to_sigma(0.5) == pytest.approx(math.exp(0.5 * logs[499] + 0.5 * logs[500]), rel=1e-6)


def test_flow_sigmas_are_the_shifted_schedule():
    ms = FlowSampling(shift=3.0)
    scheduler = FlowMatchEulerDiscreteScheduler(**ZIMAGE_SCHEDULER)
    scheduler.set_timesteps(sigmas=[1.0, 0.5, 0.25], device="cpu")
    ours = ms.sigma(torch.tensor([1000.0, 500.0, 250.0]))
    assert torch.allclose(ours, scheduler.sigmas[:3].float(), atol=1e-6)
    assert ms.sigma_max == 1.0 and float(ms.timestep(torch.tensor(0.5))) == 500.0
    s = numpy.arange(1, 1001) / 1000
    assert ms.sigmas.double().numpy() == pytest.approx(3 * s / (1 + 2 * s), abs=1e-6)
    assert ms.sigma_min == pytest.approx(0.003 / 1.002, rel=1e-6)
    assert ms.percent_to_sigma(0.0) == 1.0 and ms.percent_to_sigma(0.75) == pytest.approx(0.75 / 1.5)


def _sd_pair():
    """A clean latent x0, a noise eps, and the diffusers-convention noisy sample at timestep 400."""
    gen = torch.Generator().manual_seed(0)
    x0, eps = torch.randn(2, 4, 3, 3, generator=gen), torch.randn(2, 4, 3, 3, generator=gen)
    abar = DDPMScheduler(**SD).alphas_cumprod[400].double()
    return x0.double(), eps.double(), abar


def test_eps_denoised_inverts_ddpm_noising():
    ms = DiscreteSampling(SD, "epsilon")
    x0, eps, abar = _sd_pair()
    sigma = ((1 - abar) / abar) ** 0.5
    x_t = abar.sqrt() * x0 + (1 - abar).sqrt() * eps  # diffusers' add_noise
    x = x_t / abar.sqrt()  # the k-diffusion latent at sigma
    assert torch.allclose(ms.calculate_input(sigma, x), x_t, atol=1e-12)  # the UNet sees diffusers' x_t
    assert torch.allclose(ms.calculate_denoised(sigma, eps, x), x0, atol=1e-12)


def test_v_denoised_is_salimans_and_ho_x0():
    ms = DiscreteSampling(SD, "v_prediction")
    x0, eps, abar = _sd_pair()
    sigma = ((1 - abar) / abar) ** 0.5
    x_t = abar.sqrt() * x0 + (1 - abar).sqrt() * eps
    v = abar.sqrt() * eps - (1 - abar).sqrt() * x0  # DDPMScheduler.get_velocity
    assert torch.allclose(ms.calculate_denoised(sigma, v, x_t / abar.sqrt()), x0, atol=1e-12)
    batch = torch.tensor([float(sigma), 2.0], dtype=torch.float64)  # one sigma per row broadcasts over the rest
    out = ms.calculate_denoised(batch, v, x_t)
    assert torch.allclose(out[1], x_t[1] / 5 - v[1] * 2 / 5 ** 0.5, atol=1e-12)


def test_flow_denoised_inverts_the_straight_path():
    ms = FlowSampling(3.0)
    gen = torch.Generator().manual_seed(1)
    x0, noise = torch.randn(2, 16, 2, 2, generator=gen).double(), torch.randn(2, 16, 2, 2, generator=gen).double()
    s = torch.tensor(0.7, dtype=torch.float64)
    x = ms.noise_scaling(s, noise, x0)
    assert torch.allclose(x, 0.7 * noise + 0.3 * x0)
    assert ms.calculate_input(s, x) is x
    assert torch.allclose(ms.calculate_denoised(s, noise - x0, x), x0, atol=1e-12)


def test_noise_scaling_rules():
    noise, latent = torch.ones(1, 1, 2, 2), torch.full((1, 1, 2, 2), 3.0)
    eps = DiscreteSampling(SD, "epsilon")
    s = torch.tensor(2.0)
    assert torch.allclose(eps.noise_scaling(s, noise, latent, max_denoise=True), 3.0 + 5.0 ** 0.5 * noise)
    assert torch.allclose(eps.noise_scaling(s, noise, latent), 3.0 + 2.0 * noise)
    assert eps.inverse_noise_scaling(s, latent) is latent
    flow = FlowSampling(3.0)
    s = torch.tensor(0.25)
    assert torch.allclose(flow.noise_scaling(s, noise, latent), 0.25 + 0.75 * latent)
    assert torch.allclose(flow.inverse_noise_scaling(s, latent), latent / 0.75)
    rows = eps.noise_scaling(torch.tensor([1.0, 3.0]), torch.ones(2, 4, 2, 2), torch.zeros(2, 4, 2, 2))
    assert rows[0].unique().tolist() == [1.0] and rows[1].unique().tolist() == [3.0]


def test_max_denoise_is_a_start_at_the_largest_sigma():
    ms = DiscreteSampling(SD, "epsilon")
    top = ms.sigma_max
    assert max_denoise(ms, torch.tensor([top, 1.0])) and max_denoise(ms, [top * (1 + 5e-6)])
    assert max_denoise(ms, [top * 1.5])  # above the table: still pure noise
    assert not max_denoise(ms, [top * (1 - 5e-5)]) and not max_denoise(ms, torch.tensor([top * 0.5, 1.0]))
    assert max_denoise(FlowSampling(3.0), [1.0]) and not max_denoise(FlowSampling(3.0), [0.9])


def test_the_family_picks_the_model_sampling():
    assert isinstance(model_sampling_for(tiny_engine("sd1")), DiscreteSampling)
    for family, prediction in (("sd1", "epsilon"), ("sd2", "epsilon"), ("sd2-v", "v_prediction"), ("sdxl", "epsilon")):
        ms = model_sampling_for_family(family)
        assert isinstance(ms, DiscreteSampling) and ms.prediction == prediction and not ms.is_flow
    flow = model_sampling_for_family("zimage")
    assert isinstance(flow, FlowSampling) and flow.is_flow and flow.shift == 3.0
    assert model_sampling_for_family("zimage", {"shift": 6.0}).shift == 6.0
    v = model_sampling_for_family("sdxl", {**SD, "prediction_type": "v_prediction"})
    assert v.prediction == "v_prediction"
    from leandiffusion.memory.load import TINY_ZIMAGE_CHOICE, load_engine

    engine = load_engine(TINY_ZIMAGE_CHOICE, device="cpu")
    assert isinstance(model_sampling_for(engine), FlowSampling) and model_sampling_for(engine).shift == 3.0


def test_zero_terminal_snr_ends_on_a_huge_sigma_and_keeps_the_first():
    plain, zsnr = DiscreteSampling(SD), DiscreteSampling({**SD, "rescale_betas_zero_snr": True})
    assert zsnr.sigmas[0].item() == pytest.approx(plain.sigmas[0].item(), rel=1e-6)
    assert zsnr.sigma_max == pytest.approx(((1 - 4.8973451890853435e-08) / 4.8973451890853435e-08) ** 0.5)


@pytest.mark.parametrize("family, config, match", [
    ("sd1", {**SD, "prediction_type": "sample"}, r"scheduler_config\['prediction_type'\]='sample'"),
    ("sd1", {**SD, "beta_schedule": "squaredcos_cap_v2"}, r"scheduler_config\['beta_schedule'\]='squaredcos_cap_v2'"),
    ("sd1", {**SD, "trained_betas": [0.01] * 10}, r"scheduler_config\['trained_betas'\]: expected 1000"),
    ("sd1", {**SD, "trained_betas": ["a"] * 1000}, r"scheduler_config\['trained_betas'\]"),
    ("sd1", {**SD, "beta_end": 1.5}, r"scheduler_config\['beta_end'\]=1.5"),
    ("sd1", {**SD, "num_train_timesteps": 0}, r"scheduler_config\['num_train_timesteps'\]=0"),
    ("zimage", {"shift": 3.0, "use_dynamic_shifting": True}, "use_dynamic_shifting"),
    ("zimage", {"shift": -1.0}, "shift=-1.0"),
    ("sd3", None, "family='sd3'"),
])
def test_bad_configs_are_refused_by_name(family, config, match):
    with pytest.raises(ValueError, match=match):
        model_sampling_for_family(family, config)


def test_a_bad_prediction_is_refused_by_name():
    with pytest.raises(ValueError, match="prediction='x0'"):
        DiscreteSampling(SD, "x0")
    with pytest.raises(TypeError, match="scheduler_config"):
        DiscreteSampling([1, 2], "epsilon")

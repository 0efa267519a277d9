"""``sampling.ddim`` reproduces diffusers' ``DDIMScheduler`` number for number.

Guards: timestep spacing (leading + steps_offset, trailing, linspace), ``prev_timestep = t - T // steps`` for every
spacing, ``set_alpha_to_one``, beta schedules (incl. zero-terminal-SNR rescaling), the three prediction types,
the eta > 0 variance, img2img's ``int(steps * strength)`` rule and ``add_noise``.
"""
import logging

import pytest
import torch
from diffusers import DDIMScheduler
from diffusers.schedulers.scheduling_ddim import rescale_zero_terminal_snr

from leandiffusion.kernels.cfg_ddim import cfg_ddim_reference
from leandiffusion.sampling import ddim

SD = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
          steps_offset=1, set_alpha_to_one=False, clip_sample=False, prediction_type="epsilon",
          timestep_spacing="leading")

CONFIGS = {
    "sd-leading": SD,
    "sd-trailing": dict(SD, timestep_spacing="trailing"),
    "sd-linspace": dict(SD, timestep_spacing="linspace"),
    "v-pred": dict(SD, prediction_type="v_prediction"),
    "sample-pred": dict(SD, prediction_type="sample"),
    "linear-alpha-one": dict(SD, beta_schedule="linear", beta_start=0.0001, beta_end=0.02, set_alpha_to_one=True,
                             steps_offset=0),
    "cosine": dict(SD, beta_schedule="squaredcos_cap_v2"),
    "zero-snr-v-trailing": dict(SD, prediction_type="v_prediction", rescale_betas_zero_snr=True,
                                timestep_spacing="trailing"),
    "trained-betas": dict(SD, trained_betas=(torch.linspace(1e-4, 0.03, 1000, dtype=torch.float64) ** 1.3).tolist()),
    # a zero-SNR model that ships its rescaled betas: the last one is exactly 1 (alpha_bar_999 = 0), in range
    "trained-zero-snr": dict(SD, prediction_type="v_prediction", timestep_spacing="trailing",
                             trained_betas=rescale_zero_terminal_snr(
                                 torch.linspace(0.00085 ** 0.5, 0.012 ** 0.5, 1000) ** 2).tolist()),
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("steps", [1, 3, 7, 20, 50])
def test_timesteps_match_diffusers(name, steps):
    sched = DDIMScheduler(**CONFIGS[name])
    sched.set_timesteps(steps)
    assert ddim.timesteps(CONFIGS[name], steps) == sched.timesteps.tolist()


def test_alphas_cumprod_bit_identical():
    for cfg in CONFIGS.values():
        assert torch.equal(ddim.alphas_cumprod(cfg), DDIMScheduler(**cfg).alphas_cumprod)


STEP_CASES = [(name, steps, eta) for name in CONFIGS for steps, eta in [(5, 0.0), (7, 0.6), (10, 1.0)]
              if not (name in ("zero-snr-v-trailing", "trained-zero-snr") and eta == 1.0)]
# (eta = 1 at zero SNR: see test_zero_snr_eta_one_follows_diffusers)


def _check_steps_against_diffusers(name, steps, eta, textbook=True):
    """Every step of the schedule, applied as c_sample x + c_model m + c_noise z, equals DDIMScheduler.step; with
    ``textbook``, also the float64 textbook step (``ddim.ddim_step``) within float32 rounding."""
    cfg = CONFIGS[name]
    sched = DDIMScheduler(**cfg)
    sched.set_timesteps(steps)
    schedule = ddim.make_schedule(cfg, steps, eta)
    assert list(schedule.timesteps) == sched.timesteps.tolist()
    g = torch.Generator().manual_seed(steps)
    x = torch.randn(2, 4, 5, 6, generator=g)
    for i, t in enumerate(schedule.timesteps):
        m = torch.randn(x.shape, generator=g)
        z = torch.randn(x.shape, generator=g)
        want = sched.step(m, t, x, eta=eta, variance_noise=z if eta > 0 else None).prev_sample
        coeffs = torch.cat([torch.ones(1), schedule.coefficients[i]])
        got = cfg_ddim_reference(x, m, None, coeffs, z if eta > 0 else None, prediction=cfg["prediction_type"])
        assert torch.equal(got, want), (got - want).abs().max()  # same float32 ops in the same order
        if textbook:
            torch.testing.assert_close(ddim.ddim_step(cfg, steps, m, t, x, eta, z), want, atol=2e-5, rtol=2e-5)
        x = want


@pytest.mark.parametrize("name,steps,eta", STEP_CASES)
def test_fused_step_matches_diffusers_step(name, steps, eta):
    _check_steps_against_diffusers(name, steps, eta)


def _diffusers_steps_finite(cfg, steps, eta):
    """Whether DDIMScheduler.step gives finite samples at every step of this schedule on this machine."""
    sched = DDIMScheduler(**cfg)
    sched.set_timesteps(steps)
    x = torch.ones(1, 4, 2, 2)
    for t in sched.timesteps:
        x_prev = sched.step(torch.ones_like(x), t, x, eta=eta, variance_noise=torch.ones_like(x)).prev_sample
        if not torch.isfinite(x_prev).all():
            return False
    return True


def test_zero_snr_eta_one_follows_diffusers():
    """At alpha_bar_t = 0 with eta = 1, 1 - a' - sigma^2 is 0 up to rounding, and which way it rounds depends on the
    CPU's float32 pow (below 0 on some Intel CPUs, where diffusers returns NaN; not on an AMD EPYC). Either way the
    schedule follows diffusers: where diffusers' step is not finite we refuse clearly, elsewhere every step equals
    diffusers' (not the exact math: sqrt of the rounding residue, ~1e-4, stands where the textbook has 0)."""
    cfg = CONFIGS["zero-snr-v-trailing"]
    if _diffusers_steps_finite(cfg, 10, 1.0):
        _check_steps_against_diffusers("zero-snr-v-trailing", 10, 1.0, textbook=False)
    else:
        with pytest.raises(ValueError, match="not finite.*eta < 1"):
            ddim.make_schedule(cfg, 10, 1.0)


def test_eta_above_one_refused_clearly():
    """eta > 1 makes 1 - a' - sigma^2 clearly negative (diffusers returns NaN): refused, naming eta, on every CPU."""
    assert not _diffusers_steps_finite(SD, 10, 2.0)  # the premise, checked against the reference
    with pytest.raises(ValueError, match=r"not finite.*eta=2\.0.*eta must be <= 1"):
        ddim.make_schedule(SD, 10, 2.0)


@pytest.mark.parametrize("steps,denoise", [(10, 0.5), (10, 0.3), (7, 0.99), (20, 1.0), (3, 0.34), (30, 0.75)])
def test_img2img_timesteps_match_diffusers_get_timesteps(steps, denoise):
    sched = DDIMScheduler(**SD)
    sched.set_timesteps(steps)
    init = min(int(steps * denoise), steps)  # diffusers StableDiffusionImg2ImgPipeline.get_timesteps
    want = sched.timesteps[max(steps - init, 0):].tolist()
    assert list(ddim.make_schedule(SD, steps, 0.0, denoise=denoise).timesteps) == want


def test_add_noise_matches_diffusers():
    sched = DDIMScheduler(**SD)
    g = torch.Generator().manual_seed(0)
    x0, z = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 4, 8, 8, generator=g)
    for t in (1, 500, 981):
        want = sched.add_noise(x0, z, torch.tensor([t, t]))
        assert torch.equal(ddim.add_noise(SD, x0, z, t), want)


@pytest.mark.parametrize("bad,match", [
    (dict(clip_sample=True), "clip_sample"), (dict(thresholding=True), "thresholding"),
    (dict(prediction_type="flow"), "prediction_type"), (dict(beta_schedule="exp"), "beta_schedule"),
])
def test_unsupported_configs_raise(bad, match):
    with pytest.raises(ValueError, match=match):
        ddim.make_schedule(dict(SD, **bad), 10)


def test_impossible_numbers_raise():
    with pytest.raises(ValueError, match="steps"):
        ddim.timesteps(SD, 0)
    with pytest.raises(ValueError, match="steps=1001"):
        ddim.timesteps(SD, 1001)
    with pytest.raises(ValueError, match="outside"):
        ddim.timesteps(SD, 1000)  # leading + steps_offset 1 reaches t=1000
    with pytest.raises(ValueError, match="steps \\* denoise"):
        ddim.make_schedule(SD, 4, denoise=0.2)
    with pytest.raises(ValueError, match="eta"):
        ddim.make_schedule(SD, 4, eta=-0.1)
    with pytest.raises(ValueError, match="timestep_spacing"):
        ddim.timesteps(SD, 4, "karras")


@pytest.mark.parametrize("trained,got", [
    ([0.001] * 10, r"got 10 values of shape \(10,\), from 0.001 to 0.001"),
    ([[0.001]] * 1000, r"got 1000 values of shape \(1000, 1\), from 0.001 to 0.001"),
    ([0.001] * 999 + [1.5], r"got 1000 values of shape \(1000,\), from 0.001 to 1.5"),
    (["0.001"] * 1000, r"got values that are not numbers \(.+\)"),
    ([], r"got no values"),
])
def test_trained_betas_that_cannot_be_the_schedule_are_refused_by_name(trained, got):
    """Refused before sampling, by name: ten trained betas for 1000 training timesteps would fail mid-sampling with a
    bare ``IndexError: index 751 is out of bounds``; strings with ``ValueError: too many dimensions 'str'``."""
    cfg = dict(SD, trained_betas=trained)
    with pytest.raises(ValueError, match=r"scheduler_config\['trained_betas'\]: expected 1000 numbers in 0..1 \(one "
                                         rf"per training timestep, num_train_timesteps=1000\), {got}; correct or "
                                         r"remove trained_betas in the model's scheduler_config.json"):
        ddim.make_schedule(cfg, 4)


def test_pipeline_config_says_when_it_rewrites_an_outdated_config(caplog):
    """The SD pipelines' rewrite is logged (a user comparing with another tool's offset-0 schedule
    sees why), only when it changes something, and SDXL's config is kept as it is."""
    outdated = dict(SD, steps_offset=0, clip_sample=True)
    with caplog.at_level(logging.INFO, logger="leandiffusion.sampling.ddim"):
        assert ddim.pipeline_config(outdated, sdxl=False) == dict(SD, steps_offset=1, clip_sample=False)
        assert len(caplog.records) == 1
        assert "steps_offset=0 clip_sample=True is outdated" in caplog.text
        caplog.clear()
        assert ddim.pipeline_config(SD, sdxl=False) == SD
        assert ddim.pipeline_config(outdated, sdxl=True) == outdated
        assert caplog.records == []
    assert outdated["steps_offset"] == 0  # the model's config is never mutated

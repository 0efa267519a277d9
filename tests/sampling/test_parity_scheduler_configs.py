"""Acceptance: diffusers parity for scheduler configs and settings the main parity file does not cover.

Reference: diffusers' own pipelines (``StableDiffusion(XL)(Img2Img)Pipeline`` + ``DDIMScheduler`` built from the
model's config, CPU generator, ``output_type="latent"`` / scaling factor), exactly as in
``test_sampler_vs_diffusers.py`` (same helpers, same bound: max abs diff <= 1e-4 in fp32 on the CPU, where the
sampler's float32 step reproduces ``DDIMScheduler.step`` to rounding level, usually bit for bit).

Guards:
- diffusers' ``StableDiffusionPipeline`` / ``StableDiffusionImg2ImgPipeline`` rewrite an outdated scheduler config
  on construction (``steps_offset`` != 1 -> 1, ``clip_sample=True`` -> False, with a deprecation warning), so an
  SD1.x/SD2.x folder whose ``scheduler_config.json`` says ``steps_offset: 0`` or ``clip_sample: true`` samples with
  offset 1 and no clipping there; the SDXL pipelines keep the config as it is (bug: the sampler used offset 0,
  shifting every leading timestep by one, and refused ``clip_sample=True`` that diffusers runs unclipped).
- zero-terminal-SNR (``rescale_betas_zero_snr``) v-prediction, ``set_alpha_to_one``, other beta schedules, one
  step in every spacing, SDXL non-square size conditioning and an empty negative prompt, img2img denoise near 0
  and 1, cfg 1 with eta > 0 and batch > 1.
"""
import pytest
import torch

from leandiffusion.memory.engine import engine_from_parts, parts_from_components
from leandiffusion.sampling.loop import sample
from leandiffusion.tests.kit import tiny_components

from .test_sampler_vs_diffusers import TOL, _raw_latent, _reference, _settings


def _engine(family, **config):
    comps = tiny_components(family)
    comps["scheduler_config"] = dict(comps["scheduler_config"], **config)  # the kit's dict is shared: never mutate
    return engine_from_parts(parts_from_components(comps, name=f"tiny-{family}"))


def _check(engine, s, latent=None):
    ours = sample(engine, s, latent_image=None if latent is None else {"samples": latent}, quiet=True)["samples"]
    ref = _reference(engine, s, latent)
    assert ours.shape == ref.shape
    assert torch.isfinite(ref).all()
    diff = (ours - ref).abs().max().item()
    assert diff <= TOL, f"max abs diff {diff:.3g} > {TOL} (latents up to {ref.abs().max().item():.3g})"


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("family", ["sd1", "sd2-v"])
@pytest.mark.parametrize("config", [dict(steps_offset=0), dict(clip_sample=True), dict(steps_offset=0,
                                                                                       clip_sample=True)])
def test_sd_pipeline_rewrites_outdated_scheduler_config(family, config):
    _check(_engine(family, **config), _settings(steps=4, eta=0.3))


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_sd_img2img_pipeline_rewrites_steps_offset():
    _check(_engine("sd1", steps_offset=0), _settings(steps=8, denoise=0.5), _raw_latent(1))


def test_sdxl_pipeline_keeps_steps_offset():
    """The SDXL pipelines do not rewrite the config: offset 0 stays 0 (the rewrite is SD1.x/SD2.x only)."""
    _check(_engine("sdxl", steps_offset=0), _settings(steps=4))


@pytest.mark.parametrize("spacing", ["leading", "trailing", "linspace"])
def test_zero_snr_v_prediction(spacing):
    """Zero terminal SNR: alpha_bar_999 = 0, finite for v-prediction, also with eta and set_alpha_to_one."""
    _check(_engine("sd2-v", rescale_betas_zero_snr=True, set_alpha_to_one=True),
           _settings(steps=4, timestep_spacing=spacing, eta=0.5, batch_size=2))


@pytest.mark.parametrize("config", [dict(beta_schedule="linear", beta_start=0.0001, beta_end=0.02),
                                    dict(beta_schedule="squaredcos_cap_v2", set_alpha_to_one=True)])
def test_other_beta_schedules(config):
    _check(_engine("sd1", **config), _settings(steps=4, timestep_spacing="trailing"))


@pytest.mark.parametrize("spacing", ["leading", "trailing", "linspace"])
def test_one_step(spacing):
    _check(_engine("sd1"), _settings(steps=1, timestep_spacing=spacing, eta=0.5))


@pytest.mark.parametrize("width,height,negative", [(64, 96, "blurry"), (128, 64, "")])
def test_sdxl_non_square_txt2img(width, height, negative):
    """Time ids (h, w, 0, 0, h, w) for a non-square image; an empty negative is encoded (not zeroed) as diffusers
    does for ``negative_prompt=""``."""
    _check(_engine("sdxl"), _settings(steps=3, width=width, height=height, negative=negative))


@pytest.mark.parametrize("denoise,steps", [(0.1, 10), (0.99, 10)])
def test_img2img_denoise_extremes(denoise, steps):
    _check(_engine("sd1"), _settings(steps=steps, denoise=denoise, eta=0.4), _raw_latent(1, 8, 12))


def test_unguided_eta_batch():
    _check(_engine("sd2-v"), _settings(cfg=1.0, eta=0.8, batch_size=3, steps=3))


def test_stream_scheduler_uses_the_pipeline_schedule_too():
    """The Stream Scheduler promises the Fused DDIM Sampler's images; with an outdated SD1 config (steps_offset=0)
    it built its schedule from the raw config and differed by 1.7 (max abs) at max_batch=1."""
    from leandiffusion.memory.engine import engine_from_parts, parts_from_components
    from leandiffusion.sampling.loop import sample
    from leandiffusion.sampling.settings import SamplerSettings
    from leandiffusion.sampling.stream.scheduler import run_stream
    from leandiffusion.sampling.stream.settings import StreamSettings
    from leandiffusion.tests.kit import tiny_components

    comps = tiny_components("sd1")
    comps["scheduler_config"] = dict(comps["scheduler_config"], steps_offset=0)
    engine = engine_from_parts(parts_from_components(comps))
    common = dict(negative="blurry", seed=1234, steps=4, cfg=7.5, width=64, height=64, acceleration="none")
    stream = run_stream(engine, StreamSettings(prompts=("a red fox in snow",), max_batch=1, **common), quiet=True)
    fused = sample(engine, SamplerSettings(positive="a red fox in snow", **common), quiet=True)["samples"]
    assert torch.equal(stream.latents, fused)


def test_folder_scheduler_keys_reach_the_sampler(tmp_path):
    """memory/folders.py kept only the keys the family defaults name, so a zero-terminal-SNR SD2-v folder
    (rescale_betas_zero_snr) sampled as a plain SD2-v model: 0.97 off diffusers' from_pretrained pipeline."""
    from diffusers import DDIMScheduler, StableDiffusionPipeline

    from leandiffusion.memory.engine import engine_from_parts, parts_from_components
    from leandiffusion.memory.folders import load_diffusers_folder
    from leandiffusion.sampling.loop import sample
    from leandiffusion.sampling.settings import SamplerSettings
    from leandiffusion.tests.kit import save_diffusers_folder, tiny_components

    comps = tiny_components("sd2-v")
    comps["scheduler_config"].update(rescale_betas_zero_snr=True, timestep_spacing="trailing")
    save_diffusers_folder(comps, tmp_path)
    loaded = load_diffusers_folder(tmp_path)
    assert loaded["scheduler_config"]["rescale_betas_zero_snr"] is True
    engine = engine_from_parts(parts_from_components(loaded))
    s = SamplerSettings(positive="a lighthouse", negative="", seed=3, steps=4, cfg=6.0, width=64, height=64,
                        timestep_spacing="trailing", acceleration="none")
    ours = sample(engine, s, quiet=True)["samples"]
    pipe = StableDiffusionPipeline.from_pretrained(str(tmp_path), safety_checker=None, feature_extractor=None,
                                                   requires_safety_checker=False)
    pipe.scheduler = DDIMScheduler.from_pretrained(str(tmp_path), subfolder="scheduler")
    pipe.set_progress_bar_config(disable=True)
    ref = pipe(prompt=s.positive, negative_prompt=s.negative, num_inference_steps=4, guidance_scale=s.cfg,
               generator=torch.Generator().manual_seed(s.seed), height=64, width=64,
               output_type="latent").images / pipe.vae.config.scaling_factor
    # the same bound as the other parity tests here (fp32 CPU: rounding level)
    assert (ours - ref).abs().max().item() <= 1e-4


def test_trained_betas_replace_the_beta_schedule():
    """A folder's ``trained_betas`` (diffusers takes them over ``beta_schedule``)."""
    n = 1000
    trained = (torch.linspace(0.0001 ** 0.5, 0.03 ** 0.5, n, dtype=torch.float64) ** 2).tolist()
    _check(_engine("sd1", trained_betas=trained), _settings(steps=4, eta=0.5))

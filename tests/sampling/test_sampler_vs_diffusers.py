"""Acceptance: the sampler's LATENT equals diffusers' pipelines with DDIMScheduler (tiny models, CPU, fp32).

Reference: ``StableDiffusionPipeline`` / ``StableDiffusionXLPipeline`` (and their img2img pipelines) built from the
very same modules, ``DDIMScheduler`` from the model's config (spacing overridden per case), a CPU generator with
the same seed, ``output_type="latent"`` divided by the VAE scaling factor. Bound: max abs diff <= 1e-4 (most cases
are bit-equal); ``cfg_mode="sequential"`` runs two UNet calls of B rows where diffusers runs one of 2B rows, which
is not bit-identical on every CPU BLAS, so there the bound is 1e-5 of the largest latent (seen: 0 on some Intel
CPUs, 3.4e-6 on an AMD EPYC; a wrong noise draw or CFG order is off by order 1).
Guards: noise draw convention (whole batch shape, CPU, then eta noise per step in order), prompt encoding and
uncond-first CFG stacking, SDXL time ids / pooled embeds, the three spacings, v-prediction, img2img's strength
rule and add_noise, raw-vs-scaled latent space, cfg == 1 (no guidance pass).
"""
import os

import pytest
import torch
from diffusers import (DDIMScheduler, StableDiffusionImg2ImgPipeline, StableDiffusionPipeline,
                       StableDiffusionXLImg2ImgPipeline, StableDiffusionXLPipeline)

from leandiffusion.sampling.loop import sample
from leandiffusion.sampling.settings import SamplerSettings
from leandiffusion.tests.kit import tiny_engine

TOL = 1e-4
SEQUENTIAL_CFG_REL_TOL = 1e-5


@pytest.fixture(scope="module")
def engines():
    return {family: tiny_engine(family) for family in ("sd1", "sd2-v", "sdxl")}


def _pipeline(engine, spacing, img2img=False):
    p = engine.parts
    sched = DDIMScheduler(**dict(p.scheduler_config, timestep_spacing=spacing))
    if p.is_sdxl:
        cls = StableDiffusionXLImg2ImgPipeline if img2img else StableDiffusionXLPipeline
        pipe = cls(vae=p.vae, text_encoder=p.text_encoder, text_encoder_2=p.text_encoder_2, tokenizer=p.tokenizer,
                   tokenizer_2=p.tokenizer_2, unet=p.unet, scheduler=sched, add_watermarker=False)
    else:
        cls = StableDiffusionImg2ImgPipeline if img2img else StableDiffusionPipeline
        pipe = cls(vae=p.vae, text_encoder=p.text_encoder, tokenizer=p.tokenizer, unet=p.unet, scheduler=sched,
                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _reference(engine, s: SamplerSettings, latent=None):
    pipe = _pipeline(engine, s.timestep_spacing, img2img=latent is not None)
    kwargs = dict(prompt=s.positive, negative_prompt=s.negative, num_inference_steps=s.steps, guidance_scale=s.cfg,
                  eta=s.eta, num_images_per_prompt=s.batch_size, generator=torch.Generator("cpu").manual_seed(s.seed),
                  output_type="latent")
    scale = engine.parts.vae_scaling_factor
    if latent is None:
        kwargs.update(height=s.height, width=s.width)
    else:
        kwargs.update(image=latent * scale, strength=s.denoise)  # 4-channel images are taken as scaled latents
    with torch.no_grad():
        return pipe(**kwargs).images / scale


def _check(engine, s, latent=None):
    ours = sample(engine, s, latent_image=None if latent is None else {"samples": latent}, quiet=True)["samples"]
    ref = _reference(engine, s, latent)
    assert ours.shape == ref.shape and ours.dtype == torch.float32 and ours.device.type == "cpu"
    diff = (ours - ref).abs().max().item()
    largest = ref.abs().max().item()
    tol = TOL if s.cfg_mode != "sequential" else SEQUENTIAL_CFG_REL_TOL * largest
    assert diff <= tol, f"max abs diff {diff:.3g} > {tol:.3g} (latents up to {largest:.3g})"
    return ours


def _settings(**kw):
    base = dict(positive="a red fox in snow", negative="blurry", seed=1234, steps=5, cfg=7.5, eta=0.0, width=64,
                height=64, batch_size=1, timestep_spacing="leading", cfg_mode="batched", acceleration="none")
    base.update(kw)
    return SamplerSettings(**base)


@pytest.mark.parametrize("spacing", ["leading", "trailing", "linspace"])
def test_sd1_txt2img_all_spacings(engines, spacing):
    _check(engines["sd1"], _settings(timestep_spacing=spacing, steps=3))


def test_sd1_batch_eta_sequential_cfg_non_square(engines):
    """eta > 0: diffusers draws [B, C, h, w] variance noise from the generator at every step, after the latents."""
    _check(engines["sd1"], _settings(batch_size=2, eta=0.7, cfg_mode="sequential", width=96, height=64, seed=7))


def test_sd1_cfg_one_runs_unguided(engines):
    _check(engines["sd1"], _settings(cfg=1.0, steps=3))


def test_sd2_v_prediction_eta(engines):
    assert engines["sd2-v"].parts.prediction_type == "v_prediction"
    _check(engines["sd2-v"], _settings(timestep_spacing="trailing", eta=0.5, steps=4))


@pytest.mark.parametrize("spacing,eta,batch", [("leading", 0.0, 1), ("linspace", 0.3, 2)])
def test_sdxl_txt2img(engines, spacing, eta, batch):
    _check(engines["sdxl"], _settings(timestep_spacing=spacing, eta=eta, batch_size=batch, steps=3))


def _raw_latent(batch, h=8, w=8, seed=3):
    return torch.randn(batch, 4, h, w, generator=torch.Generator().manual_seed(seed)) * 5.0


@pytest.mark.parametrize("denoise,steps,batch_size", [(0.6, 5, 2), (1.0, 3, 1), (0.34, 9, 1)])
def test_sd1_img2img(engines, denoise, steps, batch_size):
    _check(engines["sd1"], _settings(denoise=denoise, steps=steps, batch_size=batch_size, eta=0.2), _raw_latent(1))


def test_sdxl_img2img_takes_size_from_latent(engines):
    """width/height inputs are ignored with a latent: time ids come from the latent's size, as in diffusers."""
    _check(engines["sdxl"], _settings(denoise=0.5, steps=6, width=512, height=512), _raw_latent(1, 8, 10))


def test_v_prediction_img2img_trailing_latent_batch(engines):
    _check(engines["sd2-v"], _settings(denoise=0.75, steps=4, timestep_spacing="trailing", batch_size=2),
           _raw_latent(2))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs the Triton kernel on the CPU")
def test_triton_kernel_in_the_loop(engines, monkeypatch):
    """The whole loop with the Triton kernel forced (interpreter on the CPU) still matches diffusers."""
    monkeypatch.setenv("LEANDIFFUSION_CFG_DDIM", "triton")
    _check(engines["sd1"], _settings(eta=0.5, steps=3, batch_size=2))


def test_sd1_img2img_repeats_a_latent_batch_as_diffusers_does(engines):
    """batch_size 4 over a 2-row latent [a, b]: the rows run as [a, b, a, b] (diffusers' img2img
    ``torch.cat([init_latents] * k)``, ComfyUI's Repeat Latent Batch), not [a, a, b, b]. Rows differ by O(1)."""
    latent = _raw_latent(2, seed=5)
    ours = _check(engines["sd1"], _settings(denoise=0.6, steps=3, batch_size=4, cfg=2.0), latent)
    assert (ours[1] - ours[2]).abs().max().item() > 0.1  # a misordered repeat would swap these rows

"""The Fused KSampler on Qwen-Image (``sampling.ksampler.qwen_call`` and ComfyUI's Flux model sampling): the
sampling ComfyUI gives Qwen-Image, an Euler run equal to a plain loop over diffusers' own transformer and prompt
encoding with ComfyUI's plain cfg, CONDITIONING equal to the prompt strings, every VRAM policy alike, ComfyUI's
one-frame LATENT, and bad input refused by name before any stage opens. Equality with ComfyUI's own samplers and
schedulers for every sampler x scheduler is ``tests/integration/test_comfyui_ksampler_qwen.py``."""
import math

import pytest
import torch
from diffusers import QwenImagePipeline

from leandiffusion.nodes.ksampler import LeanKSampler
from leandiffusion.sampling.ksampler.model_sampling import FluxSampling, model_sampling_for
from leandiffusion.sampling.ksampler.schedulers import sigmas_for
from leandiffusion.tests.sampling.qwen.conftest import qwen_engine, qwen_folder, qwen_pipe  # noqa: F401 (fixtures)

TOL = 1e-4
PROMPTS = ("a red cat", "blurry, dark")


@pytest.fixture
def engine(qwen_engine):
    return qwen_engine


@pytest.fixture
def pipe(qwen_pipe):
    return qwen_pipe


def _run(engine, latent, cfg=2.5, sampler="euler", scheduler="simple", denoise=1.0, steps=3, seed=7, **kw):
    return LeanKSampler().run(engine, seed, steps, cfg, sampler, scheduler, latent, denoise, "none",
                              positive_prompt=PROMPTS[0], negative_prompt=PROMPTS[1], **kw)[0]


def test_qwen_image_samples_as_comfyuis_flux_model(engine):
    """ComfyUI loads Qwen-Image as ModelType.FLUX: shift 1.15 is an exponent, over a 10000-entry table."""
    sampling = model_sampling_for(engine)
    assert isinstance(sampling, FluxSampling) and sampling.shift == 1.15
    t = torch.arange(1, 10001, dtype=torch.float64) / 10000
    expected = math.exp(1.15) / (math.exp(1.15) + (1 / t - 1))
    assert sampling.sigmas.shape == (10000,) and sampling.sigma_max == 1.0
    assert torch.allclose(sampling.sigmas.double(), expected, rtol=1e-6, atol=0)
    assert torch.equal(sampling.timestep(torch.tensor(0.3)), torch.tensor(0.3))
    assert sampling.percent_to_sigma(0.5) == pytest.approx(math.exp(1.15) / (math.exp(1.15) + 1))


def test_euler_equals_a_plain_loop_over_diffusers_transformer(engine, pipe):
    """Euler on ComfyUI's CONST denoised values with plain cfg, by hand, over the pipeline's transformer and
    prompt encoding; the starting noise is the seed's CPU draw of the LATENT's shape."""
    b, h, w, cfg, seed = 2, 6, 4, 2.5, 7
    sigmas = sigmas_for(model_sampling_for(engine), "simple", 3, 1.0, "euler")
    x = torch.randn((b, 16, h, w), generator=torch.Generator().manual_seed(seed)) * sigmas[0]
    sides = [pipe.encode_prompt(p, device="cpu", num_images_per_prompt=b) for p in PROMPTS]
    for i in range(len(sigmas) - 1):
        s = sigmas[i]
        denoised = []
        for embeds, mask in sides:
            with torch.no_grad():
                v = pipe.transformer(hidden_states=QwenImagePipeline._pack_latents(x, b, 16, h, w),
                                     timestep=s.expand(b), encoder_hidden_states=embeds,
                                     encoder_hidden_states_mask=mask, img_shapes=[[(1, h // 2, w // 2)]] * b,
                                     return_dict=False)[0]
            denoised.append(x - QwenImagePipeline._unpack_latents(v, h * 8, w * 8, 8)[:, :, 0] * s)
        d = denoised[1] + (denoised[0] - denoised[1]) * cfg
        x = x + (x - d) / s * (sigmas[i + 1] - s)
    mean = torch.tensor(pipe.vae.config.latents_mean).view(1, -1, 1, 1)
    std = torch.tensor(pipe.vae.config.latents_std).view(1, -1, 1, 1)
    ref = x * std + mean
    out = _run(engine, {"samples": torch.zeros(b, 16, h, w)}, cfg=cfg, seed=seed)["samples"]
    assert (out - ref).abs().max().item() <= TOL
    assert ref.abs().max().item() > 1.0


def test_conditioning_gives_the_prompt_strings_latent(engine, pipe):
    latent = {"samples": torch.zeros(1, 16, 4, 4)}
    text = _run(engine, latent, sampler="dpmpp_2m")["samples"]
    conds = {name: [[pipe.encode_prompt(p, device="cpu")[0], {"pooled_output": None}]]
             for name, p in zip(("positive", "negative"), PROMPTS)}
    cond = LeanKSampler().run(engine, 7, 3, 2.5, "dpmpp_2m", "simple", latent, 1.0, "none", **conds)[0]["samples"]
    assert (cond - text).abs().max().item() <= TOL
    assert (_run(engine, latent, cfg=1.0)["samples"] - text).abs().max().item() > 1e-2


def test_cfg_1_skips_the_negative(engine):
    latent = {"samples": torch.zeros(1, 16, 4, 4)}
    first = _run(engine, latent, cfg=1.0)["samples"]
    other = LeanKSampler().run(engine, 7, 3, 1.0, "euler", "simple", latent, 1.0, "none", positive_prompt=PROMPTS[0],
                               negative_prompt="anything else")[0]["samples"]
    assert torch.equal(first, other)


def test_comfyuis_one_frame_latent_comes_back_in_its_layout(engine):
    raw = torch.randn((1, 16, 4, 6), generator=torch.Generator().manual_seed(1))
    four = _run(engine, {"samples": raw}, denoise=0.6)["samples"]
    five = _run(engine, {"samples": raw.unsqueeze(2)}, denoise=0.6)["samples"]
    assert five.shape == (1, 16, 1, 4, 6) and torch.equal(five[:, :, 0], four)
    assert (four - raw).abs().max().item() > 1e-2
    assert torch.equal(_run(engine, {"samples": raw.unsqueeze(2)}, denoise=0.0)["samples"], raw.unsqueeze(2))


@pytest.mark.parametrize("latent,kw,message", [
    (torch.zeros(1, 16, 5, 4), {}, r"latent_image is 4x5 latent cells; Qwen-Image takes 2x2 patches"),
    (torch.zeros(1, 16, 4, 4), {"positive": [[torch.zeros(1, 3, 31), {}]]},
     r"positive has shape \(1, 3, 31\); this model needs Qwen2.5-VL hidden states \[b, L, 32\]"),
    (torch.zeros(2, 16, 4, 4), {"negative": [[torch.zeros(3, 3, 32), {}]]},
     r"negative holds 3 rows; expected 1 or the batch size 2"),
])
def test_bad_input_is_named_before_any_stage(engine, latent, kw, message, opened_sessions):
    with pytest.raises(ValueError, match=message):
        _run(engine, {"samples": latent}, **kw)
    assert opened_sessions == []

"""The Fused Flow Sampler's Qwen-Image img2img and CONDITIONING inputs.

img2img keeps the flow sampler's meaning of ``denoise`` (ComfyUI's rule: the last ``steps + 1`` sigmas of an
``int(steps / denoise)``-step schedule, started from ``sigma0 noise + (1 - sigma0) x0``); the reference is diffusers'
``QwenImageImg2ImgPipeline`` given the same latent (in its model space: it then skips its VAE) with
``num_inference_steps = int(steps / denoise)`` and ``strength = steps / that``, which runs the same trimmed schedule.
CONDITIONING holding Qwen2.5-VL hidden states (the rows ``QwenImagePipeline.encode_prompt`` gives, as ComfyUI's text
encode gives them, padded with a mask or not) samples the latent of the prompt strings. Bad inputs are refused by
name before any stage opens."""
import pytest
import torch
from diffusers import QwenImageImg2ImgPipeline

from leandiffusion.nodes.flow import LeanFlowSampler
from leandiffusion.sampling.flow.settings import FlowSettings
from leandiffusion.sampling.qwen.loop import sample_qwen_image

TOL = 1e-4
NEGATIVE = "blurry, dark"


@pytest.fixture(scope="module")
def img2img_pipe(qwen_folder):
    return QwenImageImg2ImgPipeline.from_pretrained(str(qwen_folder), local_files_only=True)


def _stats(pipe):
    mean = torch.tensor(pipe.vae.config.latents_mean).view(1, -1, 1, 1)
    std = torch.tensor(pipe.vae.config.latents_std).view(1, -1, 1, 1)
    return mean, std


def _raw_latent(pipe, batch, h, w, seed=4):
    """A raw VAE latent of plausible scale (model-space N(0, 1) mapped through the VAE's statistics)."""
    mean, std = _stats(pipe)
    return torch.randn((batch, 16, h, w), generator=torch.Generator().manual_seed(seed)) * std + mean


def _img2img_reference(pipe, raw, prompt, cfg, steps, denoise, batch, seed):
    total = int(steps / denoise)
    mean, std = _stats(pipe)
    calls = []
    packed = pipe(prompt, negative_prompt=NEGATIVE, image=(raw - mean) / std, strength=steps / total,
                  true_cfg_scale=cfg, num_inference_steps=total, height=raw.shape[2] * 8, width=raw.shape[3] * 8,
                  num_images_per_prompt=batch // raw.shape[0], generator=torch.Generator("cpu").manual_seed(seed),
                  output_type="latent", callback_on_step_end=lambda p, i, t, kw: calls.append(i) or {}).images
    assert len(calls) == steps  # the pipeline ran the trimmed schedule
    latents = QwenImageImg2ImgPipeline._unpack_latents(packed, raw.shape[2] * 8, raw.shape[3] * 8, 8)[:, :, 0]
    return latents * std + mean


@pytest.mark.parametrize("cfg,denoise,batch", [(1.0, 0.6, 1), (4.0, 0.75, 2)])
def test_img2img_equals_the_img2img_pipeline(img2img_pipe, qwen_engine, cfg, denoise, batch):
    raw = _raw_latent(img2img_pipe, 1, 6, 4)
    ref = _img2img_reference(img2img_pipe, raw, "a red cat", cfg, 3, denoise, batch, seed=9)
    settings = FlowSettings("a red cat", NEGATIVE, seed=9, steps=3, cfg=cfg, batch_size=batch, denoise=denoise,
                            acceleration="none")
    out = sample_qwen_image(qwen_engine, settings, latent_image={"samples": raw})["samples"]
    assert out.shape == (batch, 16, 6, 4)
    assert (out - ref).abs().max().item() <= TOL
    assert (out - raw).abs().max().item() > 1e-2  # it sampled


def test_denoise_keeps_more_of_the_input_the_lower_it_is(qwen_engine, img2img_pipe):
    raw = _raw_latent(img2img_pipe, 1, 4, 4)
    dist = []
    for denoise in (0.2, 0.9):
        s = FlowSettings("a cat", seed=1, steps=4, denoise=denoise, acceleration="none")
        dist.append((sample_qwen_image(qwen_engine, s, latent_image={"samples": raw})["samples"] - raw).norm())
    assert dist[0] < dist[1]


def test_comfyuis_one_frame_latent_and_the_node(qwen_engine, img2img_pipe):
    """ComfyUI keeps a Qwen-Image LATENT as [B, 16, 1, h, w]; the node reads it as [B, 16, h, w]."""
    raw = _raw_latent(img2img_pipe, 1, 4, 6)
    s = FlowSettings("a cat", seed=2, steps=2, denoise=0.5, acceleration="none")
    four = sample_qwen_image(qwen_engine, s, latent_image={"samples": raw})["samples"]
    (five,) = LeanFlowSampler().run(qwen_engine, "a cat", "", 2, 2, 1.0, 32, 32, 1, "none",
                                    latent_image={"samples": raw.unsqueeze(2)}, denoise=0.5)
    assert torch.equal(five["samples"], four)


def test_a_latents_batch_index_draws_comfyuis_noise_rows(qwen_engine, img2img_pipe):
    raw = _raw_latent(img2img_pipe, 2, 4, 4)
    s = FlowSettings("a cat", seed=5, steps=2, denoise=0.5, acceleration="none")
    both = sample_qwen_image(qwen_engine, s, latent_image={"samples": raw})["samples"]
    second = sample_qwen_image(qwen_engine, s, latent_image={"samples": raw[1:], "batch_index": [1]})
    assert second["batch_index"] == [1]
    assert (second["samples"][0] - both[1]).abs().max().item() <= 1e-5


def _conditioning(pipe, prompt, pad_to=None):
    """ComfyUI-style CONDITIONING of ``prompt``: the pipeline's prompt rows (template dropped), optionally padded
    with zeros to ``pad_to`` rows and marked by an attention mask, as a padded text encode gives them."""
    embeds, _ = pipe.encode_prompt(prompt, device="cpu")
    extras = {"pooled_output": None}
    if pad_to is not None:
        length = embeds.shape[1]
        embeds = torch.cat([embeds, embeds.new_zeros(1, pad_to - length, embeds.shape[2])], dim=1)
        extras["attention_mask"] = (torch.arange(pad_to) < length).long()[None]
    return [[embeds, extras]]


@pytest.mark.parametrize("pad", [None, 40])
def test_conditioning_gives_the_prompt_strings_latent(qwen_engine, img2img_pipe, pad):
    s = FlowSettings("a red cat", NEGATIVE, seed=3, steps=3, cfg=4.0, width=48, height=32, batch_size=2,
                     acceleration="none")
    text = sample_qwen_image(qwen_engine, s)["samples"]
    cond = sample_qwen_image(qwen_engine, FlowSettings("ignored", "ignored too", seed=3, steps=3, cfg=4.0, width=48,
                                                       height=32, batch_size=2, acceleration="none"),
                             positive_cond=_conditioning(img2img_pipe, "a red cat", pad),
                             negative_cond=_conditioning(img2img_pipe, NEGATIVE, pad))["samples"]
    assert (cond - text).abs().max().item() <= TOL
    other = sample_qwen_image(qwen_engine, s, positive_cond=_conditioning(img2img_pipe, "a blue dog"))["samples"]
    assert (other - text).abs().max().item() > 1e-2


def test_one_side_conditioning_the_other_a_string(qwen_engine, img2img_pipe, opened_sessions):
    s = FlowSettings("a red cat", NEGATIVE, seed=3, steps=2, cfg=3.0, width=32, height=32, acceleration="none")
    text = sample_qwen_image(qwen_engine, s)["samples"]
    opened_sessions.clear()
    mixed = sample_qwen_image(qwen_engine, s, negative_cond=_conditioning(img2img_pipe, NEGATIVE))["samples"]
    assert (mixed - text).abs().max().item() <= TOL
    assert opened_sessions == ["text", "unet"]


@pytest.mark.parametrize("kwargs,message", [
    ({"latent_image": {"samples": torch.zeros(1, 16, 5, 4)}}, r"latent_image is 4x5 latent cells; .*both must be even"),
    ({"latent_image": {"samples": torch.zeros(1, 4, 4, 4)}},
     r"latent_image has 4 channels but this model's VAE uses 16"),
    ({"positive_cond": [[torch.zeros(1, 3, 31), {}]]},
     r"positive_cond has shape \(1, 3, 31\); this model needs Qwen2.5-VL hidden states \[b, L, 32\]"),
    ({"negative_cond": [[torch.zeros(3, 3, 32), {}]]}, r"negative_cond holds 3 rows; expected 1 or the batch size 1"),
])
def test_bad_inputs_are_named_before_any_stage(qwen_engine, kwargs, message, opened_sessions):
    args = (qwen_engine, "a cat", "", 0, 2, 2.0, 32, 32, 1, "none")
    with pytest.raises(ValueError, match=message):
        LeanFlowSampler().run(*args, **kwargs)
    assert opened_sessions == []

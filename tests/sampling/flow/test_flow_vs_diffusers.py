"""The Fused Flow Sampler's LATENT equals diffusers' ZImagePipeline converted to raw VAE space (the issue's
fidelity contract): cfg 1 (one pass) and cfg 4 (guided, diffusers' guidance_scale = cfg - 1), batch 2, non-square
sizes, a prompt long enough to change the caption bucket, and img2img against the pipeline given the same sigmas
and start latent."""
import pytest
import torch

from leandiffusion.sampling.flow.loop import sample_flow
from leandiffusion.sampling.flow.settings import FlowSettings

TOL = 1e-4
LONG = "a lighthouse on a cliff at dusk, waves, gulls, warm light in the windows, " * 3


def _pipeline_raw(pipe, prompt, negative, steps, cfg, width, height, batch, seed, **kw):
    latents = pipe(prompt, negative_prompt=negative, num_inference_steps=steps, guidance_scale=cfg - 1.0,
                   width=width, height=height, num_images_per_prompt=batch,
                   generator=torch.Generator("cpu").manual_seed(seed), output_type="latent", **kw).images
    return latents / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor


@pytest.mark.parametrize("cfg", [1.0, 4.0])
@pytest.mark.parametrize("width,height,batch,prompt", [(64, 48, 2, "a red cat"), (96, 32, 1, LONG)])
def test_latent_equals_the_pipeline(zimage_pipe, zimage_engine, cfg, width, height, batch, prompt):
    ref = _pipeline_raw(zimage_pipe, prompt, "blurry, dark", 4, cfg, width, height, batch, seed=11)
    out = sample_flow(zimage_engine, FlowSettings(prompt, "blurry, dark", seed=11, steps=4, cfg=cfg, width=width,
                                                  height=height, batch_size=batch, acceleration="none"))["samples"]
    assert out.shape == (batch, 16, height // 8, width // 8)
    assert (out - ref).abs().max().item() <= TOL
    assert ref.abs().max().item() > 1.0  # a real latent, not a near-zero one any output would match


def test_another_seed_or_prompt_changes_the_latent(zimage_engine):
    base = FlowSettings("a red cat", seed=1, steps=2, width=32, height=32, acceleration="none")
    first = sample_flow(zimage_engine, base)["samples"]
    for other in (FlowSettings("a red cat", seed=2, steps=2, width=32, height=32, acceleration="none"),
                  FlowSettings("a blue dog", seed=1, steps=2, width=32, height=32, acceleration="none")):
        assert (sample_flow(zimage_engine, other)["samples"] - first).abs().max().item() > 1e-2


def test_img2img_equals_the_pipeline_from_the_same_start(zimage_pipe, zimage_engine):
    """denoise 0.5 over 3 steps: ComfyUI's rule keeps the last 4 sigmas of a 6-step schedule, starting from
    sigma0 * noise + (1 - sigma0) * x0; the pipeline runs the same unshifted sigmas from the same latent."""
    g = torch.Generator().manual_seed(3)
    raw = torch.randn(1, 16, 6, 8, generator=g)
    scale, shift = zimage_pipe.vae.config.scaling_factor, zimage_pipe.vae.config.shift_factor
    out = sample_flow(zimage_engine, FlowSettings("a red cat", seed=5, steps=3, denoise=0.5, acceleration="none"),
                      latent_image={"samples": raw})["samples"]
    total = 6
    base = torch.linspace(1.0, 1.0 / total, total)[-3:]
    s0 = 3.0 * base[0] / (1 + 2.0 * base[0])  # Z-Image-Turbo's static shift 3
    noise = torch.randn(1, 16, 6, 8, generator=torch.Generator("cpu").manual_seed(5))
    start = s0 * noise + (1 - s0) * (raw - shift) * scale
    ref = _pipeline_raw(zimage_pipe, "a red cat", None, 3, 1.0, 64, 48, 1, seed=5, sigmas=base.tolist(),
                        latents=start)
    assert (out - ref).abs().max().item() <= TOL
    assert (out - raw).abs().max().item() > 1e-2


def test_positive_cond_replaces_the_prompt(zimage_pipe, zimage_engine):
    """Qwen3 hidden states given as CONDITIONING (with an attention mask marking padding) give the latent of the
    prompt they encode."""
    from leandiffusion.sampling.flow.text import encode_prompts

    rows = encode_prompts(zimage_engine, ["a red cat"])[0]
    padded = torch.cat([rows, torch.zeros(7, rows.shape[1])])[None]
    mask = torch.cat([torch.ones(rows.shape[0]), torch.zeros(7)])[None]
    settings = FlowSettings("ignored text", seed=4, steps=2, width=32, height=32, acceleration="none")
    out = sample_flow(zimage_engine, settings, positive_cond=[[padded, {"attention_mask": mask}]])["samples"]
    ref = _pipeline_raw(zimage_pipe, "a red cat", None, 2, 1.0, 32, 32, 1, seed=4)
    assert (out - ref).abs().max().item() <= TOL

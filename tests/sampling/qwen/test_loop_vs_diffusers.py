"""The Qwen-Image loop's LATENT equals diffusers' QwenImagePipeline (the fidelity contract): true_cfg_scale 1 (one
pass) and 4 (true CFG with its norm rescale), batch 2, a non-square size, under ``full`` and ``lowvram``; the
pipeline's packed latent is unpacked by diffusers' own helper and converted to raw VAE space with the VAE config's
per-channel statistics. The Fused Flow Sampler node runs it for a Qwen-Image model."""
import dataclasses

import pytest
import torch
from diffusers import QwenImagePipeline

from leandiffusion.nodes.flow import LeanFlowSampler
from leandiffusion.sampling.flow.settings import FlowSettings
from leandiffusion.sampling.qwen.loop import sample_qwen_image

TOL = 1e-4
NEGATIVE = "blurry, dark"


def _pipeline_raw(pipe, prompt, cfg, steps, width, height, batch, seed):
    packed = pipe(prompt, negative_prompt=NEGATIVE, true_cfg_scale=cfg, num_inference_steps=steps, width=width,
                  height=height, num_images_per_prompt=batch, generator=torch.Generator("cpu").manual_seed(seed),
                  output_type="latent").images
    latents = QwenImagePipeline._unpack_latents(packed, height, width, pipe.vae_scale_factor)[:, :, 0]
    config = pipe.vae.config
    mean = torch.tensor(config.latents_mean).view(1, -1, 1, 1)
    std = torch.tensor(config.latents_std).view(1, -1, 1, 1)
    return latents * std + mean


@pytest.mark.parametrize("cfg", [1.0, 4.0])
def test_latent_equals_the_pipeline(qwen_pipe, qwen_engine, cfg, opened_sessions):
    ref = _pipeline_raw(qwen_pipe, "a red cat", cfg, 4, 64, 48, 2, seed=11)
    out = sample_qwen_image(qwen_engine, FlowSettings("a red cat", NEGATIVE, seed=11, steps=4, cfg=cfg, width=64,
                                                      height=48, batch_size=2, acceleration="none"))["samples"]
    assert out.shape == (2, 16, 48 // 8, 64 // 8) and out.dtype == torch.float32
    assert (out - ref).abs().max().item() <= TOL
    assert ref.abs().max().item() > 1.0 and (ref[0] - ref[1]).abs().max().item() > 1e-2
    assert opened_sessions == ["text", "unet"]


def test_the_fused_flow_sampler_node_runs_qwen_image(qwen_pipe, qwen_engine):
    ref = _pipeline_raw(qwen_pipe, "a lighthouse at dusk", 4.0, 3, 32, 64, 1, seed=5)
    (out,) = LeanFlowSampler().run(qwen_engine, "a lighthouse at dusk", NEGATIVE, 5, 3, 4.0, 32, 64, 1, "cuda_graph")
    assert (out["samples"] - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("change", [{"seed": 2}, {"positive": "a blue dog"}])
def test_another_seed_or_prompt_changes_the_latent(qwen_engine, change):
    base = FlowSettings("a red cat", seed=1, steps=2, width=32, height=32, acceleration="none")
    first = sample_qwen_image(qwen_engine, base)["samples"]
    other = sample_qwen_image(qwen_engine, dataclasses.replace(base, **change))["samples"]
    assert (other - first).abs().max().item() > 1e-2

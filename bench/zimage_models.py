"""Full-size Z-Image-Turbo architectures with random weights, for GPU benchmarks: the 6.15B-parameter DiT
(diffusers ``ZImageTransformer2DModel`` defaults: 30 + 2 refiner layers, dim 3840), the Qwen3-4B text encoder and
the 16-channel Flux VAE, with configs written in code (no hub access) and weights materialised on the device and
filled as ``bench.models.randomize_`` does (N(0, 1/fan_in), norms 1, biases 0) so activations stay O(1). The
tokenizer is the kit's byte-level Qwen tokenizer (its ids fall inside the real vocabulary). Valid for speed,
memory and numerical distance between implementations, never for picture quality.
"""
from __future__ import annotations

import torch

from ..memory.tiny_zimage import ZIMAGE_SCHEDULER, build_qwen_tokenizer
from .models import _materialise

PROMPT = "a photograph of a lighthouse on a cliff at dusk, warm light in the windows, waves breaking below"
QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True)
FLUX_VAE = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
                layers_per_block=2, norm_num_groups=32, sample_size=1024,
                down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)


def full_zimage_dit(device="cuda", dtype=torch.bfloat16, seed: int = 0):
    from diffusers import ZImageTransformer2DModel

    return _materialise(ZImageTransformer2DModel, {}, device, dtype, seed)


def full_qwen3_4b(device="cuda", dtype=torch.bfloat16, seed: int = 1):
    from transformers import Qwen3Config, Qwen3Model

    return _materialise(Qwen3Model, Qwen3Config(**QWEN3_4B), device, dtype, seed)


def full_flux_vae(device="cuda", dtype=torch.bfloat16, seed: int = 2):
    from diffusers import AutoencoderKL

    return _materialise(AutoencoderKL, FLUX_VAE, device, dtype, seed)


def full_zimage_components(device="cuda", dtype=torch.bfloat16, vae_dtype=torch.bfloat16) -> dict:
    """A components dict (as ``memory.tiny_zimage.build_tiny_zimage`` returns) of the full-size architecture."""
    return {"family": "zimage", "transformer": full_zimage_dit(device, dtype),
            "text_encoder": full_qwen3_4b(device, dtype), "vae": full_flux_vae(device, vae_dtype),
            "tokenizer": build_qwen_tokenizer(), "scheduler_config": dict(ZIMAGE_SCHEDULER)}


def zimage_pipeline(components: dict):
    """diffusers' ``ZImagePipeline`` over ``components`` (the same modules, shared)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline

    pipe = ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**components["scheduler_config"]),
                          vae=components["vae"], text_encoder=components["text_encoder"],
                          tokenizer=components["tokenizer"], transformer=components["transformer"])
    pipe.set_progress_bar_config(disable=True)
    return pipe


def peer_run(pipe, size: int, steps: int):
    """``ZImagePipeline`` prompt -> latent (model space) at cfg 1, seed 0."""
    def run() -> torch.Tensor:
        return pipe(PROMPT, num_inference_steps=steps, guidance_scale=0.0, height=size, width=size,
                    generator=torch.Generator("cpu").manual_seed(0), output_type="latent").images

    return run


def ours_run(engine, size: int, steps: int, acceleration: str):
    """The Fused Flow Sampler, prompt -> latent, converted to the pipeline's model space."""
    from ..sampling.flow.loop import sample_flow
    from ..sampling.flow.settings import FlowSettings

    settings = FlowSettings(PROMPT, steps=steps, cfg=1.0, width=size, height=size, acceleration=acceleration)
    scale, shift = engine.parts.vae_scaling_factor, engine.parts.vae_shift_factor

    def run() -> torch.Tensor:  # back to the pipeline's model space, so both sides compare like for like
        return (sample_flow(engine, settings, quiet=True)["samples"] - shift) * scale

    return run


def ksampler_run(engine, size: int, steps: int, sampler: str, scheduler: str = "simple"):
    """The Fused KSampler (``cuda_graph``, cfg 1, the prompt as text) from an empty 16-channel latent."""
    from ..nodes.ksampler import LeanKSampler

    latent = {"samples": torch.zeros(1, 16, size // 8, size // 8)}

    def run() -> torch.Tensor:
        return LeanKSampler().run(engine, 0, steps, 1.0, sampler, scheduler, latent, 1.0, "cuda_graph",
                                  positive_prompt=PROMPT)[0]["samples"]

    return run

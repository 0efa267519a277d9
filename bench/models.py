"""Full-size SD1.5 / SDXL architectures with random weights, for GPU benchmarks.

The configs are the real models' diffusers configs written in code (no hub access). Weights are created on the
meta device (buffers such as CLIP's ``position_ids`` keep their real values) and materialised directly on the
target device, then filled with N(0, 1/fan_in) (norm weights 1,
biases 0) so activations stay O(1) in fp16; building SDXL's UNet this way takes seconds instead of minutes of
CPU initialisation. Random weights are valid for speed and memory, never for picture quality.
"""
from __future__ import annotations

import math

import torch

SD15_UNET = dict(sample_size=64, in_channels=4, out_channels=4, block_out_channels=(320, 640, 1280, 1280),
                 layers_per_block=2, down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
                 up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3, cross_attention_dim=768,
                 attention_head_dim=8, norm_num_groups=32)
SDXL_UNET = dict(sample_size=128, in_channels=4, out_channels=4, block_out_channels=(320, 640, 1280),
                 layers_per_block=2, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                 up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
                 transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20), cross_attention_dim=2048,
                 use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=256,
                 projection_class_embeddings_input_dim=2816, norm_num_groups=32)
SD_VAE = dict(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(128, 256, 512, 512),
              layers_per_block=2, norm_num_groups=32, sample_size=512,
              down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
              scaling_factor=0.18215)
CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=768)
CLIP_G = dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
              max_position_embeddings=77, hidden_act="gelu", projection_dim=1280)
SCHEDULER = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                 steps_offset=1, set_alpha_to_one=False, clip_sample=False, prediction_type="epsilon",
                 timestep_spacing="leading")


@torch.no_grad()
def randomize_(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Fill every parameter in place: N(0, 1/fan_in) for weights with ndim >= 2, 1 for norm weights, 0 for biases."""
    gen = torch.Generator(device=next(module.parameters()).device).manual_seed(seed)
    for name, p in module.named_parameters():
        if p.ndim >= 2:
            fan_in = p[0].numel()
            p.normal_(0.0, 1.0 / math.sqrt(fan_in), generator=gen)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.fill_(1.0)
    for b in module.buffers():
        if b.is_floating_point() and not torch.isfinite(b).all():
            b.zero_()
    return module


def _materialise(cls, config: dict, device, dtype, seed: int):
    # Parameters on the meta device, buffers real (accelerate's init_empty_weights without buffers): ``to_empty``
    # leaves memory uninitialised, and CLIP's ``position_ids`` buffer must stay ``arange(77)``, not garbage.
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        module = cls(**config) if not hasattr(cls, "config_class") else cls(config)
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    # cast on the meta device, then allocate: the weights are created in their final dtype, so no wider copy
    # passes through the allocator and leaves holes that a later peak-memory reading would count
    module.to(dtype).to_empty(device=device)
    with torch.no_grad():
        for name, b in module.named_buffers():
            b.copy_(buffers[name])
    randomize_(module, seed)
    return module.eval().requires_grad_(False)


def full_unet(kind: str = "sdxl", device="cuda", dtype=torch.float16, seed: int = 0):
    """A full-size SD1.5 (``kind="sd15"``) or SDXL (``"sdxl"``) UNet with random weights."""
    from diffusers import UNet2DConditionModel

    configs = {"sd15": SD15_UNET, "sdxl": SDXL_UNET}
    if kind not in configs:
        raise ValueError(f"kind={kind!r}: expected 'sd15' or 'sdxl'")
    return _materialise(UNet2DConditionModel, configs[kind], device, dtype, seed)


def full_vae(device="cuda", dtype=torch.float16, seed: int = 0):
    """The SD / SDXL VAE architecture (AutoencoderKL, 83M parameters) with random weights."""
    from diffusers import AutoencoderKL

    return _materialise(AutoencoderKL, SD_VAE, device, dtype, seed)


def full_text_encoder(kind: str = "clip_l", device="cuda", dtype=torch.float16, seed: int = 0):
    """CLIP-L (``CLIPTextModel``) or CLIP-G with projection (``CLIPTextModelWithProjection``), random weights."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    if kind == "clip_l":
        cls, cfg = CLIPTextModel, CLIP_L
    elif kind == "clip_g":
        cls, cfg = CLIPTextModelWithProjection, CLIP_G
    else:
        raise ValueError(f"kind={kind!r}: expected 'clip_l' or 'clip_g'")
    return _materialise(cls, CLIPTextConfig(**cfg), device, dtype, seed)


def unet_inputs(kind: str, batch: int, latent_hw: int, device="cuda", dtype=torch.float16, seed: int = 0) -> dict:
    """Random inputs for one UNet call: sample, timestep, encoder_hidden_states (+ SDXL added conditioning)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    ctx_dim = 768 if kind == "sd15" else 2048
    out = {
        "sample": torch.randn(batch, 4, latent_hw, latent_hw, generator=g).to(device, dtype),
        "timestep": torch.tensor(500, device=device),
        "encoder_hidden_states": torch.randn(batch, 77, ctx_dim, generator=g).to(device, dtype),
    }
    if kind == "sdxl":
        hw = latent_hw * 8
        out["added_cond_kwargs"] = {
            "text_embeds": torch.randn(batch, 1280, generator=g).to(device, dtype),
            "time_ids": torch.tensor([[hw, hw, 0, 0, hw, hw]] * batch, device=device, dtype=dtype),
        }
    return out


class NoText(torch.nn.Module):
    """Stands in for a text encoder: the benchmarks feed precomputed embeddings, so none is ever called."""

    def __init__(self):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1), requires_grad=False)


def tiny_engine(family: str):
    """A resident fp32 engine over the package's tiny random model on the CPU (smoke mode)."""
    from ..memory.engine import engine_from_parts, parts_from_components
    from ..memory.tiny import build_tiny_components

    parts = parts_from_components(build_tiny_components(family), name=f"tiny-{family}")
    return engine_from_parts(parts, device="cpu", dtype=torch.float32, vae_dtype=torch.float32)


def full_parts(kind: str, device, host: bool = False):
    """``ModelParts`` over a full-size random SD1.5 (``kind="sd15"``) or SDXL (``"sdxl"``) UNet and the SD VAE (fp16,
    built on ``device``; moved to the host with ``host``), with stand-in text encoders (conditioning is fed
    precomputed). The same seeds every call: every build holds the same weights."""
    from ..memory.engine import ModelParts

    unet, vae = full_unet(kind, device=device), full_vae(device=device)
    if host:
        unet, vae = unet.to("cpu"), vae.to("cpu")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return ModelParts(family="sdxl" if kind == "sdxl" else "sd1", unet=unet, vae=vae, text_encoder=NoText(),
                      tokenizer=None, scheduler_config=dict(SCHEDULER),
                      text_encoder_2=NoText() if kind == "sdxl" else None, name=f"random-{kind}")


def full_engine(kind: str, device: torch.device):
    """A resident fp16 engine over :func:`full_parts`."""
    from ..memory.engine import engine_from_parts

    return engine_from_parts(full_parts(kind, device), device=device, dtype=torch.float16, vae_dtype=torch.float16)

"""The LoRA suite's model and files: the UNet with its inputs for the mode (full-size SDXL fp16 on a GPU, the tiny
SDXL-like UNet in fp32 for smoke), an engine over it, and random kohya-layout LoRA files over every attention and
feed-forward Linear (plus both text encoders' layers, as SDXL trainers write)."""
from __future__ import annotations

import re

import torch

ATTN_FF = re.compile(r"(attn[12]\.(to_q|to_k|to_v|to_out\.0)|ff\.net\.(0\.proj|2))$")


def unet_and_inputs(ctx):
    """(unet, inputs dict, rank, dtype) for the mode: full SDXL fp16 on the GPU, tiny SDXL fp32 in smoke."""
    if ctx.smoke:
        from diffusers import UNet2DConditionModel

        from ..memory.tiny import unet_config

        torch.manual_seed(0)
        unet = UNet2DConditionModel(**unet_config("sdxl")).eval().requires_grad_(False)
        g = torch.Generator().manual_seed(0)
        inputs = {"sample": torch.randn(2, 4, 8, 8, generator=g), "timestep": torch.tensor(500),
                  "encoder_hidden_states": torch.randn(2, 77, 192, generator=g),
                  "added_cond_kwargs": {"text_embeds": torch.randn(2, 128, generator=g),
                                        "time_ids": torch.tensor([[64.0, 64, 0, 0, 64, 64]] * 2)}}
        return unet, inputs, 4, torch.float32
    from .models import full_unet, unet_inputs

    unet = full_unet("sdxl", device=ctx.device, dtype=torch.float16)
    return unet, unet_inputs("sdxl", batch=2, latent_hw=128, device=ctx.device), 32, torch.float16


def unet_engine(unet, device, dtype):
    from ..memory.engine import LeanEngine, ModelParts

    parts = ModelParts(family="sdxl", unet=unet, vae=None, text_encoder=None, tokenizer=None, scheduler_config={},
                       name="bench-sdxl-unet")
    return LeanEngine(parts=parts, device=torch.device(device), dtype=dtype)


def _factors(module, rank, gen, device):
    fan_in, out = module.in_features, module.out_features
    down = torch.randn(rank, fan_in, generator=gen, device=device) / fan_in ** 0.5
    up = 0.25 * torch.randn(out, rank, generator=gen, device=device) / rank ** 0.5
    return down, up


def kohya_unet(unet, rank, device) -> dict:
    """kohya SDXL layout (LDM names), fp16, alpha = rank, every attention / feed-forward Linear."""
    from ..lora.keymap import ldm_unet_names

    ldm = ldm_unet_names(unet)
    gen = torch.Generator(device=device).manual_seed(1)
    sd = {}
    for name, m in unet.named_modules():
        if isinstance(m, torch.nn.Linear) and ATTN_FF.search(name):
            key = "lora_unet_" + ldm[name].replace(".", "_")
            down, up = _factors(m, rank, gen, device)
            sd[key + ".lora_down.weight"] = down.half().cpu()
            sd[key + ".lora_up.weight"] = up.half().cpu()
            sd[key + ".alpha"] = torch.tensor(float(rank), dtype=torch.float16)
    return sd


def kohya_text(rank, device, smoke) -> dict:
    """Text-encoder layers of the same file (CLIP-L as lora_te1_, CLIP-G as lora_te2_), as SDXL trainers write."""
    from .models import CLIP_G, CLIP_L

    gen = torch.Generator(device=device).manual_seed(2)
    sd = {}
    for prefix, cfg in (("lora_te1_", CLIP_L), ("lora_te2_", CLIP_G)):
        hidden, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
        if smoke:
            hidden, inter, layers = 64, 256, 2
        shapes = {"self_attn_q_proj": (hidden, hidden), "self_attn_k_proj": (hidden, hidden),
                  "self_attn_v_proj": (hidden, hidden), "self_attn_out_proj": (hidden, hidden),
                  "mlp_fc1": (hidden, inter), "mlp_fc2": (inter, hidden)}
        for i in range(layers):
            for mod, (fan_in, out) in shapes.items():
                key = f"{prefix}text_model_encoder_layers_{i}_{mod}"
                sd[key + ".lora_down.weight"] = torch.randn(rank, fan_in, generator=gen, device=device).half().cpu()
                sd[key + ".lora_up.weight"] = torch.randn(out, rank, generator=gen, device=device).half().cpu()
                sd[key + ".alpha"] = torch.tensor(float(rank), dtype=torch.float16)
    return sd

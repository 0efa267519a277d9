"""Test kit: the tiny Qwen-Image written as ComfyUI split files (diffusion model, text encoder, VAE), as users have them.

The layouts are ComfyUI's (``comfy/ldm/qwen_image/model.py``, ``comfy/text_encoders/llama.py`` ``Qwen25_7BVLI``,
``comfy/ldm/wan/vae.py``): the DiT under diffusers' names (optionally under ``model.diffusion_model.``), the
Qwen2.5-VL file with the language model under ``model.``, the vision tower under ``visual.`` and an ``lm_head``,
and the VAE in the original Wan 2.1 layout, produced here by a hand-written inverse of diffusers' converter (the
direction the loader does not take, so a wrong rename on either side fails the round trip instead of cancelling
out). The VAE file is always bf16, as Comfy-Org ships it; ``dtype`` applies to the DiT and the text encoder.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from .zimage_split import COMFY_PREFIX, store

_RESNET = {"norm1.gamma": "residual.0.gamma", "conv1.weight": "residual.2.weight", "conv1.bias": "residual.2.bias",
           "norm2.gamma": "residual.3.gamma", "conv2.weight": "residual.6.weight", "conv2.bias": "residual.6.bias",
           "conv_shortcut.weight": "shortcut.weight", "conv_shortcut.bias": "shortcut.bias"}
_TOP = {"quant_conv.": "conv1.", "post_quant_conv.": "conv2.", "encoder.conv_in.": "encoder.conv1.",
        "decoder.conv_in.": "decoder.conv1.", "encoder.norm_out.": "encoder.head.0.",
        "decoder.norm_out.": "decoder.head.0.", "encoder.conv_out.": "encoder.head.2.",
        "decoder.conv_out.": "decoder.head.2."}


def _resnet(rest: str) -> str:
    return _RESNET.get(rest, rest)


def vae_wan(sd: dict, per_level: int = 3) -> dict:
    """diffusers ``AutoencoderKLQwenImage`` keys -> the original Wan 2.1 layout (ComfyUI's ``WanVAE``): flat
    ``encoder.downsamples`` / ``decoder.upsamples`` (``per_level`` resnets then the upsampler per decoder level),
    ``middle.0/1/2``, ``head.0/2``, residual blocks as ``residual.0/2/3/6`` and ``shortcut``."""
    out = {}
    for key, t in sd.items():
        new = None
        for old, repl in _TOP.items():
            if key.startswith(old):
                new = repl + key[len(old):]
        m = re.match(r"^(encoder|decoder)\.mid_block\.(resnets|attentions)\.(\d+)\.(.*)$", key)
        if m:
            index = 1 if m[2] == "attentions" else 2 * int(m[3])
            new = f"{m[1]}.middle.{index}." + (m[4] if m[2] == "attentions" else _resnet(m[4]))
        m = re.match(r"^encoder\.down_blocks\.(\d+)\.(.*)$", key)
        if m:
            new = f"encoder.downsamples.{m[1]}." + _resnet(m[2])
        m = re.match(r"^decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.*)$", key)
        if m:
            new = f"decoder.upsamples.{(per_level + 1) * int(m[1]) + int(m[2])}." + _resnet(m[3])
        m = re.match(r"^decoder\.up_blocks\.(\d+)\.upsamplers\.0\.(.*)$", key)
        if m:
            new = f"decoder.upsamples.{(per_level + 1) * int(m[1]) + per_level}.{m[2]}"
        assert new is not None, key
        out[new] = t
    return out


def text_encoder_comfy(model) -> dict:
    """A ``Qwen2_5_VLForConditionalGeneration`` as Hugging Face's / ComfyUI's file holds it: ``model.`` + the
    language model, ``visual.`` + the vision tower, ``lm_head``."""
    inner = model.model
    out = {"model." + k: v for k, v in inner.language_model.state_dict().items()}
    out.update({"visual." + k: v for k, v in inner.visual.state_dict().items()})
    out["lm_head.weight"] = model.lm_head.weight
    return out


def write_split_files(components: dict, models: Path, tag: str, dtype: str = "bf16", comfy: bool = True,
                      folders=("diffusion_models", "text_encoders", "vae")) -> dict:
    """Write the three files under ``models/<folder>/`` and return the node's three input values; ``comfy``: the
    DiT under ``model.diffusion_model.``."""
    dit = components["transformer"].state_dict()
    parts = {"diffusion_model": ({COMFY_PREFIX + k: v for k, v in dit.items()} if comfy else dict(dit), dtype),
             "text_encoder": (text_encoder_comfy(components["text_encoder"]), dtype),
             "vae": (vae_wan(components["vae"].state_dict()), "bf16")}
    names = {}
    for (arg, (sd, stored)), folder in zip(parts.items(), folders):
        path = Path(models) / folder / f"{tag}_{arg}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in store(sd, stored).items()}, str(path))
        names[arg] = path.name
    return names


def qwen_grid(components: dict, dtype: str) -> dict:
    """Round the tiny model's weights in place onto what a ``dtype`` file stores exactly (bf16 values; for fp8
    also tensors of 2+ dims onto the e4m3 grid, scale 1), so the loaded file equals the diffusers folder."""
    from .zimage_split import bf16_grid, fp8_grid

    return bf16_grid(components) if dtype == "bf16" else fp8_grid(components, scaled=dtype == "fp8_scaled")

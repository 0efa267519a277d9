"""Qwen-Image's split files (ComfyUI's layout): registry rows, the cross-file checks and configs from shapes.

ComfyUI's layouts (its own source is the reference): the DiT (``comfy/ldm/qwen_image/model.py``, detected in
``comfy/model_detection.py`` by ``txt_norm.weight``) uses diffusers' ``QwenImageTransformer2DModel`` names, with
or without ``model.diffusion_model.``; the text encoder (``comfy/text_encoders/llama.py`` ``Qwen25_7BVLI``,
detected in ``comfy/sd.py`` by a biased ``model.layers.0.self_attn.k_proj``) is Hugging Face's Qwen2.5-VL file:
the language model under ``model.``, the vision tower under ``visual.``, maybe ``lm_head``; the VAE
(``comfy/ldm/wan/vae.py``) is the original Wan 2.1 layout (``conv1``, flat ``downsamples`` / ``upsamples``,
``middle``, ``head``), converted by diffusers' own ``convert_wan_vae_to_diffusers``. No key map is written here.

Invariant: every size comes from a tensor shape; only what no tensor records comes from Qwen/Qwen-Image's
published configs (RoPE split of a head 1/8 + 7/16 + 7/16 as 16 + 56 + 56 of 128, norm epsilon, RoPE base, the
VAE's latent mean/std: ``AutoencoderKLQwenImage``'s defaults, which are Qwen-Image's).
"""
from __future__ import annotations

import re
from typing import Any

from .keyrules import Has, Lacks, Shapes, all_of, any_of, none_of
from .zimage_configs import _count, _need, head_layout
from .zimage_layouts import DIT_PREFIX, TEXT_PREFIX, Layout

FAMILY = "qwen_image"
MODEL = "Qwen-Image"
WANTED = {"transformer": "the Qwen-Image diffusion model (qwen_image_bf16.safetensors or qwen_image_fp8_e4m3fn)",
          "text_encoder": "the Qwen2.5-VL-7B text encoder (qwen_2.5_vl_7b.safetensors or an fp8 variant)",
          "vae": "the Qwen-Image VAE (qwen_image_vae.safetensors)"}
LATENT_CHANNELS = 16
# Qwen/Qwen-Image's text_encoder/config.json values that no tensor records.
TEXT_FIXED: dict[str, Any] = {"rms_norm_eps": 1e-6, "max_position_embeddings": 128000}
ROPE_THETA = 1000000.0


def _dit(key: str):
    return any_of(key, DIT_PREFIX + key)


def _text(key: str):
    return any_of(key, TEXT_PREFIX + key)


def _row(role: str, layout: str, display: str, supported: bool, rule) -> Layout:
    return Layout(layout, display, supported, rule, role, FAMILY)


ROWS: tuple[Layout, ...] = (
    _row("transformer", "qwen-image-2.1", "Qwen-Image 2.1 MMDiT (fused gate_up MLP)", False,
         all_of(any_of(_dit("txt_in.text_norm.weight"), _dit("transformer_blocks.0.img_mlp.gate_up.weight")))),
    _row("transformer", "diffusers", "Qwen-Image MMDiT", True,
         all_of(_dit("txt_norm.weight"), _dit("img_in.weight"), _dit("transformer_blocks.0.img_mod.1.weight"),
                _dit("transformer_blocks.0.attn.add_q_proj.weight"))),
    _row("text_encoder", "hf", "Qwen2.5-VL text encoder (Qwen-Image's)", True,
         all_of(_text("layers.0.self_attn.q_proj.weight"), _text("layers.0.self_attn.q_proj.bias"),
                none_of(_text("layers.0.self_attn.q_norm.weight")))),
    _row("vae", "wan", "Qwen-Image / Wan 2.1 VAE (original layout)", True,
         all_of(Has("encoder.conv1.weight", ndim=5), Has("decoder.conv1.weight", ndim=5),
                "decoder.middle.0.residual.0.gamma", Lacks("encoder.downsamples.0.downsamples.0.residual.0.gamma"))),
    _row("vae", "diffusers", "Qwen-Image VAE (diffusers layout)", True,
         all_of(Has("encoder.conv_in.weight", ndim=5), Has("decoder.conv_in.weight", ndim=5),
                "decoder.mid_block.resnets.0.norm1.gamma")),
)


def _shape(shapes: Shapes, key: str, prefix: str) -> tuple:
    return tuple(shapes.get(key, shapes.get(prefix + key, ())))


def check_together(dit: Shapes, text: Shapes, vae: Shapes, names: dict, fix) -> None:
    """The three files fit each other: the VAE has 16 latent channels (the DiT's), and the text encoder's hidden
    size is the DiT's text width (``txt_norm``); ``ValueError`` naming the input that does not fit."""
    channels = _shape(vae, "decoder.conv1.weight", "")[1:2] or _shape(vae, "decoder.conv_in.weight", "")[1:2]
    if channels and channels[0] != LATENT_CHANNELS:
        raise ValueError(f"vae={names['vae']!r}: a video VAE with {channels[0]} latent channels (Wan 2.2's has 48); "
                         f"{MODEL} needs its {LATENT_CHANNELS}-channel VAE: {fix('vae')}")
    width = _shape(dit, "txt_norm.weight", DIT_PREFIX)
    hidden = _shape(text, "embed_tokens.weight", TEXT_PREFIX)
    if width and hidden and width[0] != hidden[1]:
        raise ValueError(f"text_encoder={names['text_encoder']!r}: a Qwen2.5 of hidden size {hidden[1]}, but the "
                         f"diffusion model reads text of width {width[0]} (Qwen2.5-VL-7B: 3584); "
                         f"{fix('text_encoder')}")


def transformer_config(shapes: Shapes, what: str = "diffusion_model") -> dict[str, Any]:
    """``QwenImageTransformer2DModel`` keyword arguments for a diffusers-layout state dict's ``shapes``."""
    inner, head = head_layout(shapes, "transformer_blocks.0.attn.to_q.weight", "transformer_blocks.0.attn.norm_q.weight",
                              16, MODEL, what)
    patch = 2  # ComfyUI's and diffusers' Qwen-Image: 2x2 patches of the 16-channel latent
    return dict(patch_size=patch, in_channels=_need(shapes, "img_in.weight", what)[1],
                out_channels=_need(shapes, "proj_out.weight", what)[0] // (patch * patch),
                num_layers=_count(shapes, r"transformer_blocks\.(\d+)\."), attention_head_dim=head,
                num_attention_heads=inner // head, joint_attention_dim=_need(shapes, "txt_norm.weight", what)[0],
                guidance_embeds=any(k.startswith("time_text_embed.guidance_embedder.") for k in shapes),
                axes_dims_rope=(head // 8, head * 7 // 16, head * 7 // 16))


def text_config(shapes: Shapes, what: str = "text_encoder"):
    """transformers ``Qwen2_5_VLTextConfig`` for a ``Qwen2_5_VLTextModel`` state dict's ``shapes`` (no prefix).

    No tensor records the head size (Qwen2.5 has no q/k norm): it is the largest of 128, 64, 32, 16 dividing both
    the q and k projections' widths (Qwen2.5-VL-7B: 3584 / 512 -> 128, its published value); the multimodal RoPE
    sections split half a head 1/4 + 3/8 + 3/8 (16 + 24 + 24 of 64), as Qwen2.5-VL's."""
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLTextConfig

    vocab, hidden = _need(shapes, "embed_tokens.weight", what)
    inner = _need(shapes, "layers.0.self_attn.q_proj.weight", what)[0]
    kv = _need(shapes, "layers.0.self_attn.k_proj.weight", what)[0]
    head = next((h for h in (128, 64, 32, 16) if inner % h == 0 and kv % h == 0), None)
    if head is None:
        raise ValueError(f"{what}: widths {inner} / {kv} fit no Qwen2.5 head size; re-download the file")
    heads = inner // head
    half = head // 2
    sections = [half // 4, half * 3 // 8, half - half // 4 - half * 3 // 8]
    return Qwen2_5_VLTextConfig(vocab_size=vocab, hidden_size=hidden,
                                intermediate_size=_need(shapes, "layers.0.mlp.gate_proj.weight", what)[0],
                                num_hidden_layers=_count(shapes, r"layers\.(\d+)\."), num_attention_heads=heads,
                                num_key_value_heads=kv // head, tie_word_embeddings=False,
                                rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA,
                                                 "mrope_section": sections}, **TEXT_FIXED)


def vae_config(shapes: Shapes, what: str = "vae") -> dict[str, Any]:
    """``AutoencoderKLQwenImage`` keyword arguments for a diffusers-layout state dict's ``shapes``: the encoder's
    flat block list read as levels of resnets closed by a resample (with a ``time_conv`` where it also halves
    time)."""
    base = _need(shapes, "encoder.conv_in.weight", what)[0]
    blocks = sorted({int(m.group(1)) for k in shapes for m in [re.match(r"encoder\.down_blocks\.(\d+)\.", k)] if m})
    levels, resnets, temporal = [], 0, []
    for n in blocks:
        if f"encoder.down_blocks.{n}.resample.1.weight" in shapes:
            temporal.append(f"encoder.down_blocks.{n}.time_conv.weight" in shapes)
            levels.append(resnets)
            resnets = 0
        else:
            resnets += 1
    levels.append(resnets)
    widths, i = [], 0
    for count in levels:
        i += count
        widths.append(_need(shapes, f"encoder.down_blocks.{i - 1}.conv2.weight", what)[0] // base)
        i += 1
    if len(set(levels)) != 1:
        raise ValueError(f"{what}: VAE levels with {levels} resnets; not a Qwen-Image VAE: re-download the file")
    return dict(base_dim=base, z_dim=_need(shapes, "decoder.conv_in.weight", what)[1], dim_mult=widths,
                num_res_blocks=levels[0], attn_scales=[], temperal_downsample=temporal)


VISION_HEAD = 80  # Qwen2.5-VL's vision head size (1280 / 16); no tensor records it
VISION_FIXED: dict[str, Any] = {"window_size": 112, "tokens_per_second": 2, "hidden_act": "silu", "in_channels": 3}


def vision_config(shapes: Shapes, what: str = "text_encoder", prefix: str = "visual.") -> dict[str, Any]:
    """``Qwen2_5_VLVisionConfig`` keyword arguments for the vision tower in a Qwen2.5-VL file's ``shapes`` (keys under
    ``prefix``). Sizes come from shapes; the head size (80), the window (112 px) and which blocks attend over the
    whole image (every 8th and the last: 7, 15, 23, 31 of Qwen2.5-VL-7B's 32) are Qwen2.5-VL's published values."""
    sub = {k[len(prefix):]: v for k, v in shapes.items() if k.startswith(prefix)}
    hidden, _, temporal, patch, _ = _need(sub, "patch_embed.proj.weight", what)
    depth = _count(sub, r"blocks\.(\d+)\.")
    merge = round((_need(sub, "merger.mlp.0.weight", what)[1] / hidden) ** 0.5)
    if hidden % VISION_HEAD:
        raise ValueError(f"{what}: a vision tower of width {hidden}, not a multiple of Qwen2.5-VL's head size "
                         f"{VISION_HEAD}; re-download the file")
    return dict(depth=depth, hidden_size=hidden, intermediate_size=_need(sub, "blocks.0.mlp.gate_proj.weight", what)[0],
                num_heads=hidden // VISION_HEAD, out_hidden_size=_need(sub, "merger.mlp.2.weight", what)[0],
                patch_size=patch, temporal_patch_size=temporal, spatial_merge_size=merge,
                fullatt_block_indexes=[i for i in range(depth) if (i + 1) % 8 == 0 or i == depth - 1], **VISION_FIXED)

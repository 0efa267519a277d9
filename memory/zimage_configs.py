"""Configs of Z-Image's three parts inferred from diffusers-layout tensor shapes, so split files need no config file.

Invariant: every size comes from a shape (widths, depths, heads from the q/k norms' head size, caption width, patch
sizes, latent channels); only what no tensor records comes from the published Z-Image-Turbo configs below (norm
epsilons, RoPE bases and axis lengths, the timestep scale, the VAE's group count and latent scaling/shift) and from
Z-Image's RoPE split of each head: 1/4 for the frame axis, 3/8 for each image axis (32 + 48 + 48 of 128).
"""
from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

from .families import family_defaults

Shapes = Mapping[str, Sequence[int]]

# Z-Image-Turbo's transformer/config.json values that no tensor records.
DIT_FIXED: dict[str, Any] = {"norm_eps": 1e-5, "qk_norm": True, "rope_theta": 256.0, "t_scale": 1000.0,
                             "axes_lens": [1024, 512, 512]}
# Qwen3-4B's config.json values that no tensor records.
QWEN3_FIXED: dict[str, Any] = {"rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
                               "attention_bias": False}
VAE_GROUPS = 32  # GroupNorm groups of the Flux VAE (and every LDM VAE)
VAE_SAMPLE_SIZE = 1024  # the Flux VAE's config.json


def _count(shapes: Shapes, pattern: str) -> int:
    rx = re.compile(pattern)
    return len({m.group(1) for key in shapes for m in [rx.match(key)] if m})


def _need(shapes: Shapes, key: str, what: str) -> Sequence[int]:
    if key not in shapes:
        raise ValueError(f"{what}: the file lacks tensor '{key}', which its layout requires; the file is "
                         f"incomplete: re-download it")
    return shapes[key]


def head_layout(shapes: Shapes, q_key: str, norm_key: str, multiple: int, model: str, what: str) -> tuple[int, int]:
    """(width of the q projection, head size of its q norm), checked to be a DiT's: heads of a multiple of
    ``multiple`` channels that divide the width (``ValueError`` naming the input otherwise)."""
    dim = _need(shapes, q_key, what)[0]
    head = _need(shapes, norm_key, what)[0]
    if dim % head or head % multiple:
        raise ValueError(f"{what}: width {dim} and head size {head} are not a {model} DiT's (heads of a multiple of "
                         f"{multiple} channels that divide the width); re-download the file")
    return dim, head


def transformer_config(shapes: Shapes, what: str = "diffusion_model") -> dict[str, Any]:
    """``ZImageTransformer2DModel`` keyword arguments for a diffusers-layout state dict's ``shapes``."""
    dim, head = head_layout(shapes, "layers.0.attention.to_q.weight", "layers.0.attention.norm_q.weight", 8,
                            "Z-Image", what)
    patches = sorted((int(m.group(1)), int(m.group(2))) for key in shapes
                     for m in [re.fullmatch(r"all_x_embedder\.(\d+)-(\d+)\.weight", key)] if m)
    if not patches:
        raise ValueError(f"{what}: the file has no patch embedder (x_embedder); re-download it")
    p, f = patches[0]
    return dict(all_patch_size=tuple(p for p, _ in patches), all_f_patch_size=tuple(f for _, f in patches),
                in_channels=shapes[f"all_x_embedder.{p}-{f}.weight"][1] // (p * p * f), dim=dim,
                n_layers=_count(shapes, r"layers\.(\d+)\."), n_refiner_layers=_count(shapes, r"noise_refiner\.(\d+)\."),
                n_heads=dim // head, n_kv_heads=_need(shapes, "layers.0.attention.to_k.weight", what)[0] // head,
                cap_feat_dim=_need(shapes, "cap_embedder.0.weight", what)[0],
                axes_dims=[head // 4, head * 3 // 8, head * 3 // 8], **DIT_FIXED)


def qwen3_config(shapes: Shapes, what: str = "text_encoder"):
    """transformers ``Qwen3Config`` for a ``Qwen3Model`` state dict's ``shapes`` (no ``model.`` prefix)."""
    from transformers import Qwen3Config

    vocab, hidden = _need(shapes, "embed_tokens.weight", what)
    head = _need(shapes, "layers.0.self_attn.q_norm.weight", what)[0]
    return Qwen3Config(vocab_size=vocab, hidden_size=hidden, head_dim=head,
                       intermediate_size=_need(shapes, "layers.0.mlp.gate_proj.weight", what)[0],
                       num_hidden_layers=_count(shapes, r"layers\.(\d+)\."),
                       num_attention_heads=_need(shapes, "layers.0.self_attn.q_proj.weight", what)[0] // head,
                       num_key_value_heads=_need(shapes, "layers.0.self_attn.k_proj.weight", what)[0] // head,
                       **QWEN3_FIXED)


def vae_config(shapes: Shapes, what: str = "vae") -> dict[str, Any]:
    """``AutoencoderKL`` keyword arguments for a diffusers-layout VAE state dict's ``shapes``, with Z-Image's latent
    scaling and shift (the Flux VAE's)."""
    levels = _count(shapes, r"encoder\.down_blocks\.(\d+)\.")
    defaults = family_defaults("zimage")
    return dict(in_channels=_need(shapes, "encoder.conv_in.weight", what)[1],
                out_channels=_need(shapes, "decoder.conv_out.weight", what)[0],
                latent_channels=_need(shapes, "decoder.conv_in.weight", what)[1],
                block_out_channels=tuple(_need(shapes, f"encoder.down_blocks.{i}.resnets.0.conv1.weight", what)[0]
                                         for i in range(levels)),
                layers_per_block=_count(shapes, r"encoder\.down_blocks\.0\.resnets\.(\d+)\."),
                down_block_types=("DownEncoderBlock2D",) * levels, up_block_types=("UpDecoderBlock2D",) * levels,
                norm_num_groups=VAE_GROUPS, sample_size=VAE_SAMPLE_SIZE,
                mid_block_add_attention="encoder.mid_block.attentions.0.to_q.weight" in shapes,
                use_quant_conv="quant_conv.weight" in shapes, use_post_quant_conv="post_quant_conv.weight" in shapes,
                scaling_factor=defaults["vae_scaling_factor"], shift_factor=defaults["vae_shift_factor"])

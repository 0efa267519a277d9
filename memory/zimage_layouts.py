"""Which part of Z-Image a split file holds, and in which key layout, decided by a declarative key registry.

Invariant: a file's role (diffusion model, text encoder, VAE) and layout come from tensor *names and shapes only*
(the safetensors header, ``keyrules``), never from its file name or folder, so a file put into the wrong input
is named for what it is. Rows for parts the split loader refuses (CLIP, T5, Flux, SD UNets and VAEs ...) exist so
that the error says what was found and what to pick instead; Qwen-Image's rows are in ``qwen_image_layouts`` and
``split_files`` matches a file against both (each row names its ``family``). Checks that need two files (the
text encoder's width against the DiT's caption width, the VAE's channels against the DiT's) are here too, so
every input is refused before any tensor is read.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .families import Family
from .keyrules import AnyOf, Has, Lacks, Shapes, all_of, any_of, none_of

DIT_PREFIX = "model.diffusion_model."  # Comfy-Org's repackaging (and ComfyUI's own saves) put the DiT under it
TEXT_PREFIX = "model."  # Hugging Face causal-LM files hold the Qwen3 body under it (lm_head beside it)
INPUTS = {"transformer": "diffusion_model", "text_encoder": "text_encoder", "vae": "vae"}
WHERE = {"transformer": "models/diffusion_models (or models/unet)",
           "text_encoder": "models/text_encoders (or models/clip)", "vae": "models/vae"}
WANTED = {"transformer": "the Z-Image(-Turbo) diffusion model (z_image_turbo_bf16.safetensors or an fp8 variant)",
          "text_encoder": "the Qwen3-4B text encoder (qwen_3_4b.safetensors or an fp8 variant)",
          "vae": "the 16-channel Flux VAE (ae.safetensors)"}
LATENT_CHANNELS = 16


@dataclass(frozen=True)
class Layout(Family):
    """A families-style registry row for one split file: ``name`` is its key layout ("original", "diffusers", "hf",
    or the refused model's short name), ``role`` the part it holds ("transformer", "text_encoder", "vae")."""

    role: str
    family: str = "zimage"  # the model whose part it is (split_files picks the family the inputs agree on)


def _row(role: str, layout: str, display: str, supported: bool, rule) -> Layout:
    return Layout(layout, display, supported, rule, role)


def _dit(key: str) -> AnyOf:
    return any_of(key, DIT_PREFIX + key)


def _text(key: str) -> AnyOf:
    return any_of(key, TEXT_PREFIX + key)


_QWEN_Q = "layers.0.self_attn.q_proj.weight"
_CLIP_TOKENS = "text_model.embeddings.token_embedding.weight"

REGISTRY: tuple[Layout, ...] = (
    _row("transformer", "original", "Z-Image DiT (original layout: fused qkv)", True,
           all_of(_dit("layers.0.attention.qkv.weight"), _dit("layers.0.adaLN_modulation.0.weight"),
                  _dit("cap_embedder.1.weight"), _dit("x_embedder.weight"))),
    _row("transformer", "diffusers", "Z-Image DiT (diffusers layout)", True,
           all_of(_dit("layers.0.attention.to_q.weight"), _dit("layers.0.adaLN_modulation.0.weight"),
                  _dit("cap_embedder.1.weight"))),
    _row("transformer", "lumina2", "Lumina Image 2.0 DiT", False,
           all_of(_dit("cap_embedder.1.weight"), _dit("layers.0.adaLN_modulation.1.weight"))),
    _row("transformer", "flux", "Flux DiT", False, all_of(any_of(
        _dit("double_blocks.0.img_attn.norm.key_norm.scale"), "single_transformer_blocks.0.attn.norm_k.weight"))),
    _row("transformer", "sd3", "Stable Diffusion 3 MMDiT", False,
           all_of(any_of(_dit("joint_blocks.0.context_block.adaLN_modulation.1.bias"),
                         "transformer_blocks.0.ff_context.net.0.proj.weight"))),
    _row("transformer", "sd-unet", "Stable Diffusion / SDXL UNet", False,
           all_of(any_of(_dit("input_blocks.0.0.weight"), "down_blocks.0.resnets.0.conv1.weight"))),
    _row("text_encoder", "hf", "Qwen3 text encoder (Hugging Face layout)", True,
           all_of(_text("layers.0.self_attn.q_norm.weight"), _text(_QWEN_Q), _text("embed_tokens.weight"),
                  none_of(_text("layers.0.self_attn.q_proj.bias"), "visual.patch_embed.proj.weight",
                          "model.visual.patch_embed.proj.weight"))),
    _row("text_encoder", "decoder-lm", "decoder language model without Qwen3's q_norm (Llama, Mistral, Gemma ...)",
           False, all_of(_text(_QWEN_Q), Lacks("layers.0.self_attn.q_norm.weight"),
                         Lacks("model.layers.0.self_attn.q_norm.weight"))),
    _row("text_encoder", "clip", "CLIP text encoder (CLIP-L / CLIP-G)", False,
           all_of(any_of(_CLIP_TOKENS, "transformer." + _CLIP_TOKENS, "token_embedding.weight",
                         "cond_stage_model.transformer." + _CLIP_TOKENS))),
    _row("text_encoder", "t5", "T5 / UMT5 encoder", False,
           all_of(any_of("encoder.block.0.layer.0.SelfAttention.q.weight", "shared.weight"))),
    _row("vae", "video", "video VAE (3-D convolutions)", False,
           all_of(any_of(Has("decoder.conv_in.weight", ndim=5), Has("encoder.conv1.weight", ndim=5),
                         Has("decoder.conv1.weight", ndim=5)))),
    _row("vae", "original", "VAE (original layout)", True,
           all_of("encoder.down.0.block.0.norm1.weight", "decoder.up.0.block.0.norm1.weight",
                  Has("decoder.conv_in.weight", ndim=4))),
    _row("vae", "diffusers", "VAE (diffusers layout)", True,
           all_of("encoder.down_blocks.0.resnets.0.norm1.weight", "decoder.up_blocks.0.resnets.0.norm1.weight",
                  Has("decoder.conv_in.weight", ndim=4))),
)


def _fix(role: str, wanted: dict = WANTED) -> str:
    return f"pick {wanted[role]} from {WHERE[role]} in '{INPUTS[role]}'"


def _shape(shapes: Shapes, *keys: str) -> Optional[tuple]:
    for key in keys:
        if key in shapes:
            return tuple(shapes[key])
    return None


def check_together(dit: Shapes, text: Shapes, vae: Shapes, names: dict) -> None:
    """The three files fit each other: the text encoder's hidden size is the DiT's caption width and the VAE has
    the DiT's 16 latent channels (``ValueError`` naming the input that does not fit)."""
    channels = _shape(vae, "decoder.conv_in.weight")[1]
    if channels != LATENT_CHANNELS:
        raise ValueError(f"vae={names['vae']!r}: a VAE with {channels} latent channels; Z-Image needs the "
                         f"{LATENT_CHANNELS}-channel Flux VAE (an SD1.x/SDXL VAE has 4): {_fix('vae')}")
    caption = _shape(dit, "cap_embedder.0.weight", DIT_PREFIX + "cap_embedder.0.weight")
    hidden = _shape(text, "embed_tokens.weight", TEXT_PREFIX + "embed_tokens.weight")
    if caption and hidden and caption[0] != hidden[1]:
        raise ValueError(f"text_encoder={names['text_encoder']!r}: a Qwen3 of hidden size {hidden[1]}, but the "
                         f"diffusion model reads captions of width {caption[0]} (Qwen3-4B: 2560); "
                         f"{_fix('text_encoder')}")

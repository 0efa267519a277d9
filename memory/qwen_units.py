"""Qwen-Image's denoiser units for planning: its dual-stream transformer blocks in execution order.

Invariant: a unit is one ``QwenImageTransformerBlock`` (``transformer_blocks.N``); every block sees, per row of one
transformer call, the image tokens of the working shape (2x2 patches of the latent: ``h/2 x w/2``), as many again
for each reference image an edit family packs beside them (``reference_images``: Qwen-Image-Edit's reference
latent has the output's token count), and ``TEXT_TOKENS`` prompt tokens (the pipeline's default
``max_sequence_length``, the longest prompt the plan allows for; an edit family's rows are longer, carrying the
condition pictures' vision tokens: its ``dit_text_tokens``); its joint attention spans all of them. The
working shape's batch counts the rows of one call: a guided step runs the prompt's and the negative's rows in one
batched call (2 per image), so the default batch 2 is one guided image. The embedders, the text norm and the output
layers are always resident.

FLOPs per row of a block (``dual_stream_block_unit``): the block is two streams that meet only in attention, so an
image token passes through the image stream's weights (``to_q/k/v``, ``to_out``, ``img_mlp``), a text token through
the text stream's (``add_*_proj``, ``to_add_out``, ``txt_mlp``), each ``2 x tokens x weights``; the two modulation
linears (``img_mod``, ``txt_mod``: a third of the block's bytes) see one timestep vector per row; the joint attention
adds ``4 x N^2 x width``. Counting every weight against every token would make the step look over twice as heavy
per streamed byte as it is, and ``stream_schedule.copy_bound`` would take a copy-bound step for a compute-bound one.
Sizes come from the config and the blocks' parameters, so planning needs neither a trace nor a ``meta`` copy, as for
Z-Image (``dit_units.py``).

Why the largest row counts: the activation estimate (``plan.TRANSIENT_FACTOR["dit"]`` x a block's output) must
hold for every call the sampler makes, and a block's transients grow with the tokens of its widest call.
"""
from __future__ import annotations

from typing import Optional

import torch

from .dit_units import token_block_unit
from .unet_units import Unit

TEXT_TOKENS = 512  # QwenImagePipeline's default max_sequence_length
MODULATION = ("img_mod.", "txt_mod.")  # parameter-name prefixes of a block's per-row modulation linears
TEXT_STREAM = ("txt_", "attn.add_", "attn.to_add_", "attn.norm_added_")  # ... of its text stream


def is_qwen_image_transformer(module: torch.nn.Module) -> bool:
    """Whether ``module`` is laid out as Qwen-Image's dual-stream DiT (image and text inputs, joint blocks)."""
    return all(hasattr(module, a) for a in ("transformer_blocks", "img_in", "txt_in", "txt_norm"))


def qwen_image_tokens(dit: torch.nn.Module, latent_h: int, latent_w: int, reference_images: int = 0,
                      text_tokens: Optional[int] = None) -> int:
    """Tokens per row of one transformer call at a ``latent_h x latent_w`` latent with ``text_tokens`` prompt rows
    (default ``TEXT_TOKENS``; module docstring)."""
    if isinstance(reference_images, bool) or not isinstance(reference_images, int) or reference_images < 0:
        raise ValueError(f"reference_images={reference_images!r}: expected a count of reference images >= 0")
    patch = int(dit.config.patch_size)
    text = TEXT_TOKENS if text_tokens is None else int(text_tokens)
    return (latent_h // patch) * (latent_w // patch) * (1 + reference_images) + text


def trace_qwen_image_units(dit: torch.nn.Module, working_shape: tuple[int, int, int], dtype: torch.dtype,
                           reference_images: int = 0, text_tokens: Optional[int] = None) -> list[Unit]:
    """Units in execution order with flat sizes and FLOP estimates at ``working_shape`` (module docstring)."""
    batch, h, w = (int(v) for v in working_shape)
    tokens = qwen_image_tokens(dit, h, w, reference_images, text_tokens)
    text = TEXT_TOKENS if text_tokens is None else int(text_tokens)
    width = int(dit.config.num_attention_heads) * int(dit.config.attention_head_dim)
    return [dual_stream_block_unit(f"transformer_blocks.{index}", block, dtype, batch, tokens - text, text, width)
            for index, block in enumerate(dit.transformer_blocks)]


def stream_weights(block: torch.nn.Module) -> dict:
    """``{"image", "text", "modulation": weights}`` of one joint block, by parameter name (module docstring)."""
    counts = {"image": 0, "text": 0, "modulation": 0}
    for name, param in block.named_parameters():
        part = "modulation" if name.startswith(MODULATION) else "text" if name.startswith(TEXT_STREAM) else "image"
        counts[part] += param.numel()
    return counts


def dual_stream_block_unit(name: str, block: torch.nn.Module, dtype: torch.dtype, batch: int, image_tokens: int,
                           text_tokens: int, width: int) -> Unit:
    """One joint block as a unit (``dit_units.token_block_unit`` over both streams' tokens), its weights' multiply-adds
    per row ``image_tokens x image weights + text_tokens x text weights + modulation weights``."""
    weights = stream_weights(block)
    macs = image_tokens * weights["image"] + text_tokens * weights["text"] + weights["modulation"]
    return token_block_unit(name, block, dtype, batch, image_tokens + text_tokens, width, width, "dit", macs)

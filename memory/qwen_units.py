"""Qwen-Image's denoiser units for planning: its dual-stream transformer blocks in execution order.

Invariant: a unit is one ``QwenImageTransformerBlock`` (``transformer_blocks.N``); every block sees the image tokens
of the working shape (2x2 patches of the latent: ``h/2 x w/2``) beside ``TEXT_TOKENS`` prompt tokens (the
pipeline's default ``max_sequence_length``, the longest prompt the plan allows for), and its joint attention spans
both. The embedders, the text norm and the output layers are always resident. Sizes come from the config and the
blocks' parameters, so planning needs neither a trace nor a ``meta`` copy, as for Z-Image (``dit_units.py``).
"""
from __future__ import annotations

import torch

from .dit_units import token_block_unit
from .unet_units import Unit

TEXT_TOKENS = 512  # QwenImagePipeline's default max_sequence_length


def is_qwen_image_transformer(module: torch.nn.Module) -> bool:
    """Whether ``module`` is laid out as Qwen-Image's dual-stream DiT (image and text inputs, joint blocks)."""
    return all(hasattr(module, a) for a in ("transformer_blocks", "img_in", "txt_in", "txt_norm"))


def trace_qwen_image_units(dit: torch.nn.Module, working_shape: tuple[int, int, int],
                           dtype: torch.dtype) -> list[Unit]:
    """Units in execution order with flat sizes and FLOP estimates at ``working_shape`` (module docstring)."""
    batch, h, w = (int(v) for v in working_shape)
    patch = int(dit.config.patch_size)
    tokens = (h // patch) * (w // patch) + TEXT_TOKENS
    width = int(dit.config.num_attention_heads) * int(dit.config.attention_head_dim)
    return [token_block_unit(f"transformer_blocks.{index}", block, dtype, batch, tokens, width, width, "dit")
            for index, block in enumerate(dit.transformer_blocks)]

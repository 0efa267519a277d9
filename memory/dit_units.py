"""A DiT's streamable *units*: its transformer blocks in execution order, sized from the config (no trace).

Invariant: a unit is one ``ZImageTransformerBlock``; the forward runs the image refiner blocks, then the caption
refiner blocks, then the main blocks, each once, and a block uses its weights only inside its own ``forward``
(so it can be moved in and out of the device around that call). Everything else (embedders, pad tokens, final
layer, RoPE tables) is always resident.

Token counts at a working shape ``(batch, latent_h, latent_w)``: image tokens ``ceil32(h/2 * w/2)`` (patch 2,
padded to multiples of 32), caption tokens ``CAPTION_TOKENS`` (the flow sampler's largest caption bucket, so the
activation estimate holds for every prompt it accepts), the main blocks see both. FLOPs per unit:
``2 x tokens x weights`` plus self-attention's two ``N x N x C`` products; the output is ``tokens x dim`` elements.
Sizes come from the config, so planning needs neither a trace nor a ``meta`` copy.
"""
from __future__ import annotations

from typing import Optional

import torch

from .hostmem import FlatLayout
from .unet_units import Unit, unit_params

CAPTION_TOKENS = 512  # ``sampling/flow/dit_forward.py`` CAPTION_BUCKETS[-1]
SEQ_MULTIPLE = 32


def is_zimage_transformer(module: torch.nn.Module) -> bool:
    """Whether ``module`` is laid out as Z-Image's single-stream DiT (refiners + main layers + pad tokens)."""
    return all(hasattr(module, a) for a in ("noise_refiner", "context_refiner", "layers", "x_pad_token"))


def _ceil(n: int, m: int = SEQ_MULTIPLE) -> int:
    return -(-n // m) * m


def trace_dit_units(dit: torch.nn.Module, working_shape: tuple[int, int, int], dtype: torch.dtype) -> list[Unit]:
    """Units in execution order with flat sizes and FLOP estimates at ``working_shape`` (module docstring)."""
    batch, h, w = (int(v) for v in working_shape)
    patch = int(dit.config.all_patch_size[0])
    image = _ceil((h // patch) * (w // patch))
    caption = CAPTION_TOKENS
    dim = int(dit.config.dim)
    groups = (("noise_refiner", image), ("context_refiner", caption), ("layers", image + caption))
    return [token_block_unit(f"{group}.{index}", block, dtype, batch, tokens, dim, dim, "dit")
            for group, tokens in groups for index, block in enumerate(getattr(dit, group))]


def token_block_unit(name: str, block: torch.nn.Module, dtype: torch.dtype, batch: int, tokens: int,
                     attention_width: int, out_width: int, kind: str, weight_macs: Optional[float] = None) -> Unit:
    """A transformer block over ``tokens`` tokens per row as a unit: its flat size in ``dtype``; FLOPs
    ``batch x (2 x weight_macs + 4 x tokens^2 x attention_width)``; output ``batch x tokens x out_width``.
    ``weight_macs``: multiply-adds per row through the block's weights (default ``tokens x weights``: every weight
    meets every token)."""
    params = unit_params(block)
    nbytes = FlatLayout.of(params, dtype).nbytes if params else 0
    if weight_macs is None:
        weight_macs = tokens * sum(p.numel() for p in params)
    flops = batch * (2.0 * weight_macs + 4.0 * tokens ** 2 * attention_width)
    return Unit(name, nbytes, flops, batch * tokens * out_width, kind)

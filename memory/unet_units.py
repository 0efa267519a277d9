"""The UNet's streamable *units*, in execution order, traced on the ``meta`` device.

Invariant: a unit is every ``ResnetBlock2D``, ``BasicTransformerBlock``, ``Downsample2D`` and ``Upsample2D``; each
runs once per forward, in a fixed order, and uses its weights only inside its own ``forward``, so it can be moved
in and out of the device around that call. Everything else (conv_in/out, time and added embeddings, norms,
transformer proj_in/out) is always resident. The execution order and every unit's output size at the working
shape come from one forward of an empty copy of the UNet on the ``meta`` device (no data, no memory).

FLOPs per unit (what ranks the units for streaming): ``2 x tokens x weights`` for every weight that sees the image
tokens, ``2 x batch x 77 x weights`` for the cross-attention keys and values (they see the context tokens), plus
self-attention's two ``N x N x C`` products for a transformer block.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .hostmem import FlatLayout

CONTEXT_TOKENS = 77


def stream_unit_types() -> tuple:
    from diffusers.models.attention import BasicTransformerBlock
    from diffusers.models.resnet import Downsample2D, ResnetBlock2D, Upsample2D

    return (ResnetBlock2D, BasicTransformerBlock, Downsample2D, Upsample2D)


@dataclass(frozen=True)
class Unit:
    name: str
    nbytes: int  # aligned flat size in the target dtype
    flops: float  # at the working shape
    out_numel: int = 0  # elements of the unit's output at the working shape
    kind: str = ""  # "resnet", "transformer", "downsample", "upsample"


def unit_params(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for _, p in module.named_parameters()]


def meta_inputs(config, batch: int, latent_h: int, latent_w: int) -> tuple:
    cross = config.cross_attention_dim
    if not isinstance(cross, int):
        raise ValueError(f"UNet cross_attention_dim={cross!r}: per-block context widths are not supported")
    dev = torch.device("meta")
    args = (torch.empty(batch, config.in_channels, latent_h, latent_w, device=dev), torch.tensor(500, device=dev))
    kwargs = {"encoder_hidden_states": torch.empty(batch, CONTEXT_TOKENS, cross, device=dev)}
    if config.addition_embed_type == "text_time":
        pooled = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
        kwargs["added_cond_kwargs"] = {"text_embeds": torch.empty(batch, pooled, device=dev),
                                       "time_ids": torch.empty(batch, 6, device=dev)}
    return args, kwargs


def trace_unet_units(unet: torch.nn.Module, working_shape: tuple[int, int, int], dtype: torch.dtype) -> list[Unit]:
    """Units in execution order with their flat sizes and FLOP estimates (one ``meta`` forward)."""
    types = stream_unit_types()
    batch, h, w = working_shape
    with torch.device("meta"):
        ghost = type(unet).from_config(unet.config)
    seen: list[tuple[str, tuple]] = []
    handles = []
    for name, mod in ghost.named_modules():
        if isinstance(mod, types):
            handles.append(mod.register_forward_hook(
                lambda m, a, out, name=name: seen.append((name, tuple((out[0] if isinstance(out, tuple) else out).shape)))))
    try:
        args, kwargs = meta_inputs(unet.config, batch, h, w)
        with torch.no_grad():
            ghost(*args, **kwargs)
    finally:
        for hd in handles:
            hd.remove()
    names = [n for n, _ in seen]
    if len(set(names)) != len(names):
        raise ValueError("a UNet block ran twice in one forward; block streaming needs each block to run once")
    real = dict(unet.named_modules())
    units = []
    for name, shape in seen:
        mod = real[name]
        params = unit_params(mod)
        nbytes = FlatLayout.of(params, dtype).nbytes if params else 0
        if len(shape) == 4:
            tokens, quad = shape[0] * shape[2] * shape[3], 0.0
        else:  # [B, N, C] transformer tokens: + self-attention's two N x N x C products
            tokens, quad = shape[0] * shape[1], 4.0 * shape[0] * shape[1] ** 2 * shape[2]
        kv = sum(p.numel() for n, p in mod.named_parameters() if ".attn2.to_k" in "." + n or ".attn2.to_v" in "." + n)
        total = sum(p.numel() for p in params)
        flops = 2.0 * tokens * (total - kv) + 2.0 * batch * CONTEXT_TOKENS * kv + quad
        kind = {0: "resnet", 1: "transformer", 2: "downsample", 3: "upsample"}[
            next(k for k, t in enumerate(types) if isinstance(mod, t))]
        units.append(Unit(name, nbytes, flops, int(torch.Size(shape).numel()), kind))
    return units


"""Z-Image LoRA names: the model's original module names (ComfyUI's, the published checkpoint's) as aliases of
diffusers' names, and a fused ``attention.qkv`` layer split onto ``to_q`` / ``to_k`` / ``to_v``.

The tables mirror diffusers (the reference; its converters are private, so they are mirrored, not called):
``convert_z_image_transformer_checkpoint_to_diffusers`` (``final_layer.`` = ``all_final_layer.2-1.``,
``x_embedder`` = ``all_x_embedder.2-1``, ``attention.out`` = ``attention.to_out.0``, ``attention.qkv`` = the rows of
``to_q``, ``to_k``, ``to_v`` stacked in that order) and ``_convert_non_diffusers_z_image_lora_to_diffusers`` (a fused
``qkv`` LoRA layer is one ``down`` shared by the three projections and its ``up`` cut in thirds; a fused ``qkv`` or a
bare ``out`` next to the split layers of the same block is a redundant copy of them).

Invariants
- A fused layer gives projection ``i`` exactly ``up[i*o:(i+1)*o] @ down`` (views, no copy), with the fused layer's
  scale: the rows of the fused weight that projection owns, so the sum over the three is the fused delta.
- A redundant copy is dropped only when it carries the same delta as the layer it duplicates (``same_delta``, on
  fixed random probes); otherwise the file is refused as inconsistent (``keymap.resolve``). Nothing is skipped on
  trust.
"""
from __future__ import annotations

import re
from dataclasses import replace
from typing import Iterable

import torch

from .formats import LoraLayer

# diffusers module-name fragment -> the original model's (one patch size, 2-1: the only one Z-Image ships)
ORIGINAL_NAMES = (("all_final_layer.2-1.", "final_layer."), ("all_x_embedder.2-1", "x_embedder"),
                  (".attention.to_out.0", ".attention.out"))
PROJECTIONS = ("to_q", "to_k", "to_v")
_FUSED = re.compile(r"(?P<block>.+?)(?P<sep>[._])attention(?P=sep)qkv")
_PROBES = 4
PROBE_RTOL = 1e-2  # files hold bf16 / fp16 factors; a true copy agrees to rounding, a different layer does not


def original_aliases(names: Iterable[str]) -> list[tuple[str, str]]:
    """``(original name, diffusers name)`` for every module name an ``ORIGINAL_NAMES`` fragment renames."""
    out = []
    for name in names:
        alias = name
        for diffusers_part, original_part in ORIGINAL_NAMES:
            alias = alias.replace(diffusers_part, original_part)
        if alias != name:
            out.append((alias, name))
    return out


def split_fused(layers: Iterable, source: str) -> tuple:
    """``layers`` with every fused ``<block>.attention.qkv`` layer of the denoiser replaced by its three
    projections (module docstring), in the layer's own spelling (``.`` or kohya's ``_``)."""
    out = []
    for layer in layers:
        m = _FUSED.fullmatch(layer.name) if layer.component == "unet" else None
        if m is None:
            out.append(layer)
            continue
        if not isinstance(layer, LoraLayer) or layer.magnitude is not None:
            kind = f"{layer.kind}{' with DoRA' if layer.magnitude is not None else ''}"
            raise ValueError(f"lora {source}: layer {layer.source} is a fused qkv {kind} layer, which cannot be "
                             f"split onto to_q/to_k/to_v (plain LoRA layers only); save the LoRA with split "
                             f"to_q/to_k/to_v layers")
        if layer.out_dim % len(PROJECTIONS):
            raise ValueError(f"lora {source}: the fused qkv layer {layer.source} has an up factor with "
                             f"{layer.out_dim} rows, not a multiple of 3 (to_q, to_k, to_v stacked); the file is "
                             f"corrupt or not a Z-Image LoRA")
        sep = m["sep"]
        for proj, up in zip(PROJECTIONS, layer.up.chunk(len(PROJECTIONS), dim=0)):
            out.append(replace(layer, name=f"{m['block']}{sep}attention{sep}{proj}", up=up))
    return tuple(out)


def same_delta(a, b) -> bool:
    """Whether two plain LoRA layers add the same ``scale * up @ down`` (to ``PROBE_RTOL`` of its size), compared
    on fixed random probe columns (cheap: rank-sized GEMMs, no dense delta)."""
    if not (isinstance(a, LoraLayer) and isinstance(b, LoraLayer)) or a.magnitude is not None \
            or b.magnitude is not None or a.down.shape[1:] != b.down.shape[1:] or a.out_dim != b.out_dim:
        return False
    gen = torch.Generator().manual_seed(0)
    probe = torch.randn(a.down[0].numel(), _PROBES, generator=gen, dtype=torch.float64)

    def apply(layer: LoraLayer) -> torch.Tensor:
        down = layer.down.flatten(1).to(torch.float64).cpu()
        return layer.scale * (layer.up.flatten(1).to(torch.float64).cpu() @ (down @ probe))

    da, db = apply(a), apply(b)
    size = max(da.abs().max().item(), db.abs().max().item())
    return (da - db).abs().max().item() <= PROBE_RTOL * size

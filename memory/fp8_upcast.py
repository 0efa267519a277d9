"""fp8 tensors of a split file (plain ``float8_e4m3fn`` and ComfyUI's "scaled fp8") -> ordinary floating tensors.

Invariant: an fp8 weight ``W`` with a per-tensor (or per-output-row) scale ``s`` stored beside it as
``<name>.scale_weight`` (ComfyUI's scaled fp8) or ``<name>.weight_scale`` means ``W.float() * s``, computed in fp32
and rounded once to the file's own precision: the widest floating dtype among its other tensors (bf16 when every
tensor is fp8). Without a scale the upcast is exact (every e4m3 value is a bf16 value). Scale and marker tensors
(``scaled_fp8``, input scales, ``comfy_quant``) are consumed here, so the result has the plain layout's keys.
"""
from __future__ import annotations

from typing import Mapping

import torch

FP8_DTYPES = tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                     "float8_e5m2fnuz") if hasattr(torch, name))
WEIGHT_SCALES = (".scale_weight", ".weight_scale")  # ComfyUI's scaled fp8; the compressed-tensors convention
CONSUMED = WEIGHT_SCALES + (".scale_input", ".input_scale", ".comfy_quant")
MARKERS = ("scaled_fp8",)
WIDTH = {torch.float16: 1, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}


def is_fp8(tensor: torch.Tensor) -> bool:
    return tensor.dtype in FP8_DTYPES


def _consumed(key: str) -> bool:
    return key.endswith(CONSUMED) or key.split(".")[-1] in MARKERS


def upcast_dtype(tensors: Mapping[str, torch.Tensor]) -> torch.dtype:
    """The file's own precision: its widest non-fp8 floating dtype (bf16 breaks ties with fp16), else bf16."""
    dtypes = {t.dtype for k, t in tensors.items() if t.dtype in WIDTH and not _consumed(k)}
    return max(dtypes, key=lambda d: (WIDTH[d], d == torch.bfloat16), default=torch.bfloat16)


def _scale_of(tensors: Mapping[str, torch.Tensor], key: str, weight: torch.Tensor, what: str):
    stem = key[:-len(".weight")] if key.endswith(".weight") else key
    for suffix in WEIGHT_SCALES:
        scale = tensors.get(stem + suffix)
        if scale is None:
            continue
        if scale.numel() == 1:
            return scale.float().reshape(())
        if weight.ndim and scale.numel() == weight.shape[0] and scale.squeeze().ndim == 1:  # one per output row
            return scale.float().reshape(-1, *([1] * (weight.ndim - 1)))
        raise ValueError(f"{what}: {stem + suffix} holds {scale.numel()} scales for a weight of shape "
                         f"{tuple(weight.shape)} (block-wise fp8 scaling), which this loader does not read; use "
                         f"the bf16 file or a per-tensor scaled fp8 one")
    return None


def upcast_fp8(tensors: Mapping[str, torch.Tensor], what: str) -> dict[str, torch.Tensor]:
    """``tensors`` with every fp8 tensor upcast (times its scale when one is stored) and scale/marker tensors
    dropped; a file without fp8 tensors comes back as a plain dict of the same tensors."""
    if not any(is_fp8(t) for t in tensors.values()):
        return {k: t for k, t in tensors.items() if not _consumed(k)}
    dtype = upcast_dtype(tensors)
    out = {}
    for key, tensor in tensors.items():
        if _consumed(key):
            continue
        if is_fp8(tensor):
            scale = _scale_of(tensors, key, tensor, what)
            tensor = (tensor.float() * scale if scale is not None else tensor.float()).to(dtype)
        out[key] = tensor
    return out

"""The VRAM policy names and the frozen configuration one ``apply_vram_policy`` call resolves (``memory/policies.py``)."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


class VramPolicy(str, Enum):
    AUTO = "auto"
    FULL = "full"
    BALANCED = "balanced"
    LOWVRAM = "lowvram"
    STREAM = "stream"


@dataclass(frozen=True)
class PolicyConfig:
    policy: VramPolicy  # resolved (never AUTO)
    requested: VramPolicy
    device: torch.device
    dtype: torch.dtype
    text_dtype: torch.dtype
    vae_dtype: torch.dtype
    budget_bytes: int
    working_shape: tuple


def dtype_name(dt: torch.dtype) -> str:
    """``torch.float16`` -> ``"fp16"`` (the names of ``DTYPES``); other dtypes as torch prints them."""
    return {v: k for k, v in DTYPES.items()}.get(dt, str(dt))

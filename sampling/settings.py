"""The Fused DDIM Sampler's settings: one frozen value, validated once at the public entry point.

Invariant: a ``SamplerSettings`` that passed ``validated()`` describes a run that can start (every number in its
range, every choice known); the errors name the argument, the bad value and the fix.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import Enum

from .ddim import SPACINGS
from .prompt_parser import SYNTAXES


class CfgMode(str, Enum):
    BATCHED = "batched"  # one UNet call on [uncond, cond]
    SEQUENTIAL = "sequential"  # two UNet calls of half the batch: lower peak memory


class Acceleration(str, Enum):
    NONE = "none"
    CUDA_GRAPH = "cuda_graph"
    COMPILE = "compile+cuda_graph"


CFG_MODES = tuple(m.value for m in CfgMode)
ACCELERATIONS = tuple(a.value for a in Acceleration)
MAX_SEED = 0xFFFFFFFFFFFFFFFF


def check_int(name: str, value, lo: int, hi: int, fix: str = "") -> int:
    """``value`` if it is an int (not a bool) in ``lo..hi``; else ``TypeError``/``ValueError`` naming ``name``, the
    value, the range and ``fix`` (a hint in parentheses, when given). Shared by both samplers' settings."""
    hint = f" ({fix})" if fix else ""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r}: expected an int{hint}")
    if not lo <= value <= hi:
        raise ValueError(f"{name}={value}: expected {lo}..{hi}{hint}")
    return value


def _float(name: str, value, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{name}={value!r}: expected a finite number")
    if not lo <= value <= hi:
        raise ValueError(f"{name}={value}: expected a number in {lo:g}..{hi:g}")
    return float(value)


@dataclass(frozen=True)
class SamplerSettings:
    """What one run of the Fused DDIM Sampler does (the node's inputs, minus the model and the latent)."""

    positive: str
    negative: str = ""
    seed: int = 0
    steps: int = 30
    cfg: float = 7.5
    eta: float = 0.0
    width: int = 512
    height: int = 512
    batch_size: int = 1
    timestep_spacing: str = "leading"
    cfg_mode: str = "batched"
    acceleration: str = "cuda_graph"
    denoise: float = 1.0
    # how the prompt strings are read: "extended" (ComfyUI's rules + [x] and BREAK) or "comfyui" (docs/prompts.md)
    prompt_syntax: str = "extended"

    @property
    def guided(self) -> bool:
        """Classifier-free guidance runs unless ``cfg == 1`` (where u + 1 (c - u) = c and the uncond pass is moot)."""
        return self.cfg != 1.0

    def validated(self) -> "SamplerSettings":
        for name in ("positive", "negative"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{name}: expected a prompt string, got {type(getattr(self, name)).__name__}")
        check_int("seed", self.seed, 0, MAX_SEED)
        check_int("steps", self.steps, 1, 1000)
        for name in ("width", "height"):
            value = check_int(name, getattr(self, name), 64, 8192)
            if value % 8:
                raise ValueError(f"{name}={value} is not a multiple of 8 (the VAE downsamples by 8); use "
                                 f"{value // 8 * 8} or {value // 8 * 8 + 8}")
        check_int("batch_size", self.batch_size, 1, 64)
        cfg = _float("cfg", self.cfg, 0.0, 30.0)
        eta = _float("eta", self.eta, 0.0, 1.0)
        denoise = _float("denoise", self.denoise, 0.0, 1.0)
        if int(self.steps * denoise) < 1:
            raise ValueError(f"steps * denoise = {self.steps} * {denoise:g} = {self.steps * denoise:g} leaves no step "
                             f"to run (int(steps * denoise) steps run); raise steps or denoise so the product is "
                             f"at least 1")
        if self.timestep_spacing not in SPACINGS:
            raise ValueError(f"timestep_spacing={self.timestep_spacing!r}: expected one of {SPACINGS}")
        if self.cfg_mode not in CFG_MODES:
            raise ValueError(f"cfg_mode={self.cfg_mode!r}: expected one of {CFG_MODES}")
        if self.acceleration not in ACCELERATIONS:
            raise ValueError(f"acceleration={self.acceleration!r}: expected one of {ACCELERATIONS}")
        if self.prompt_syntax not in SYNTAXES:
            raise ValueError(f"prompt_syntax={self.prompt_syntax!r}: expected one of {SYNTAXES}")
        return replace(self, cfg=cfg, eta=eta, denoise=denoise)

"""The samplers' settings: one frozen value per run, validated once at the public entry point.

Invariant: a settings value that passed ``validated()`` describes a run that can start (every number in its
range, every choice known); the errors name the argument, the bad value and the fix. ``SamplerSettingsBase``
holds the inputs both samplers share and their rules, so a value one sampler node accepts the other accepts too;
``SamplerSettings`` (the Fused DDIM Sampler) and ``stream.settings.StreamSettings`` extend it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import Enum

from .ddim import SPACINGS
from .prompt_parser import SYNTAXES


MAX_SIDE_PX = 8192  # the width/height widgets' limit, and the largest latent side (in pixels) the samplers take


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
    value, the range and ``fix`` (a hint in parentheses, when given)."""
    hint = f" ({fix})" if fix else ""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r}: expected an int{hint}")
    if not lo <= value <= hi:
        raise ValueError(f"{name}={value}: expected {lo}..{hi}{hint}")
    return value


def check_float(name: str, value, lo: float, hi: float) -> float:
    """``float(value)`` if it is a finite number (not a bool) in ``lo..hi``; else ``TypeError``/``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{name}={value!r}: expected a finite number")
    if not lo <= value <= hi:
        raise ValueError(f"{name}={value}: expected a number in {lo:g}..{hi:g}")
    return float(value)


def check_choice(name: str, value, choices: tuple) -> None:
    """``ValueError`` naming ``name`` and the known ``choices`` unless ``value`` is one of them."""
    if value not in choices:
        raise ValueError(f"{name}={value!r}: expected one of {choices}")


@dataclass(frozen=True, kw_only=True)
class SamplerSettingsBase:
    """The inputs both sampler nodes share (keyword-only, so each sampler's own first field stays positional)."""

    negative: str = ""
    seed: int = 0
    steps: int = 30
    cfg: float = 7.5
    width: int = 512
    height: int = 512
    timestep_spacing: str = "leading"
    acceleration: str = "cuda_graph"
    # how the prompt strings are read: "extended" (ComfyUI's rules + [x] and BREAK) or "comfyui" (docs/prompts.md)
    prompt_syntax: str = "extended"

    @property
    def guided(self) -> bool:
        """Classifier-free guidance runs unless ``cfg == 1`` (where u + 1 (c - u) = c and the uncond pass is moot)."""
        return self.cfg != 1.0

    def _validated_shared(self) -> float:
        """Check the shared inputs; return ``cfg`` as a float."""
        if not isinstance(self.negative, str):
            raise TypeError(f"negative: expected a prompt string, got {type(self.negative).__name__}")
        check_int("seed", self.seed, 0, MAX_SEED)
        check_int("steps", self.steps, 1, 1000)
        for name in ("width", "height"):
            value = check_int(name, getattr(self, name), 64, MAX_SIDE_PX)
            if value % 8:
                raise ValueError(f"{name}={value} is not a multiple of 8 (the VAE downsamples by 8); use "
                                 f"{value // 8 * 8} or {value // 8 * 8 + 8}")
        cfg = check_float("cfg", self.cfg, 0.0, 30.0)
        check_choice("timestep_spacing", self.timestep_spacing, SPACINGS)
        check_choice("acceleration", self.acceleration, ACCELERATIONS)
        check_choice("prompt_syntax", self.prompt_syntax, SYNTAXES)
        return cfg


@dataclass(frozen=True)
class SamplerSettings(SamplerSettingsBase):
    """What one run of the Fused DDIM Sampler does (the node's inputs, minus the model and the latent)."""

    positive: str
    eta: float = 0.0
    batch_size: int = 1
    cfg_mode: str = "batched"
    denoise: float = 1.0

    def validated(self) -> "SamplerSettings":
        if not isinstance(self.positive, str):
            raise TypeError(f"positive: expected a prompt string, got {type(self.positive).__name__}")
        cfg = self._validated_shared()
        check_int("batch_size", self.batch_size, 1, 64)
        eta = check_float("eta", self.eta, 0.0, 1.0)
        denoise = check_float("denoise", self.denoise, 0.0, 1.0)
        if int(self.steps * denoise) < 1:
            raise ValueError(f"steps * denoise = {self.steps} * {denoise:g} = {self.steps * denoise:g} leaves no step "
                             f"to run (int(steps * denoise) steps run); raise steps or denoise so the product is "
                             f"at least 1")
        check_choice("cfg_mode", self.cfg_mode, CFG_MODES)
        return replace(self, cfg=cfg, eta=eta, denoise=denoise)

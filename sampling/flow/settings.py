"""The Fused Flow Sampler's settings: one frozen value per run, validated once at the public entry point.

Invariant: a value that passed ``validated()`` describes a run that can start; errors name the input, the bad value
and the fix. ``cfg`` has ComfyUI's meaning (``u + cfg (c - u)``): ``cfg <= 1`` runs one model pass per step
without the negative prompt (diffusers' ``guidance_scale`` is ``cfg - 1``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..settings import ACCELERATIONS, MAX_SEED, MAX_SIDE_PX, check_choice, check_float, check_int

SIZE_MULTIPLE = 16  # VAE downsampling (8) x DiT patch (2)


def check_side(name: str, value: int) -> int:
    """``value`` if it is a multiple of ``SIZE_MULTIPLE``; else ``ValueError`` naming ``name`` and the two nearest."""
    if value % SIZE_MULTIPLE:
        low = value // SIZE_MULTIPLE * SIZE_MULTIPLE
        raise ValueError(f"{name}={value} is not a multiple of {SIZE_MULTIPLE} (the VAE downsamples by 8 and "
                         f"the DiT takes 2x2 patches); use {max(low, SIZE_MULTIPLE)} or {low + SIZE_MULTIPLE}")
    return value


@dataclass(frozen=True)
class FlowSettings:
    """What one run of the Fused Flow Sampler does (the node's inputs, minus the model and the latent)."""

    positive: str
    negative: str = ""
    seed: int = 0
    steps: int = 9
    cfg: float = 1.0
    width: int = 1024
    height: int = 1024
    batch_size: int = 1
    acceleration: str = "cuda_graph"
    denoise: float = 1.0

    @property
    def guided(self) -> bool:
        return self.cfg > 1.0

    def validated(self) -> "FlowSettings":
        for name in ("positive", "negative"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{name}: expected a prompt string, got {type(getattr(self, name)).__name__}")
        check_int("seed", self.seed, 0, MAX_SEED)
        check_int("steps", self.steps, 1, 1000)
        check_int("batch_size", self.batch_size, 1, 64)
        for name in ("width", "height"):
            check_side(name, check_int(name, getattr(self, name), SIZE_MULTIPLE, MAX_SIDE_PX))
        cfg = check_float("cfg", self.cfg, 0.0, 30.0)
        denoise = check_float("denoise", self.denoise, 0.0, 1.0)
        if denoise <= 0.0 or int(self.steps / denoise) < self.steps:
            raise ValueError(f"denoise={denoise:g}: expected a number in (0, 1]; 1.0 samples from pure noise")
        check_choice("acceleration", self.acceleration, ACCELERATIONS)
        return replace(self, cfg=cfg, denoise=denoise)

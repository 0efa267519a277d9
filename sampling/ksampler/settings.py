"""The Fused KSampler's settings: one frozen value per run, validated once at the public entry point.

Invariant: a value that passed ``validated()`` describes a run that can start, with ComfyUI's KSampler meaning for
every input (``cfg`` as ``u + cfg (c - u)`` with ComfyUI's cfg-1 shortcut; ``denoise`` as ``KSampler.set_steps``);
errors name the input, the bad value and the fix.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..settings import ACCELERATIONS, MAX_SEED, check_choice, check_float, check_int

# ComfyUI's names, in ComfyUI's list order (comfy.samplers.SAMPLER_NAMES / SCHEDULER_NAMES)
SAMPLER_NAMES = ("euler", "euler_ancestral", "heun", "dpm_2", "lms", "dpmpp_sde", "dpmpp_2m", "dpmpp_2m_sde",
                 "dpmpp_3m_sde", "lcm", "res_multistep", "ddim", "uni_pc")
SCHEDULER_NAMES = ("simple", "sgm_uniform", "karras", "exponential", "ddim_uniform", "beta", "normal")


@dataclass(frozen=True)
class KSamplerSettings:
    """What one run of the Fused KSampler does (the node's inputs, minus the model, the latent and CONDITIONING)."""

    seed: int = 0
    steps: int = 20
    cfg: float = 8.0
    sampler_name: str = "euler"
    scheduler: str = "simple"
    denoise: float = 1.0
    acceleration: str = "cuda_graph"
    positive_prompt: str = ""
    negative_prompt: str = ""

    @property
    def guided(self) -> bool:
        """ComfyUI skips the negative pass when cfg is 1 (``math.isclose``), whatever the prompts."""
        return not math.isclose(self.cfg, 1.0)

    def validated(self) -> "KSamplerSettings":
        check_int("seed", self.seed, 0, MAX_SEED)
        check_int("steps", self.steps, 1, 10000)
        cfg = check_float("cfg", self.cfg, 0.0, 100.0)
        denoise = check_float("denoise", self.denoise, 0.0, 1.0)
        if self.sampler_name not in SAMPLER_NAMES:
            raise ValueError(f"sampler_name={self.sampler_name!r}: the Fused KSampler runs {', '.join(SAMPLER_NAMES)}; "
                             f"pick one of them, or use ComfyUI's KSampler for this sampler")
        if self.scheduler not in SCHEDULER_NAMES:
            raise ValueError(f"scheduler={self.scheduler!r}: expected one of {', '.join(SCHEDULER_NAMES)}")
        check_choice("acceleration", self.acceleration, ACCELERATIONS)
        for name in ("positive_prompt", "negative_prompt"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{name}: expected a prompt string, got {type(getattr(self, name)).__name__}")
        return replace(self, cfg=cfg, denoise=denoise)

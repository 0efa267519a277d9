"""Refusing inputs that hold NaN or infinite values, naming the input, before any model runs on them.

Invariant: ``refuse_non_finite_inputs([(input_name, t), ...], fix)`` raises ``ValueError`` naming the first input
whose floating-point tensor holds NaN or an infinity, how many values are NaN / infinite, and the fix, exactly when
one does; ``refuse_non_finite_input(t, input_name, fix)`` is the same for one input. The common (finite) case costs
one reduction kernel per tensor and one host sync for all of them (``torchfile.any_non_finite``): a node checks the
tensors of one input (a CONDITIONING and its ``pooled_output``) together. ``bench/suite_finite.py`` measures what
the Fused DDIM Sampler's checks cost on the GPU against an SDXL step.

Why: a NaN in a LATENT, an IMAGE or a CONDITIONING spreads through every step and decodes to a black or noise
picture with no error; the user must learn which input carried it.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..torchfile import any_non_finite, has_non_finite


def refuse_non_finite_inputs(inputs: Sequence[tuple[str, torch.Tensor]], fix: str) -> None:
    """``ValueError`` naming the first of ``inputs`` (``(input_name, tensor)`` pairs) that holds NaN or infinite
    values (module docstring)."""
    if not any_non_finite([t for _, t in inputs]):
        return
    for input_name, t in inputs:
        if has_non_finite(t):
            nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
            raise ValueError(f"{input_name}: holds {nan} NaN and {inf} infinite values of {t.numel()}; they would "
                             f"turn the whole picture black or into noise: {fix}")


def refuse_non_finite_input(t: torch.Tensor, input_name: str, fix: str) -> None:
    """``ValueError`` when ``t`` holds NaN or infinite values (module docstring)."""
    refuse_non_finite_inputs([(input_name, t)], fix)

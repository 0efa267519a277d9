"""Refusing inputs that hold NaN or infinite values, naming the input, before any model runs on them.

Invariant: ``refuse_non_finite_input(t, input_name, fix)`` raises ``ValueError`` naming ``input_name``, how many
values are NaN / infinite and the fix, exactly when the floating-point ``t`` holds one; the common (finite) case
costs one reduction (``torchfile.has_non_finite``).

Why: a NaN in a LATENT, an IMAGE or a CONDITIONING spreads through every step and decodes to a black or noise
picture with no error; the user must learn which input carried it.
"""
from __future__ import annotations

import torch

from ..torchfile import has_non_finite


def refuse_non_finite_input(t: torch.Tensor, input_name: str, fix: str) -> None:
    """``ValueError`` when ``t`` holds NaN or infinite values (module docstring)."""
    if not has_non_finite(t):
        return
    nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
    raise ValueError(f"{input_name}: holds {nan} NaN and {inf} infinite values of {t.numel()}; they would turn the "
                     f"whole picture black or into noise: {fix}")

"""An independent fp8 reference for tests: a plain module whose Linear weights are replaced by their e4m3fn round
trip written in plain torch (``s = amax / 448``, ``round_e4m3fn(W / s) * s``), never through ``memory/fp8_weights``."""
from __future__ import annotations

import torch

E4M3_MAX = 448.0


def round_trip_e4m3(w: torch.Tensor) -> torch.Tensor:
    scale = w.abs().amax() / E4M3_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (w / scale).to(torch.float8_e4m3fn).float() * scale


@torch.no_grad()
def round_trip_linears(module: torch.nn.Module, types=(torch.nn.Linear,)) -> None:
    """Every module of exactly one of ``types`` gets its weight replaced by its e4m3fn round trip, in place."""
    for m in module.modules():
        if type(m) in types:
            m.weight.copy_(round_trip_e4m3(m.weight))


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` (L2, in float64)."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()

"""Tiny DiT-family models deep enough to stream, and engines over them under a budget that keeps some blocks
resident and streams the rest (the policy tests of Z-Image and Qwen-Image).

Invariant: ``replace_deeper`` builds its modules under a fixed seed and leaves the global RNG as it found it, so a
test's models do not depend on what ran before; ``partly_streamed_budget_gb`` is the working minimum plus ~a third
of the denoiser's weights, so under ``stream`` both the resident set and the streamed rest are non-empty.
"""
from __future__ import annotations

from typing import Callable

import torch

from ...memory.engine import LeanEngine, ModelParts
from ...memory.load import build_engine
from ...memory.plan import GiB, module_bytes
from ...memory.policies import stream_working_minimum_gb


def replace_deeper(comps: dict, seed: int, build: Callable[[], tuple]) -> dict:
    """``comps`` with ``transformer`` and ``text_encoder`` replaced by ``build()``'s pair, built under ``seed``
    (the global RNG restored after), in eval mode without gradients."""
    rng = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        dit, text = build()
    finally:
        torch.random.set_rng_state(rng)
    comps["transformer"] = dit.eval().requires_grad_(False)
    comps["text_encoder"] = text.eval().requires_grad_(False)
    return comps


def partly_streamed_budget_gb(parts: ModelParts, working_shape: tuple) -> float:
    """The working minimum plus ~a third of the denoiser's weights: some blocks resident, the rest streamed."""
    minimum = stream_working_minimum_gb(parts, "cpu", working_shape=working_shape)
    return minimum + 0.3 * module_bytes(parts.unet, torch.float32) / GiB


def engine_under(parts: ModelParts, policy: str, working_shape: tuple) -> LeanEngine:
    """A CPU engine over ``parts`` under ``policy`` with the ``partly_streamed_budget_gb`` budget."""
    return build_engine(parts, policy, partly_streamed_budget_gb(parts, working_shape), device="cpu",
                        working_shape=working_shape)

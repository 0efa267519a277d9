"""Tiny DiT-family models deep enough to stream, and engines over them under a budget that keeps some blocks
resident and streams the rest (the policy tests of Z-Image and Qwen-Image).

Invariant: ``replace_deeper`` builds its modules under a fixed seed and leaves the global RNG as it found it, so a
test's models do not depend on what ran before; ``partly_streamed_budget_gb`` is the working minimum plus ~a third
of the denoiser's weights, so under ``stream`` both the resident set and the streamed rest are non-empty;
``assert_refused_below_minimum`` and ``removed_to_plain`` are the refusal and teardown checks those tests share.
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


def assert_refused_below_minimum(parts: ModelParts, working_shape: tuple, text_tokens: int, monkeypatch) -> None:
    """``stream`` at 90% of the working minimum is refused (naming the text stage at ``text_tokens``) before any
    placement is made, the denoiser left on the host."""
    import pytest

    from ...memory import policies

    minimum = stream_working_minimum_gb(parts, "cpu", working_shape=working_shape)
    placed = []
    monkeypatch.setattr(policies, "ModelPlacement", lambda *a, **k: placed.append(a))
    with pytest.raises(ValueError, match=r"vram_budget_gb=[0-9.e-]+ is below the working minimum of [0-9.]+ GB .*"
                                         rf"'stream' .*text stage: staging .* at {text_tokens} tokens\); raise "
                                         r"vram_budget_gb"):
        build_engine(parts, "stream", minimum * 0.9, device="cpu", working_shape=working_shape)
    assert placed == []
    assert all(p.device.type == "cpu" for p in parts.unet.parameters())


def removed_to_plain(engine: LeanEngine) -> LeanEngine:
    """Remove ``engine``'s placement, check every denoiser and text weight is a plain host tensor again, and return a
    plain resident CPU engine over the same modules."""
    from ...memory.engine import engine_from_parts
    from ...memory.streaming import host_copy

    engine.placement.remove()
    for module in (engine.parts.unet, engine.parts.text_encoder):
        assert all(host_copy(p) is None and p.device.type == "cpu" for p in module.parameters())
    return engine_from_parts(engine.parts)

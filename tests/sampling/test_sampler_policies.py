"""The sampler under every VRAM policy of the Memory Pool Loader: same latent as ``full``, graphs included.

Guards the issue's "works under every VRAM policy, the stream policy included": on the CPU every policy's eager
latent equals ``full``'s and a repeated run takes every sampler buffer from the engine's pool (no new
allocation); on the GPU (``-m gpu``) the ``cuda_graph`` latent under each policy - ``stream`` with a budget that
really streams - is within 5e-3 relative of that policy's eager latent, and a second run replays without a
recapture. Skipped where the loader (``memory/load.py``) is not present.
"""
import pytest
import torch

load = pytest.importorskip("leandiffusion.memory.load")
policies_mod = pytest.importorskip("leandiffusion.memory.policies")
plan_mod = pytest.importorskip("leandiffusion.memory.plan")

from leandiffusion.sampling.graph_runner import GraphRunner  # noqa: E402
from leandiffusion.sampling.loop import sample  # noqa: E402
from leandiffusion.sampling.settings import SamplerSettings  # noqa: E402
from leandiffusion.tests.kit import tiny_parts  # noqa: E402

POLICIES = ["full", "balanced", "lowvram", "stream"]


def _engine(policy, device, dtype="auto"):
    parts = tiny_parts("sd1")
    budget = 4.0
    if policy == "stream":  # keep ~30% of the UNet's blocks resident: the rest streams
        budget = (policies_mod.stream_working_minimum_gb(parts, device)
                  + 0.3 * plan_mod.module_bytes(parts.unet, torch.float32) / plan_mod.GiB)
    return load.build_engine(parts, policy, budget, weight_dtype=dtype, device=device)


def _settings(**kw):
    base = dict(positive="a windmill", negative="fog", seed=21, steps=3, cfg=6.5, eta=0.4, width=64, height=64,
                acceleration="none")
    base.update(kw)
    return SamplerSettings(**base)


def test_every_policy_gives_full_latent_and_reuses_pool_buffers_cpu():
    ref = sample(_engine("full", "cpu"), _settings(), quiet=True)["samples"]
    for policy in POLICIES[1:]:
        engine = _engine(policy, "cpu")
        out = sample(engine, _settings(), quiet=True)["samples"]
        assert (out - ref).abs().max().item() <= 1e-5, policy
        allocated = engine.pool.stats().allocations
        sample(engine, _settings(seed=3), quiet=True)
        assert engine.pool.stats().allocations == allocated, f"{policy}: a repeated run allocated new buffers"


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("policy", POLICIES)
def test_gpu_cuda_graph_under_every_policy(policy):
    engine = _engine(policy, "cuda", "fp16")
    eager = sample(engine, _settings(), quiet=True)["samples"]
    runner = GraphRunner()
    fast = sample(engine, _settings(acceleration="cuda_graph"), runner=runner, quiet=True)["samples"]
    again = sample(engine, _settings(acceleration="cuda_graph", cfg=3.0), runner=runner, quiet=True)["samples"]
    assert runner.captures(engine) == 1
    assert _rel(fast, eager) <= 5e-3
    assert _rel(again, sample(engine, _settings(cfg=3.0), quiet=True)["samples"]) <= 5e-3

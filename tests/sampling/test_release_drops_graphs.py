"""ComfyUI frees a model (``ModelPlacement.release``, called by its memory manager or ``/free``): the model's
captured CUDA graphs go too.

Guards a leak: release moved the weights off the GPU and bumped the placement's epoch, so every cached graph of
the model was dead (its key names the old epoch and weight addresses; it is never replayed again), but the graphs
stayed cached with their static buffers and private memory pools (on an SDXL model up to two graphs of activations),
exactly when ComfyUI needed the memory. The next sampler run captures again and gives the same latent.
On the CPU a stand-in backend (``test_graph_runner.StandInBackend``) exercises the runner's cache.
"""
import pytest
import torch

from leandiffusion.memory.load import build_engine
from leandiffusion.sampling.graph_runner import GraphRunner
from leandiffusion.sampling.loop import sample
from leandiffusion.sampling.settings import SamplerSettings
from leandiffusion.tests.kit import tiny_parts

from .test_graph_runner import StandInBackend


@pytest.mark.parametrize("policy", ["full", "balanced", "stream"])
def test_release_drops_the_models_cached_graphs(policy):
    budget = 4.0
    if policy == "stream":
        from leandiffusion.memory import plan, policies
        parts = tiny_parts("sd1")
        budget = policies.stream_working_minimum_gb(parts, "cpu") + 0.3 * plan.module_bytes(parts.unet, torch.float32) / plan.GiB
    engine = build_engine(tiny_parts("sd1"), policy, budget, device="cpu")
    other = build_engine(tiny_parts("sd1"), "full", device="cpu")
    runner = GraphRunner(StandInBackend(), max_graphs=2)
    settings = SamplerSettings(positive="a boat", negative="rain", seed=4, steps=2, cfg=5.0, width=64, height=64,
                               acceleration="cuda_graph")
    first = sample(engine, settings, runner=runner, quiet=True)["samples"]
    sample(other, settings, runner=runner, quiet=True)
    assert len(runner.cached_keys(engine)) == 1
    engine.placement.release()
    assert runner.cached_keys(engine) == [], "released model still holds its (now unusable) CUDA graphs"
    assert len(runner.cached_keys(other)) == 1  # another model's graphs are not this release's business
    again = sample(engine, settings, runner=runner, quiet=True)["samples"]
    assert torch.equal(again, first) and len(runner.cached_keys(engine)) == 1  # captured again, same latent

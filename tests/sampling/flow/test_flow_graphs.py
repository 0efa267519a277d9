"""The flow step through the graph runner (a stand-in capture backend on the CPU): the first run captures, a
different prompt of the same caption bucket and another seed replay the same capture and give their own latent
(equal to an eager run), and a prompt of a larger bucket captures again."""
import torch

from leandiffusion.sampling.flow.loop import sample_flow
from leandiffusion.sampling.flow.settings import FlowSettings
from leandiffusion.sampling.graph_runner import GraphRunner
from leandiffusion.tests.kit.graph_backend import StandInBackend

LONG = "a very long prompt about a harbour at night with lanterns and boats and fog " * 4


def _run(engine, prompt, seed, runner=None, acceleration="cuda_graph", cfg=4.0):
    settings = FlowSettings(prompt, "bad", seed=seed, steps=2, cfg=cfg, width=32, height=48, batch_size=2,
                            acceleration=acceleration)
    return sample_flow(engine, settings, runner=runner)["samples"]


def test_one_capture_serves_every_prompt_of_a_bucket(zimage_engine):
    runner = GraphRunner(backend=StandInBackend(), max_graphs=4)
    for prompt, seed in (("a red cat", 1), ("two green birds on a wire", 2), ("a red cat", 3)):
        out = _run(zimage_engine, prompt, seed, runner)
        eager = _run(zimage_engine, prompt, seed, acceleration="none")
        assert torch.equal(out, eager)
    assert runner.captures(zimage_engine) == 1
    _run(zimage_engine, LONG, 1, runner)
    assert runner.captures(zimage_engine) == 2

"""The flow step through the graph runner (a stand-in capture backend on the CPU): the first run captures, a
different prompt of the same caption bucket and another seed replay the same capture and give their own latent
(equal to an eager run), and a prompt of a larger bucket captures again. A graph a budgeted stage dropped is not
captured again for the same key (the run steps eagerly, the same latent); another key still captures."""
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


def test_a_step_whose_graph_a_budget_stage_dropped_runs_eagerly(zimage_engine, caplog):
    """What ``memory.budget`` does when a text stage cannot fit beside the graph's pool: the runner drops the graph
    and remembers its key; the next run of that key would only capture to lose it again, so it steps eagerly."""
    runner = GraphRunner(backend=StandInBackend(), max_graphs=4)
    _run(zimage_engine, "a red cat", 1, runner)
    assert runner.captures(zimage_engine) == 1
    runner.release_device_memory(zimage_engine.parts)
    with caplog.at_level("INFO", logger="leandiffusion.sampling.dit_steps"):
        out = _run(zimage_engine, "a red cat", 2, runner)
    assert runner.captures(zimage_engine) == 0 and runner.cached_keys(zimage_engine) == []  # stepped eagerly
    assert torch.equal(out, _run(zimage_engine, "a red cat", 2, acceleration="none"))
    assert any("running the DiT steps eagerly" in r.getMessage() for r in caplog.records)
    _run(zimage_engine, LONG, 1, runner)  # another key (a larger caption bucket) captures and keeps its graph
    assert runner.captures(zimage_engine) == 1
    runner.clear(zimage_engine)  # an explicit clear forgets what was dropped
    _run(zimage_engine, "a red cat", 3, runner)
    assert runner.captures(zimage_engine) == 1 and len(runner.cached_keys(zimage_engine)) == 1


def test_a_dit_that_streams_its_blocks_steps_eagerly_under_cuda_graph():
    """Under ``stream`` with blocks left out, every step is bound by the weight copies: the sampler steps eagerly
    (nothing captured), with the eager latent."""
    from leandiffusion.memory.engine import parts_from_components
    from leandiffusion.memory.load import build_engine
    from leandiffusion.memory.policies import stream_working_minimum_gb
    from leandiffusion.memory.tiny_zimage import build_tiny_zimage

    parts = parts_from_components(build_tiny_zimage(0), name="tiny-zimage")
    budget = stream_working_minimum_gb(parts, "cpu", working_shape=(1, 8, 8)) * 1.01  # little besides the ring
    engine = build_engine(parts, "stream", budget, device="cpu", working_shape=(1, 8, 8))
    assert engine.placement.streamer is not None and engine.placement.streamer.schedule.streamed
    runner = GraphRunner(backend=StandInBackend(), max_graphs=4)
    out = _run(engine, "a red cat", 1, runner)
    assert runner.captures(engine) == 0
    assert torch.equal(out, _run(engine, "a red cat", 1, acceleration="none"))

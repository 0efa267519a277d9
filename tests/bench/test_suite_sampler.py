"""bench/suite_sampler.py: what each acceleration's ``peak_reserved_gb`` holds.

No GPU here: the tiny SD1 engine runs the peer loops on the CPU, and the CUDA-graph runner is replaced by a stand-in
whose "graphs" are the accelerations it has captured and not yet dropped (a captured graph keeps its private memory
pool reserved until the graph is dropped; ``torch.cuda.empty_cache`` cannot return it). The defect guarded: the
accelerations share one runner, and unless the ``cuda_graph`` graph is dropped before ``compile+cuda_graph``'s
first run, that run's ``max_memory_reserved`` begins with the other acceleration's pool.
"""
import contextlib

import torch

from leandiffusion.bench import suite_sampler


class FakeRunner:
    """The ``GraphRunner`` surface ``_case`` uses; ``live`` = the graphs (pools) currently held."""

    made = []

    def __init__(self):
        self.live = set()
        FakeRunner.made.append(self)

    def clear(self, engine=None):
        self.live.clear()


class FakeCtx:
    def __init__(self):
        self.device = torch.device("cpu")
        self.smoke, self.quick = False, False
        self.records = []

    def record(self, case, metric, ours, *args, **kwargs):
        self.records.append((case, metric, ours))

    def has_time(self, seconds):
        return True


def test_each_acceleration_peak_starts_without_another_accelerations_graph(monkeypatch):
    from leandiffusion.tests.kit import tiny_engine

    FakeRunner.made.clear()
    monkeypatch.setattr("leandiffusion.sampling.graph_runner.GraphRunner", FakeRunner)
    monkeypatch.setattr(suite_sampler, "time_ms", lambda fn, warmup=0, repeat=1, device=None: (fn(), 1.0)[1])

    def ours(engine, conditioning, x_init, schedule, acceleration, runner):
        def run():
            if "cuda_graph" in acceleration:
                runner.live.add(acceleration)  # its capture: the graph and its pool stay until dropped
            return x_init.clone()
        return run

    monkeypatch.setattr(suite_sampler, "ours_loop", ours)
    held_at_reset = {}

    @contextlib.contextmanager
    def peak_memory(device):
        runner = FakeRunner.made[-1]
        held_at_reset[len(held_at_reset)] = set(runner.live)  # what reset_peak_memory_stats would start from
        yield {"reserved_gb": 0.0, "allocated_gb": 0.0}

    monkeypatch.setattr(suite_sampler, "peak_memory", peak_memory)
    accelerations = ("none", "cuda_graph", "compile+cuda_graph")
    ctx = FakeCtx()
    suite_sampler._case(ctx, "tiny-sd1", tiny_engine("sd1"), 64, 1, accelerations, repeat=1)
    assert len(held_at_reset) == len(accelerations)
    # compile+cuda_graph's peak must not start with {"cuda_graph"} still held
    assert all(held == set() for held in held_at_reset.values()), held_at_reset
    timed = [case for case, metric, _ in ctx.records if metric == "loop_ms"]
    assert timed == [f"tiny-sd1-64/{acc}" for acc in accelerations]

"""What the budget-on-every-stage machinery costs a budgeted Stream Scheduler run.

The stream suite's budget cases (SD1.5 @ 3 GB, 4 prompts x 10 steps at 512 px; SDXL @ 4 GB, 2 x 10 at 1024 px),
each run timed (wall, synchronised) after a warm-up run, median of three, under variants that switch one piece off
for the measurement only: ``current``; ``no_stage_budget`` (the placement's per-stage cap and room-making,
``memory.budget.stage_budget``, replaced by a no-op); ``no_forget`` (captures keep cuBLAS's cached workspaces,
``graph_runner.forget_library_workspaces`` a no-op). Rounds alternate. Writes ``$OUT/budget_overheads.json``.
"""
import contextlib
import gc
import json
import os
import statistics
import time
from pathlib import Path

import torch

from leandiffusion.bench import suite_stream as SS
from leandiffusion.memory import budget, policies
from leandiffusion.sampling import graph_runner
from leandiffusion.sampling.stream.scheduler import run_stream
from leandiffusion.sampling.stream.settings import StreamSettings

OUT = Path(os.environ.get("OUT", "/tmp"))
dev = torch.device("cuda")
REAL = {"stage_budget": policies.stage_budget, "forget": graph_runner.forget_library_workspaces}


@contextlib.contextmanager
def no_stage_budget(placement, stage):
    yield budget.NO_CAP


def variant(name):
    policies.stage_budget = no_stage_budget if name == "no_stage_budget" else REAL["stage_budget"]
    graph_runner.forget_library_workspaces = (lambda device: False) if name == "no_forget" else REAL["forget"]


def timed_run(engine, settings):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    run_stream(engine, settings, quiet=True)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main():
    results = {}
    for kind, budget_gb, n, steps, size in (("sd15", 3.0, 4, 10, 512), ("sdxl", 4.0, 2, 10, 1024)):
        parts = SS._full_parts(kind, dev)
        engine = SS._engine(parts, dev, "stream", budget_gb)
        settings = StreamSettings.from_text(SS._prompts(n), negative=SS.NEGATIVE, seed=1000, steps=steps, cfg=SS.CFG,
                                            width=size, height=size, acceleration="cuda_graph", max_batch=0)
        times = {v: [] for v in ("current", "no_stage_budget", "no_forget")}
        try:
            run_stream(engine, settings, quiet=True)
            for _ in range(3):
                for v in times:
                    variant(v)
                    times[v].append(timed_run(engine, settings))
        finally:
            variant("current")
        row = {v: {"median_s": statistics.median(t), "runs_s": t} for v, t in times.items()}
        results[f"{kind}_{budget_gb:g}gb"] = row
        (OUT / "budget_overheads.json").write_text(json.dumps(results, indent=1))
        print(kind, budget_gb, {v: round(r["median_s"], 3) for v, r in row.items()}, flush=True)
        graph_runner.default_runner().clear(engine)
        engine.placement.remove()
        del engine, parts
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

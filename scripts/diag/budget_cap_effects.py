"""Does holding the UNet stage under the budget's allocator cap (``memory/budget.py``) change its kernels?

SDXL (full-size random fp16 weights) under the ``stream`` policy at 4 and 1.5 GB, with the per-stage cap on and off
(off: ``memory.budget.allocator_cap`` replaced by a no-op for the measurement; two alternating rounds on one
engine, every configuration capturing afresh): the Fused DDIM Sampler's time per
step (``none`` and ``cuda_graph``, 1024 px, slope between 4 and 10 steps), the peak reserved memory of a sampler run,
and a captured UNet call's relative difference from the eager call (what ``tests/memory/test_gpu_stream.py``
checks at 1e-3). Writes ``$OUT/budget_cap_effects.json``; prints a table.

Measured (H100, 2026-11-22, docs/bench/budget-s7/): CUDA-graph step at 4 GB capped 55.1 / 52.3 ms vs uncapped
52.1 / 50.2; at 1.5 GB 97.3 / 95.6 vs 103.5 / 95.4; eager steps spread 59-140 ms either way (host-bound weight
streaming); peaks equal; captured == eager (0.0) at 4 GB. So the cap does not change the UNet's kernels. (The
1.5 GB captured-vs-eager rows did not run: the raw ``torch.cuda.graph`` capture of the 4 GB rows' pattern left a
0.6 GB pool behind at 1.5 GB and the next capture ran out of memory under the cap; the graph runner's captures,
which the nodes use, release theirs -- see budget_node_paths.py.)
"""
import contextlib
import gc
import json
import os
import time
from pathlib import Path

import torch

from leandiffusion.bench import suite_stream as SS
from leandiffusion.bench.models import unet_inputs
from leandiffusion.memory import budget
from leandiffusion.nodes.sampler import LeanFusedDDIMSampler
from leandiffusion.sampling.graph_runner import default_runner

OUT = Path(os.environ.get("OUT", "/tmp"))
dev = torch.device("cuda")
G = 2 ** 30
REAL_CAP = budget.allocator_cap
results = {}


@contextlib.contextmanager
def no_cap(device, cap_bytes):
    yield False


def step_ms(engine, accel):
    sampler = LeanFusedDDIMSampler()
    kw = dict(positive="a photo of a cat", negative="blurry", seed=0, cfg=7.5, eta=0.0, width=1024, height=1024,
              batch_size=1, timestep_spacing="leading", cfg_mode="batched", acceleration=accel)
    sampler.run(engine, steps=4, **kw)

    def t(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        sampler.run(engine, steps=n, **kw)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    few = min(t(4) for _ in range(2))
    many = min(t(10) for _ in range(2))
    torch.cuda.reset_peak_memory_stats()
    sampler.run(engine, steps=4, **kw)
    return 1e3 * (many - few) / 6, torch.cuda.max_memory_reserved() / G


def capture_vs_eager(engine):
    inputs = unet_inputs("sdxl", batch=2, latent_hw=128, device="cuda", dtype=torch.float16)
    static = {k: (v.clone() if torch.is_tensor(v) else {kk: vv.clone() for kk, vv in v.items()})
              for k, v in inputs.items()}
    args = (static["sample"], static["timestep"], static["encoder_hidden_states"], static["added_cond_kwargs"])
    worst = 0.0
    with engine.session("unet"), torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                engine.unet(*args)
        torch.cuda.current_stream().wait_stream(side)
        from leandiffusion.memory.cap import forget_library_workspaces
        forget_library_workspaces(dev)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = engine.unet(*args)
        for seed in (1, 2):
            g = torch.Generator(device="cpu").manual_seed(seed)
            static["sample"].copy_(torch.randn(static["sample"].shape, generator=g).to("cuda", torch.float16))
            graph.replay()
            eager = engine.unet(*args)
            torch.cuda.synchronize()
            worst = max(worst, ((captured.float() - eager.float()).abs().max() / eager.float().abs().max()).item())
    del graph, captured
    from leandiffusion.memory.cap import release_library_workspaces
    release_library_workspaces(dev)  # the raw capture's workspace lives in its pool (memory/cap.py)
    return worst


def main():
    parts = SS._full_parts("sdxl", dev)
    for m in (parts.unet, parts.vae, parts.text_encoder, parts.text_encoder_2):
        m.to("cpu")
    for budget_gb in (4.0, 1.5):
        gc.collect()
        torch.cuda.empty_cache()
        engine = SS._engine(parts, dev, "stream", budget_gb)
        try:
            for rnd in range(2):  # alternating, fresh captures each time: order and clocks are not the cap
                for capped in (True, False):
                    budget.allocator_cap = REAL_CAP if capped else no_cap
                    row = {}
                    for accel in ("none", "cuda_graph"):
                        default_runner().clear(engine)
                        row[f"{accel}_step_ms"], row[f"{accel}_peak_reserved_gb"] = step_ms(engine, accel)
                    key = f"{budget_gb:g}gb_{'capped' if capped else 'uncapped'}_round{rnd}"
                    results[key] = row
                    (OUT / "budget_cap_effects.json").write_text(json.dumps(results, indent=1))
                    print(key, {k: round(v, 5) for k, v in row.items()}, flush=True)
            for capped in (True, False):  # last: a raw capture's pool may outlive it (not the runner's)
                budget.allocator_cap = REAL_CAP if capped else no_cap
                default_runner().clear(engine)
                results[f"{budget_gb:g}gb_{'capped' if capped else 'uncapped'}_capture_vs_eager_rel"] = \
                    capture_vs_eager(engine)
            (OUT / "budget_cap_effects.json").write_text(json.dumps(results, indent=1))
        finally:
            budget.allocator_cap = REAL_CAP
            default_runner().clear(engine)
            engine.placement.remove()
            del engine
            gc.collect()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

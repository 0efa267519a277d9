"""How the ``stream`` policy's SDXL step depends on its plan: headroom, activation estimate, arena size, budget.

SDXL UNet (full-size random fp16 weights), 128x128 latent, batch 2 (one CFG pair), the loader suite's bare UNet
call. Per configuration: the plan (streamed / resident / arena bytes, activation estimate), the eager step and the
CUDA-graph replay (median ms), the host time to enqueue one eager forward, peak ``max_memory_reserved`` while
placing + running eager and while capturing + replaying, and the graph output's difference from the ``full``
policy's output. Configurations: ``full`` (reference); ``stream`` at 4 GB with the shipped plan, with the headroom
(``policies.HEADROOM``) at 2% and 0%, with each staging-arena multiple forced (2 and 2.5 with 2% / 0% headroom too); ``stream`` at 4.25 / 4.5 / 5 GB
(step time against streamed bytes); ``stream`` at 1.5 and 2.5 GB shipped, at 2% headroom, with a 2x arena.

Usage: ``python scripts/diag/stream_plan_sweep.py [names,...]`` (default: all); writes ``$OUT/stream_plan_sweep.json``.
"""
import gc
import statistics
import sys
import time

import torch

from diag_timing import Recorder, graph_of

from leandiffusion.bench.models import full_unet, unet_inputs
from leandiffusion.bench.suite_loader import _parts_with
from leandiffusion.memory import policies, streaming
from leandiffusion.memory.policies import apply_vram_policy

dev = torch.device("cuda")
G = 2 ** 30
rec = Recorder("stream_plan_sweep.json")

CONFIGS = {
    "s4_default": dict(budget=4.0),
    "s4_head2": dict(budget=4.0, headroom=0.02),
    "s4_head0": dict(budget=4.0, headroom=0.0),
    "s4_arena3": dict(budget=4.0, arena=(3,)),
    "s4_arena4": dict(budget=4.0, arena=(4,)),
    "s4_arena6": dict(budget=4.0, arena=(6,)),
    "s4_arena8": dict(budget=4.0, arena=(8,)),
    "s4_arena12": dict(budget=4.0, arena=(12,)),
    "s4_head2_arena2": dict(budget=4.0, headroom=0.02, arena=(2,)),
    "s4_head2_arena2.5": dict(budget=4.0, headroom=0.02, arena=(2.5,)),
    "s4_head0_arena2": dict(budget=4.0, headroom=0.0, arena=(2,)),
    "s4_head0_arena2.5": dict(budget=4.0, headroom=0.0, arena=(2.5,)),
    "s4.25": dict(budget=4.25),
    "s4.5": dict(budget=4.5),
    "s5": dict(budget=5.0),
    "s1.5_default": dict(budget=1.5),
    "s1.5_head2": dict(budget=1.5, headroom=0.02),
    "s1.5_arena2": dict(budget=1.5, arena=(2,)),
    "s2.5_default": dict(budget=2.5),
    "s2.5_head2": dict(budget=2.5, headroom=0.02),
}


def median_ms(fn, n=7, warm=2):
    for _ in range(warm):
        fn()
    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def enqueue_ms(fn, n=5):
    """Host milliseconds to issue one forward (GPU idle at the start of each)."""
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    return statistics.median(times)


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def main():
    wanted = sys.argv[1].split(",") if len(sys.argv) > 1 else list(CONFIGS)
    unet = full_unet("sdxl", device=dev, dtype=torch.float16).to("cpu")
    torch.cuda.empty_cache()
    parts = _parts_with(unet)
    inputs = unet_inputs("sdxl", batch=2, latent_hw=128, device=dev, dtype=torch.float16)
    call = lambda: parts.unet(**inputs).sample  # noqa: E731
    with torch.no_grad():
        placement = apply_vram_policy(parts, "full", device=dev, dtype=torch.float16)
        ref = call().clone()
        eager = median_ms(call)
        host = enqueue_ms(call)
        graph, _ = graph_of(call)
        rec("full", {"eager_ms": round(eager, 2), "enqueue_ms": round(host, 2),
                     "graph_ms": round(median_ms(graph.replay, n=10), 2)})
        del graph
        placement.remove()
        gc.collect()
        torch.cuda.empty_cache()
        saved = (policies.HEADROOM, streaming.ARENA_MULTIPLES)
        for name in wanted:
            cfg = CONFIGS[name]
            policies.HEADROOM = cfg.get("headroom", saved[0])
            streaming.ARENA_MULTIPLES = cfg.get("arena", saved[1])
            placement = None
            try:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                placement = apply_vram_policy(parts, "stream", device=dev, dtype=torch.float16,
                                              vram_budget_gb=cfg["budget"])
                plan = placement.plan
                out = call().clone()
                eager = median_ms(call)
                host = enqueue_ms(call)
                torch.cuda.synchronize()
                peak_eager = torch.cuda.max_memory_reserved() / G
                torch.cuda.reset_peak_memory_stats()
                graph, gout = graph_of(call)
                gms = median_ms(graph.replay, n=10)
                graph.replay()
                torch.cuda.synchronize()
                row = {"budget_gb": cfg["budget"], "headroom": policies.HEADROOM,
                       "streamed_gb": round(plan.unet_streamed_bytes / G, 3),
                       "resident_gb": round((plan.unet_fixed_bytes + plan.unet_resident_bytes) / G, 3),
                       "arena_gb": round(plan.arena_bytes / G, 3), "act_est_gb": round(plan.unet_activation_bytes / G, 3),
                       "streamed_units": plan.streamed_units, "est_step_ms": round(plan.est_step_ms, 1),
                       "eager_ms": round(eager, 2), "enqueue_ms": round(host, 2), "graph_ms": round(gms, 2),
                       "peak_eager_gb": round(peak_eager, 3),
                       "peak_graph_gb": round(torch.cuda.max_memory_reserved() / G, 3),
                       "rel_eager_vs_full": rel(out, ref), "rel_graph_vs_full": rel(gout, ref)}
                rec(name, row)
                del graph, gout, out
            except Exception as exc:  # one failed configuration must not lose the others
                rec(name, {"error": f"{type(exc).__name__}: {exc}"[:500]})
            finally:
                if placement is not None:
                    placement.remove()
                torch._C._cuda_clearCublasWorkspaces()  # each raw capture's side stream got its own workspace
                policies.HEADROOM, streaming.ARENA_MULTIPLES = saved
                gc.collect()
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

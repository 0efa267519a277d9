"""Session-3 diag: where the stream sampler's reserved VRAM goes under the stream policy (per stage, per pool)."""
import json, os, gc, collections
import torch
from leandiffusion.bench import suite_stream as SS
from leandiffusion.sampling.stream.scheduler import run_stream
from leandiffusion.sampling.stream.settings import StreamSettings
OUT = os.environ.get("OUT", "/tmp")
dev = torch.device("cuda")
G = 2 ** 30
res = {}
def save(): json.dump(res, open(f"{OUT}/streamvram.json", "w"), indent=1)

def segs():
    by = collections.defaultdict(lambda: [0, 0, 0])
    for s in torch.cuda.memory_snapshot():
        k = f"stream{s.get('stream')}/pool{tuple(s.get('segment_pool_id', ()))}"
        by[k][0] += s["total_size"]; by[k][1] += s["allocated_size"]; by[k][2] += 1
    return {k: [round(v[0] / G, 3), round(v[1] / G, 3), v[2]] for k, v in by.items()}

def case(name, kind, budget, n, steps, size, max_batch=0):
    log = []
    gc.collect(); torch.cuda.empty_cache()
    parts = SS._full_parts(kind, dev)
    engine = SS._engine(parts, dev, "stream", budget)
    pl = engine.placement
    enter0, exit0 = pl.enter, pl.exit
    def enter(eng, stage):
        enter0(eng, stage); torch.cuda.synchronize()
        log.append(["enter", stage, round(torch.cuda.memory_allocated() / G, 3), round(torch.cuda.memory_reserved() / G, 3),
                    round(torch.cuda.max_memory_reserved() / G, 3)])
    def exit(eng, stage):
        torch.cuda.synchronize()
        log.append(["exit", stage, round(torch.cuda.memory_allocated() / G, 3), round(torch.cuda.memory_reserved() / G, 3),
                    round(torch.cuda.max_memory_reserved() / G, 3), round(torch.cuda.max_memory_allocated() / G, 3), segs()])
        exit0(eng, stage)
    pl.enter, pl.exit = enter, exit
    settings = StreamSettings.from_text(SS._prompts(n), negative=SS.NEGATIVE, seed=1000, steps=steps, cfg=SS.CFG,
                                        width=size, height=size, acceleration="cuda_graph", max_batch=max_batch)
    gc.collect(); torch.cuda.synchronize(); torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
    from leandiffusion.sampling.stream.scheduler import run_cap_bytes
    r = {"plan": str(pl.plan)[:3000], "before_reserved": torch.cuda.memory_reserved() / G, "before_alloc": torch.cuda.memory_allocated() / G,
         "cap": run_cap_bytes(engine) / G}
    try:
        result = run_stream(engine, settings, quiet=True)
        torch.cuda.synchronize()
        r["batches"] = list(result.batch_sizes)
    except Exception as e:
        r["error"] = repr(e)[:500]
    r["peak_reserved"] = torch.cuda.max_memory_reserved() / G
    r["peak_alloc"] = torch.cuda.max_memory_allocated() / G
    r["end_segs"] = segs()
    r["log"] = log
    r["measured"] = {k: [v[0] / G, v[1]] for k, v in getattr(pl, "measured", {}).items()}
    res[name] = r; save()
    print(name, "cap", round(r["cap"], 3), "before_alloc", round(r["before_alloc"], 3), "peak_reserved", round(r["peak_reserved"], 3), "peak_alloc", round(r["peak_alloc"], 3), r.get("batches"), r.get("error"), flush=True)
    from leandiffusion.sampling.graph_runner import default_runner
    default_runner().clear(engine)
    del engine, parts
    if hasattr(pl, "remove"): pl.remove()
    gc.collect(); torch.cuda.empty_cache()

case("sd15_3gb", "sd15", 3.0, 4, 10, 512)
case("sdxl_4gb", "sdxl", 4.0, 2, 10, 1024)
case("sdxl_4gb_b1", "sdxl", 4.0, 2, 10, 1024, max_batch=1)

"""Peak VRAM of every node path on an engine built under the loader's ``stream`` policy (SDXL, full-size random
weights): does each node keep the budget the user gave the loader, or only the Stream Scheduler (the one path that
caps the caching allocator, ``memory.cap``)?

Per budget (4 and 1.5 GB) and node call -- the Fused DDIM Sampler (``none`` and ``cuda_graph``, 1024 px, 2 steps,
prompts encoded inside), the Tiled VAE Decode (auto tile) of its latent, the Tiled VAE Encode of that image, the
sampler again (its graph dropped for the VAE: it recaptures), and a one-prompt Stream Scheduler run -- the peak
reserved and allocated memory of the process during the call (peaks reset before it; CUDA context outside), and
per engine stage the peaks at the stage's exit. Before ``memory/budget.py`` (same script, H100, 2026-11-22): the
decode held 11.5 GB at 4 GB and 9.2 GB at 1.5 GB, the encode 7.6 / 5.2 GB; the sampler 3.59 / 1.22 GB. Optional argument
``comfyui=PATH`` also runs the benchmark's ``--comfyui`` low-VRAM case alone in this process (ComfyUI's partial
loading at 4 / 1.5 GiB, then our stream engine through the sampler node), to compare with the number the session-2
full run recorded after the suite's other ComfyUI cases (1.88 GB reserved at 1.5 GiB).

Writes ``$OUT/budget_node_paths.json``; prints one line per call.
"""
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

from leandiffusion.bench import suite_stream as SS
from leandiffusion.nodes.sampler import LeanFusedDDIMSampler
from leandiffusion.nodes.stream import LeanStreamSampler
from leandiffusion.nodes.vae import LeanTiledVAEDecode, LeanTiledVAEEncode

OUT = Path(os.environ.get("OUT", "/tmp"))
dev = torch.device("cuda")
G = 2 ** 30
results = {}


def save():
    (OUT / "budget_node_paths.json").write_text(json.dumps(results, indent=1))


def stage_logger(engine, log):
    pl = engine.placement
    enter0, exit0 = pl.enter, pl.exit

    def enter(eng, stage):
        enter0(eng, stage)

    def exit(eng, stage):
        torch.cuda.synchronize()
        log.append({"stage": stage, "alloc": torch.cuda.memory_allocated() / G,
                    "peak_reserved": torch.cuda.max_memory_reserved() / G,
                    "peak_alloc": torch.cuda.max_memory_allocated() / G})
        exit0(eng, stage)

    pl.enter, pl.exit = enter, exit


def measure(name, fn):
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = (torch.cuda.memory_allocated() / G, torch.cuda.memory_reserved() / G)
    err = None
    out = None
    t0 = time.perf_counter()
    try:
        out = fn()
        torch.cuda.synchronize()
    except Exception as exc:  # recorded, the next call goes on
        err = repr(exc)[:400]
    r = {"seconds": time.perf_counter() - t0, "before_alloc": before[0], "before_reserved": before[1],
         "peak_reserved": torch.cuda.max_memory_reserved() / G, "peak_alloc": torch.cuda.max_memory_allocated() / G,
         "stages": [dict(e) for e in CURRENT_LOG], "error": err}
    CURRENT_LOG.clear()
    print(f"{name:40s} before {before[0]:.3f}/{before[1]:.3f}  peak reserved {r['peak_reserved']:.3f} "
          f"alloc {r['peak_alloc']:.3f}  {r['seconds']:.2f} s  {'ERR ' + err if err else ''}", flush=True)
    return r, out


CURRENT_LOG = []


def calls(engine, budget, res):
    sampler, dec, enc, stream = LeanFusedDDIMSampler(), LeanTiledVAEDecode(), LeanTiledVAEEncode(), LeanStreamSampler()
    kw = dict(positive="a photo of a cat", negative="blurry", seed=0, steps=2, cfg=7.5, eta=0.0, width=1024,
              height=1024, batch_size=1, timestep_spacing="leading", cfg_mode="batched")
    latent = None
    for key, accel in (("sampler_none", "none"), ("sampler_cuda_graph", "cuda_graph"),
                       ("sampler_cuda_graph_warm", "cuda_graph")):
        res[key], out = measure(f"{budget}GB {key}", lambda: sampler.run(engine, acceleration=accel, **kw)[0])
        latent = out if out is not None else latent
    image = None
    if latent is not None:
        res["vae_decode"], image = measure(f"{budget}GB vae_decode", lambda: dec.decode(latent, lean_model=engine)[0])
    if image is not None:
        res["vae_encode"], _ = measure(f"{budget}GB vae_encode", lambda: enc.encode(image, lean_model=engine)[0])
    res["sampler_after_vae"], _ = measure(f"{budget}GB sampler_after_vae (recaptures)",
                                          lambda: sampler.run(engine, acceleration="cuda_graph", **kw)[0])
    res["stream_1x2"], _ = measure(f"{budget}GB stream 1 prompt", lambda: stream.run(
        engine, "a photo of a cat", "blurry", 0, 2, 7.5, 1024, 1024, "leading", "cuda_graph", 1, 0, 0))


def case(budget):
    gc.collect()
    torch.cuda.empty_cache()
    parts = SS._full_parts("sdxl", dev)
    engine = SS._engine(parts, dev, "stream", budget)
    stage_logger(engine, CURRENT_LOG)
    res = {"plan": str(engine.placement.plan)[:3000]}
    calls(engine, budget, res)
    results[f"sdxl_stream_{budget:g}gb"] = res
    save()
    from leandiffusion.sampling.graph_runner import default_runner
    default_runner().clear(engine)
    pl = engine.placement
    del engine, parts
    if hasattr(pl, "remove"):
        pl.remove()
    gc.collect()
    torch.cuda.empty_cache()


def comfy_lowvram(path):
    from leandiffusion.bench.harness import BenchContext
    from leandiffusion.bench.suite_comfyui import Comfy, case_lowvram

    ctx = BenchContext("comfyui", OUT / "bench_comfyui", comfyui=Path(path))
    comfy = Comfy(ctx.comfyui, cpu=False)
    case_lowvram(ctx, comfy)
    results["comfyui_lowvram"] = [{"case": r.case, "metric": r.metric, "ours": r.ours, "peer": r.peer}
                                  for r in ctx.records]
    for r in ctx.records:
        print("comfyui", r.case, r.metric, r.ours, r.peer, flush=True)
    save()


if __name__ == "__main__":
    for b in (4.0, 1.5):
        case(b)
    for arg in sys.argv[1:]:
        if arg.startswith("comfyui="):
            comfy_lowvram(arg.split("=", 1)[1])

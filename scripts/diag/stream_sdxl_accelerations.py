"""Session-4 diag: SDXL stream 8x30 vs prompt-by-prompt, cuda_graph and compile+cuda_graph, same run."""
import json, os, time
import torch
from leandiffusion.bench import suite_stream as SS
from leandiffusion.sampling.stream.scheduler import run_stream
from leandiffusion.sampling.stream.settings import StreamSettings
from leandiffusion.sampling.stream.streams import Timeline
OUT = os.environ.get("OUT", "/tmp"); dev = torch.device("cuda")
res = {}
def rec(k, v):
    res[k] = v; print(k, v, flush=True); json.dump(res, open(f"{OUT}/s5.json", "w"), indent=1)
parts = SS._full_parts("sdxl", dev); eng = SS._engine(parts, dev)
def st(acc, mb=0): return StreamSettings.from_text(SS._prompts(8), negative=SS.NEGATIVE, seed=1000, steps=30, cfg=SS.CFG,
                                                   width=1024, height=1024, acceleration=acc, max_batch=mb)
for acc in ("compile+cuda_graph", "cuda_graph"):
    t0 = time.perf_counter(); SS._fused_one_by_one(eng, st(acc), limit=1); rec(f"{acc}_peer_first_s", time.perf_counter() - t0)
    t0 = time.perf_counter(); first = run_stream(eng, st(acc), quiet=True); rec(f"{acc}_ours_first_s", time.perf_counter() - t0)
    peer = SS._seconds(lambda: SS._fused_one_by_one(eng, st(acc)), dev, 1)
    tl = Timeline()
    ours = SS._seconds(lambda: run_stream(eng, st(acc), quiet=True, timeline=tl), dev, 1)
    peer2 = SS._seconds(lambda: SS._fused_one_by_one(eng, st(acc)), dev, 1)
    ours2 = SS._seconds(lambda: run_stream(eng, st(acc), quiet=True), dev, 1)
    summ = SS._timeline_summary(tl.to_list())
    rec(acc, {"peer_s": [peer, peer2], "ours_s": [ours, ours2], "ratio_min_peer_median": min(peer, peer2) / ((ours + ours2) / 2),
              "ratios": [peer / ours, peer2 / ours2], "batches": list(first.batch_sizes), "tl": {k: round(v, 1) for k, v in summ.items()}})

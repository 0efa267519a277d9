"""The SDXL UNet step with diffusers' GEGLU and with the engine's one-pass GEGLU (``memory.fast_unet``), eager and
replayed from a CUDA graph, interleaved rounds (session 24). Batch 2 (one CFG pair), 1024 px, fp16, random weights.
Usage (device machine, pack importable): python scripts/diag/fused_geglu_step.py; writes $OUT/fused_geglu_step.json.
"""
import contextlib
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from diag_timing import Recorder, graph_of, timed  # noqa: E402
from leandiffusion.bench.models import full_unet, unet_inputs  # noqa: E402
from leandiffusion.memory.fast_unet import fast_unet  # noqa: E402

rec = Recorder("fused_geglu_step.json")


@torch.no_grad()
def main():
    dev = torch.device("cuda")
    unet = full_unet("sdxl", device=dev)
    inp = unet_inputs("sdxl", 2, 128, device=dev)
    ways = {"diffusers": contextlib.nullcontext, "fused": lambda: fast_unet(unet)}
    outs, graphs = {}, {}
    for name, ctx in ways.items():
        with ctx():
            outs[name] = unet(**inp, return_dict=False)[0].clone()
            graphs[name] = graph_of(lambda: unet(**inp, return_dict=False)[0])
    rec("max_abs_diff_fused_vs_diffusers", (outs["fused"].float() - outs["diffusers"].float()).abs().max().item())
    rec("out_absmax", outs["diffusers"].abs().max().item())
    eager, graph = {k: [] for k in ways}, {k: [] for k in ways}
    for _ in range(5):
        for name, ctx in ways.items():
            with ctx():
                eager[name].append(timed(lambda: unet(**inp, return_dict=False), 5))
            graph[name].append(timed(graphs[name][0].replay, 10))
    for name in ways:
        rec(f"eager_ms_{name}", round(statistics.median(eager[name]), 2))
        rec(f"graph_ms_{name}", round(statistics.median(graph[name]), 2))


if __name__ == "__main__":
    main()

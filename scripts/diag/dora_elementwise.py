"""What the per-channel DoRA rescale costs on the GPU next to a plain copy, at SDXL's activation shapes (fp16).

A probe, not pack code: for each [tokens, channels] shape of an SDXL 1024 px UNet call (CFG batch 2) times, in a
CUDA graph of 50 launches, ``x.clone()`` (the bandwidth yardstick), ``torch.addcmul(x, x, v)`` (the input-axis
rescale) and ``torch.addcmul(b, y, c, out=y)`` (the output-axis one), v/c/b per-channel vectors. Usage (device):
python scripts/diag/dora_elementwise.py; writes $OUT/dora_elementwise.json.
"""
import json
import os

import torch

from diag_timing import timed

dev = torch.device("cuda")
OUT = os.environ.get("OUT", "/tmp")
res = {"device": torch.cuda.get_device_name()}
for m, n in ((2048, 1280), (2048, 5120), (2048, 10240), (8192, 640), (8192, 2560), (8192, 5120)):
    x = torch.randn(m, n, device=dev, dtype=torch.float16)
    v = torch.randn(n, device=dev, dtype=torch.float16)
    y = torch.empty_like(x)

    def graph_of(fn):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(50):
                fn()
        return g

    row = {}
    for name, fn in (("clone", lambda: y.copy_(x)), ("addcmul_in", lambda: torch.addcmul(x, x, v, out=y)),
                     ("addcmul_out", lambda: torch.addcmul(v, x, v, out=y)), ("mul", lambda: torch.mul(x, v, out=y))):
        g = graph_of(fn)
        ms = min(timed(g.replay, 5) for _ in range(3)) / 50
        row[name + "_us"] = round(ms * 1000, 1)
    row["clone_GBps"] = round(2 * x.nbytes / (row["clone_us"] * 1e-6) / 1e9)
    res[f"{m}x{n}"] = row
    print(m, n, row, flush=True)
json.dump(res, open(f"{OUT}/dora_elementwise.json", "w"), indent=1)

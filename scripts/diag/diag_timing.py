"""Timing helpers shared by the device diagnostics in this folder (each script runs as ``python scripts/diag/x.py``,
so this module is importable beside it).

``timed(fn, n)``: mean milliseconds of ``n`` back-to-back calls, synchronised before and after (host clock).
``graph_of(fn, warm)``: ``fn`` warmed up ``warm`` times on a side stream, then captured into a CUDA graph;
returns ``(graph, output)`` where ``output`` is the captured call's result (static: each replay rewrites it).
``Recorder(name)``: ``rec(key, value)`` prints a result and rewrites ``$OUT/name`` (JSON) with all results so far.
``kernel_breakdown(fn, family, top)``: GPU milliseconds of one ``fn()`` call per kernel family and per kernel name;
``kernel_table(fn)``: calls and GPU microseconds per kernel name.
"""
import json
import os
import time

import torch


def timed(fn, n=10):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1000


def graph_of(fn, warm=2):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warm):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


class Recorder:
    def __init__(self, name: str):
        self.path = os.path.join(os.environ.get("OUT", "/tmp"), name)
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        self.results = {"device": device, "torch": torch.__version__}

    def __call__(self, key, value):
        self.results[key] = value
        print(key, json.dumps(value)[:2500], flush=True)
        with open(self.path, "w") as f:
            json.dump(self.results, f, indent=1)


def kernel_table(fn):
    """``{kernel name: (calls, GPU microseconds)}`` of one ``fn()`` call after a warm-up call (torch profiler; CPU-side
    ``aten::`` rows left out)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    table = {}
    for evt in prof.key_averages():
        t = getattr(evt, "device_time_total", 0) or 0
        if t <= 0 or evt.key.startswith("aten::"):
            continue
        calls, us = table.get(evt.key, (0, 0.0))
        table[evt.key] = (calls + evt.count, us + t)
    return table


def kernel_breakdown(fn, family, top=14):
    """(ms per family, ms of the ``top`` kernels) for one ``fn()`` call after a warm-up call; ``family(name)``
    maps a kernel name to its family."""
    fams, kernels = {}, {}
    for key, (_, us) in kernel_table(fn).items():
        fams[family(key)] = fams.get(family(key), 0) + us / 1000
        kernels[key[:100]] = kernels.get(key[:100], 0) + us / 1000
    by_time = lambda d: {k: round(v, 2) for k, v in sorted(d.items(), key=lambda kv: -kv[1])}  # noqa: E731
    return by_time(fams), dict(list(by_time(kernels).items())[:top])

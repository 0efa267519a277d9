"""Timing helpers shared by the device diagnostics in this folder (each script runs as ``python scripts/diag/x.py``,
so this module is importable beside it).

``timed(fn, n)``: mean milliseconds of ``n`` back-to-back calls, synchronised before and after (host clock).
``graph_of(fn, warm)``: ``fn`` warmed up ``warm`` times on a side stream, then captured into a CUDA graph;
returns ``(graph, output)`` where ``output`` is the captured call's result (static: each replay rewrites it).
"""
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

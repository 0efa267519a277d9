"""Where the Stream Scheduler's SDXL run spends host time outside its GPU stages (issue 10's SDXL line).

A probe, not pack code. The bench's SDXL case (8 prompts x 30 steps, one batch of 8) measures ~8610 ms of wall
time; its GPU stages (UNet ~8010, decode ~505, text ~2 ms) account for all but ~60-90 ms. cProfile inflates the
Python-heavy calls too much to say where the rest goes, so this script wraps the scheduler's pieces (the module
names ``run_stream`` calls, the text and decode stages' methods) with host timestamps (no extra synchronisation)
and records, for one warmed-up run, when each call started and how long it took on the host, relative to the
run's start. Host time before the first UNet step is enqueued and after the last decode's event has completed
is time the GPU waits for the host. Usage (device, pack importable): ``python scripts/diag/stream_sdxl_host.py``;
writes ``$OUT/stream_sdxl_host.json``.
"""
import functools
import time

import torch

from diag_timing import Recorder
from leandiffusion.bench import suite_stream as SS
from leandiffusion.sampling.stream import decode as D
from leandiffusion.sampling.stream import scheduler as S
from leandiffusion.sampling.stream import text as T
from leandiffusion.sampling.stream.settings import StreamSettings

dev = torch.device("cuda")
rec = Recorder("stream_sdxl_host.json")
EVENTS = []
T0 = [0.0]


def wrapped(name, fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            EVENTS.append((name, round((t - T0[0]) * 1000, 2), round((time.perf_counter() - t) * 1000, 2)))
    return call


def instrument():
    for name in ("read_conditioning_inputs", "needs_tiles", "choose_batch", "initial_noise", "upload", "denoise_batch",
                 "available_bytes", "default_runner"):
        setattr(S, name, wrapped(name, getattr(S, name)))
    for cls, names in ((T.TextStage, ("prepare", "release_before")),
                       (D.DecodeStage, ("submit", "launch", "finish", "drain", "_untiled"))):
        for name in names:
            setattr(cls, name, wrapped(f"{cls.__name__}.{name}", getattr(cls, name)))
    D.DecodeStage.__init__ = wrapped("DecodeStage.__init__", D.DecodeStage.__init__)
    T.TextStage.__init__ = wrapped("TextStage.__init__", T.TextStage.__init__)


def main():
    engine = SS._engine(SS._full_parts("sdxl", dev), dev)
    settings = StreamSettings.from_text(SS._prompts(8), negative=SS.NEGATIVE, seed=1000, steps=30, cfg=SS.CFG,
                                        width=1024, height=1024, acceleration="cuda_graph", max_batch=0)
    S.run_stream(engine, settings, quiet=True)
    instrument()
    for rnd in range(3):
        EVENTS.clear()
        torch.cuda.synchronize()
        T0[0] = time.perf_counter()
        S.run_stream(engine, settings, quiet=True)
        torch.cuda.synchronize()
        total = (time.perf_counter() - T0[0]) * 1000
        rec(f"run{rnd}", {"wall_ms": round(total, 1), "events": sorted(EVENTS, key=lambda e: e[1])})


if __name__ == "__main__":
    main()

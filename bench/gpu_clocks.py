"""The GPU's SM clock and board power while a block of benchmark work runs, sampled by ``nvidia-smi``.

Why a benchmark needs it: a GPU lowers its SM clock when a workload draws more than its power limit allows. A
batch of eight SDXL images draws more than one image does, so the two can run at different clocks, and a
throughput ratio between them includes that. Recording the clocks next to the ratio keeps the report honest about where the time went.

``clock_sampler(device)`` yields a dict that, on exit, holds the means (and the SM clock's minimum) of the samples
taken during the block, or stays empty where there is nothing to sample (no CUDA device, no ``nvidia-smi``, or a
sampler that produced no line). It only reads (``--query-gpu``); it never changes a clock or a limit. Why the CLI
and not ``torch.cuda.clock_rate()`` / ``power_draw()``: those read one instant through ``pynvml``, an optional
package the pack does not require, while ``nvidia-smi -lms`` ships with the driver and samples the whole block.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from typing import Iterator, Optional

import torch

FIELDS = ("clocks.sm", "power.draw", "power.limit")
INTERVAL_MS = 100


def parse_samples(text: str) -> list[tuple[float, float, float]]:
    """``nvidia-smi --format=csv,noheader,nounits`` lines of ``FIELDS`` -> (sm_mhz, power_w, limit_w) tuples.

    Lines that do not hold three numbers ("[N/A]", a partial last line) are skipped."""
    out = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != len(FIELDS):
            continue
        try:
            out.append(tuple(float(p) for p in parts))
        except ValueError:
            continue
    return out


def summarize(samples: list[tuple[float, float, float]]) -> dict:
    """Means of the samples (SM clock also its minimum); empty when there are none."""
    if not samples:
        return {}
    n = len(samples)
    return {"sm_mhz": sum(s[0] for s in samples) / n, "sm_mhz_min": min(s[0] for s in samples),
            "power_w": sum(s[1] for s in samples) / n, "power_limit_w": max(s[2] for s in samples), "samples": n}


def smi_index(device: torch.device) -> Optional[str]:
    """``nvidia-smi``'s index of a CUDA device (through ``CUDA_VISIBLE_DEVICES`` when it lists indices)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if index < len(ids):
            return ids[index]  # an index or a UUID: nvidia-smi -i takes either
    return str(index)


@contextlib.contextmanager
def clock_sampler(device: torch.device, interval_ms: int = INTERVAL_MS) -> Iterator[dict]:
    """Samples ``device`` every ``interval_ms`` during the block; the yielded dict is filled on exit (see above)."""
    out: dict = {}
    index = smi_index(device)
    smi = shutil.which("nvidia-smi")
    if index is None or smi is None:
        yield out
        return
    with tempfile.TemporaryFile("w+") as log:
        try:
            proc = subprocess.Popen([smi, "-i", index, f"--query-gpu={','.join(FIELDS)}",
                                     "--format=csv,noheader,nounits", "-lms", str(interval_ms)],
                                    stdout=log, stderr=subprocess.DEVNULL)
        except OSError:
            yield out
            return
        try:
            yield out
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.seek(0)
            out.update(summarize(parse_samples(log.read())))

"""Benchmark harness contract: every suite records measurements through one ``BenchContext``.

A suite is a module ``bench/suite_<name>.py`` with ``SUITE = "<name>"`` and ``run(ctx: BenchContext) -> None``.
It measures its case(s) and its peers *in the same process*, then calls ``ctx.record(...)`` once per metric.

Modes: ``ctx.smoke`` (CPU, tiny models: checks the suite's plumbing and record shapes, numbers mean nothing),
``ctx.quick`` (GPU, fits one 10-minute device call together with the other suites), full (GPU, every case).

Time budget: the CLI (``python -m leandiffusion.bench``) runs each suite in its own process under a time budget
(``ctx.time_budget_s``, soft; the process is killed at ``ctx.deadline()`` plus a small grace). A suite checks
``ctx.has_time(seconds)`` before each expensive case and calls ``ctx.skip(case, reason)`` for what it leaves out,
so a short budget yields fewer records rather than a killed process. Every record is flushed to the suite's result
file as soon as it is made (``sink``), so the records measured before a crash or a kill survive.

Extra files (a profiler trace, say): write them to ``ctx.artifact_path(name)``. The device tool returns at most 8
files per call, and the report itself writes 5 (bench.json, BENCHMARKS.md, bench.log, time.png, vram.png), so at
most one small artifact per suite, and only in full mode.

Timing rules: warm up first; time GPU work with CUDA events; take the median of several repeats; memory is
``torch.cuda.max_memory_reserved()`` after ``reset_peak_memory_stats()`` (the CUDA context is excluded by
construction, since it is not allocator memory).
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

logger = logging.getLogger(__name__)


@dataclass
class Record:
    suite: str
    case: str
    metric: str  # e.g. "step_ms", "peak_reserved_gb", "images_per_s", "max_abs_diff"
    ours: float
    peer: Optional[float] = None
    peer_name: str = ""
    ratio: Optional[float] = None  # peer/ours for lower-is-better metrics, ours/peer for higher-is-better
    target: str = ""  # human-readable target, e.g. ">= 2.0x" or "<= 4.0 GB"
    passed: Optional[bool] = None  # None when the record has no target
    unit: str = ""
    device: str = ""
    versions: dict = field(default_factory=dict)
    notes: str = ""


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("diffusers", "transformers", "triton", "accelerate", "spandrel"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # optional packages: absent is a fact worth recording, not an error
            out[name] = None
    if torch.cuda.is_available():
        out["cuda"] = torch.version.cuda
    return out


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.processor() or platform.machine()})"


class BenchContext:
    """Collects records for one suite run. See the module docstring."""

    def __init__(self, suite: str, out_dir: Path, smoke: bool = False, quick: bool = False, comfyui: Optional[Path] = None,
                 time_budget_s: Optional[float] = None, deadline: Optional[float] = None, sink: Optional[Path] = None,
                 on_record: Optional[Callable[[Record], None]] = None):
        self.suite = suite
        self.out_dir = Path(out_dir)
        self.smoke = smoke
        self.quick = quick
        self.comfyui = comfyui
        self.records: list[Record] = []
        self.skipped: list[dict] = []
        self.device = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
        self._device_name = device_name()
        self._versions = versions()
        if time_budget_s is not None and time_budget_s <= 0:
            raise ValueError(f"time_budget_s={time_budget_s!r}: expected a positive number of seconds or None")
        self.time_budget_s = time_budget_s
        self.started = time.time()
        # ``deadline`` is a wall-clock epoch (time.time()) so the CLI can count the child's start-up time too.
        if deadline is None and time_budget_s is not None:
            deadline = self.started + time_budget_s
        self._deadline = math.inf if deadline is None else float(deadline)
        self.sink = None if sink is None else Path(sink)
        self.on_record = on_record

    @property
    def mode(self) -> str:
        return "smoke" if self.smoke else ("quick" if self.quick else "full")

    # ----------------------------------------------------------------- time budget
    def deadline(self) -> float:
        """The wall-clock time (``time.time()`` epoch) by which the suite should be done; ``inf`` without a budget."""
        return self._deadline

    def time_left(self) -> float:
        """Seconds until ``deadline()`` (``inf`` without a budget; negative once past it)."""
        return self._deadline - time.time()

    def has_time(self, seconds: float) -> bool:
        """True when at least ``seconds`` remain before the deadline: ask before starting an expensive case."""
        return self.time_left() >= seconds

    def skip(self, case: str, reason: str) -> None:
        """Note a case the suite leaves out (no time left, missing peer, ...); reported next to the records."""
        self.skipped.append({"case": case, "reason": reason})
        logger.info("%s/%s skipped: %s", self.suite, case, reason)
        self.flush()

    def artifact_path(self, name: str) -> Path:
        """Where to write an extra file (see the module docstring for the device tool's file limit)."""
        if not name or "/" in name or "\\" in name or name.startswith("."):
            raise ValueError(f"name={name!r}: expected a plain file name such as 'timeline.json'")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        return self.out_dir / f"{self.suite}_{name}"

    # ----------------------------------------------------------------- results
    def result(self, status: str = "running", error: str = "") -> dict:
        """The suite's result document: status, error, timing, skipped cases and records."""
        return {"suite": self.suite, "status": status, "error": error, "mode": self.mode,
                "seconds": round(time.time() - self.started, 3), "budget_s": self.time_budget_s,
                "skipped": list(self.skipped), "records": self.to_json()}

    def flush(self, status: str = "running", error: str = "") -> None:
        """Write ``result()`` to the sink (atomically), when the context has one."""
        if self.sink is None:
            return
        write_json(self.result(status, error), self.sink)

    def record(self, case: str, metric: str, ours: float, peer: Optional[float] = None, peer_name: str = "",
               target: Optional[float] = None, target_kind: str = "", lower_is_better: bool = True,
               unit: str = "", notes: str = "") -> Record:
        """Add one measurement.

        ``target_kind``: "ratio>=" (ratio must reach ``target``), "ours<=" / "ours>=" (absolute bound on ours),
        or "" (no target). The ratio is how many times better ours is than the peer. ``ours``/``peer`` may be
        Python numbers or 0-d tensors; a non-finite ``ours`` never passes a target (JSON stores it as null).
        """
        ours = float(ours)
        peer = None if peer is None else float(peer)
        ratio = None
        if peer is not None and ours != 0 and peer != 0:
            ratio = (peer / ours) if lower_is_better else (ours / peer)
        passed = None
        target_text = ""
        if target is not None and target_kind:
            # a non-finite number is stored as null: it can never be the number a target passed on (an infinite
            # throughput or ratio would otherwise pass every ">=" target)
            finite = math.isfinite(ours)
            if target_kind == "ratio>=":
                passed = finite and ratio is not None and math.isfinite(ratio) and ratio >= target
                target_text = f">= {target:g}x {peer_name}"
            elif target_kind == "ours<=":
                passed = finite and ours <= target
                target_text = f"<= {target:g} {unit}".strip()
            elif target_kind == "ours>=":
                passed = finite and ours >= target
                target_text = f">= {target:g} {unit}".strip()
            else:
                raise ValueError(f"target_kind={target_kind!r}: expected 'ratio>=', 'ours<=', 'ours>=' or ''")
        rec = Record(self.suite, case, metric, ours, peer, peer_name,
                     ratio, target_text, passed, unit, self._device_name, self._versions, notes)
        self.records.append(rec)
        self.flush()
        if self.on_record is not None:
            self.on_record(rec)
        logger.info("%s/%s %s: ours=%.4g peer=%s ratio=%s %s", self.suite, case, metric, ours, peer, ratio,
                    "" if passed is None else ("PASS" if passed else "FAIL"))
        return rec

    def to_json(self) -> list[dict]:
        return [asdict(r) for r in self.records]


# --------------------------------------------------------------------------------------------- measuring
def time_ms(fn: Callable[[], object], warmup: int = 2, repeat: int = 5, device: Optional[torch.device] = None) -> float:
    """Median wall time of ``fn()`` in milliseconds; CUDA events on a GPU, perf_counter on the CPU."""
    cuda = (device is not None and device.type == "cuda") or (device is None and torch.cuda.is_available())
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def graph_replay(call: Callable[[], object], device: torch.device) -> tuple[Callable[[], None], object]:
    """Capture ``call`` into a CUDA graph after a side-stream warm-up; returns (replay fn, static output)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            call()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    return graph.replay, out


@contextlib.contextmanager
def peak_memory(device: torch.device) -> Iterator[dict]:
    """Yields a dict that, on exit, holds ``reserved_gb`` and ``allocated_gb`` peaks of the block (GPU only)."""
    out = {"reserved_gb": 0.0, "allocated_gb": 0.0}
    if device.type != "cuda":
        yield out
        return
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    try:
        yield out
    finally:
        torch.cuda.synchronize()
        out["reserved_gb"] = torch.cuda.max_memory_reserved() / 2**30
        out["allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30


def _json_safe(value):
    """Replace non-finite floats by None (strict JSON has no NaN/Infinity) throughout a JSON-like value."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


@contextlib.contextmanager
def replaced_atomically(path: Path):
    """Yields a temporary path beside ``path`` (same suffix, so writers that pick a format from it still work); when
    the block ends without error it replaces ``path`` (``os.replace``). A failed or interrupted write leaves the
    previous file whole (or no file), never a truncated one, and removes the temporary file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.partial{path.suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through :func:`replaced_atomically`."""
    with replaced_atomically(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(records, path: Path) -> None:
    """Write a JSON-like value (a list of records, or a report document) as strict JSON (NaN -> null)."""
    write_text_atomic(path, json.dumps(_json_safe(records), indent=1))

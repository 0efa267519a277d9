"""Benchmark CLI: ``python -m leandiffusion.bench [--suite NAME ...] [--quick | --smoke] [--part K/N]
[--comfyui PATH] [--budget S] --out DIR``.

Discovers ``bench/suite_*.py`` and runs each selected suite in its own Python process (so suites never share CUDA
state and a crash or a hang in one is recorded as failed with its error while the others still run), then writes
``DIR/bench.json``, ``DIR/BENCHMARKS.md``, ``DIR/bench.log`` and the PNG charts (see ``report.py``), rewriting
bench.json and BENCHMARKS.md after every suite so a killed run keeps what it measured. ``schedule.py`` deals the
suites into parts and shares the time, ``process.py`` runs one suite in its own process, ``worker.py`` is that
process, ``report.py`` writes the files.

Time budget (the device tool allows 10 minutes a command): the whole invocation gets ``--budget`` seconds
(default: smoke 100, quick 575, full 540). Suites run one after another; before each, the time still left is
shared among the suites not yet run in proportion to their weights (a suite may declare ``QUICK_BUDGET_S`` /
``FULL_BUDGET_S`` / ``SMOKE_BUDGET_S`` at module level; defaults 60 / 240 / 10), so time a fast suite leaves
unused passes to the next ones. The suite sees 85% of its share as ``ctx.time_budget_s`` / ``ctx.deadline()``
and should skip cases (``ctx.skip``) rather than overrun; its process is killed once it has used its share plus
half of what the later suites would get (all that is left, for the last one), so the invocation never overruns. The full
suite fits four device calls with ``--part 1/4`` ... ``--part 4/4`` (suites dealt to parts by weight, longest
first, deterministic). A suite with ``REQUIRES_COMFYUI = True`` is skipped unless ``--comfyui PATH`` is given.
Module-level constants are read from the source with ``ast`` (the parent never imports a suite, nor CUDA).

Smoke mode (``--smoke``) hides every GPU from the suites (``CUDA_VISIBLE_DEVICES=""``): tiny models on the CPU,
numbers meaningless, records well-formed; CI checks them (tests/bench).

The last lines of the output are a compact summary table (``summary.summary_lines``), because the device tool
returns only the tail of a command's output. Exit status: 0 when every suite ended ok or skipped, 1 when one
failed, crashed or timed out, 2 with ``--strict`` when a target failed.
"""
from __future__ import annotations

import datetime
import logging
import os
import shlex
import sys
import tempfile
import time
import traceback
from pathlib import Path

from .arguments import parse_args
from .process import Tee, run_suite
from .report import write_all
from .schedule import DEFAULT_BUDGET_S, MIN_SHARE_S, PKG, SuiteInfo, discover, kill_after_s, parse_part, share_s, \
    split_parts
from .schema import SCHEMA_VERSION, normalise_record
from .summary import summary_lines
from .worker import worker_main

logger = logging.getLogger(__name__)


def _skipped(info: SuiteInfo, reason: str) -> dict:
    return {"suite": info.name, "status": "skipped", "error": "", "seconds": 0.0, "budget_s": 0.0,
            "skipped": [{"case": "*", "reason": reason}], "records": []}


def build_doc(meta: dict, results: list[dict]) -> dict:
    suites, records = [], []
    for r in results:
        recs = r.get("records", [])
        records += [normalise_record(x) for x in recs]
        suites.append({k: r.get(k) for k in ("suite", "status", "error", "seconds", "budget_s")} |
                      {"skipped": r.get("skipped", []), "records": len(recs)})
    return {"schema": SCHEMA_VERSION, "meta": meta, "suites": suites, "records": records}


def make_meta(args, mode: str, budget: float, selected: list[str]) -> dict:
    from .harness import device_name, versions

    hidden_gpu = mode == "smoke"
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "mode": mode,
            "command": "python -m leandiffusion.bench " + " ".join(shlex.quote(a) for a in args.argv),
            "device": device_name() if not hidden_gpu else "cpu (smoke: GPUs hidden)", "versions": versions(),
            "budget_s": budget, "part": args.part, "suites_selected": selected, "comfyui": args.comfyui,
            "host_cpus": os.cpu_count()}


def _preimport() -> None:
    """Import what every suite imports, once, before forking smoke workers (GPUs hidden first)."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # this CLI process only ever forks CPU smoke workers
    import importlib

    for name in ("torch", "diffusers", "transformers", "leandiffusion.bench.harness"):
        try:
            importlib.import_module(name.replace("leandiffusion.bench", PKG))
        except ImportError as exc:  # a suite that needs it will report the same error itself
            logger.warning("pre-import of %s failed: %s", name, exc)


def main_parent(args) -> int:
    mode = "smoke" if args.smoke else ("quick" if args.quick else "full")
    available = discover(args.suite_dir)
    if args.list:
        for name, info in available.items():
            print(f"{name:<12} weight {info.weight(mode):>5.0f}s  {info.path}"
                  f"{'  (needs --comfyui)' if info.requires_comfyui else ''}")
        total = sum(i.weight(mode) for i in available.values() if not i.requires_comfyui)
        budget = args.budget if args.budget is not None else DEFAULT_BUDGET_S[mode]
        print(f"{mode}: weights total {total:.0f}s without --comfyui, budget {budget:.0f}s "
              f"(each suite gets about {min(budget / total, 1.0) if total else 1.0:.0%} of its weight)")
        return 0
    if args.out is None:
        raise SystemExit("--out DIR is required (where bench.json, BENCHMARKS.md and the charts go)")
    unknown = [n for n in (args.suite or []) + (args.skip or []) if n not in available]
    if unknown:
        raise SystemExit(f"--suite/--skip {', '.join(unknown)}: no such suite; available: {', '.join(available) or 'none'}")
    chosen = [available[n] for n in (args.suite or available) if n not in (args.skip or [])]
    chosen = sorted({s.name: s for s in chosen}.values(), key=lambda s: s.name)
    part = parse_part(args.part)
    if part:  # suites that cannot run here (no --comfyui) take no part's time; each part lists them as skipped
        idle = [s for s in chosen if s.requires_comfyui and args.comfyui is None]
        busy = [s for s in chosen if s not in idle]
        chosen = sorted(split_parts(busy, part[1], mode)[part[0] - 1] + idle, key=lambda s: s.name)
    budget = args.budget if args.budget is not None else DEFAULT_BUDGET_S[mode]
    if budget <= 0:
        raise SystemExit(f"--budget={budget}: expected a positive number of seconds")
    isolation = args.isolation
    if isolation == "auto":
        isolation = "fork" if mode == "smoke" and hasattr(os, "fork") else "spawn"
    if isolation == "fork" and mode != "smoke":
        raise SystemExit("--isolation fork is for --smoke only: a GPU suite must start in a fresh process")
    if isolation == "fork":
        _preimport()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.log").write_text("")
    tee = Tee(out_dir / "bench.log")
    comfyui = None if args.comfyui is None else str(Path(args.comfyui).resolve())
    meta = make_meta(args, mode, budget, [s.name for s in chosen])
    tee.line(f"LeanDiffusion bench: mode {mode}, {len(chosen)} suite(s) {', '.join(s.name for s in chosen)}, "
             f"budget {budget:.0f}s, device {meta['device']}")
    end = time.time() + budget
    results: list[dict] = []
    runnable = [s for s in chosen if not (s.requires_comfyui and comfyui is None)]
    with tempfile.TemporaryDirectory(prefix="leanbench_") as tmp:
        for info in chosen:
            if info.requires_comfyui and comfyui is None:
                results.append(_skipped(info, "needs --comfyui PATH (a ComfyUI checkout)"))
                continue
            todo = runnable[runnable.index(info):]
            remaining = end - time.time()
            share = share_s(remaining, [s.weight(mode) for s in todo])
            if share < min(MIN_SHARE_S[mode], 0.5 * info.weight(mode)):
                results.append(_skipped(info, f"no time left in the {budget:.0f}s budget (share {share:.0f}s)"))
                continue
            results.append(run_suite(info, mode, out_dir, Path(tmp), share, comfyui, tee, isolation,
                                     kill_after=kill_after_s(remaining, share)))
            write_all(build_doc(meta, results), out_dir, charts=False)
    doc = build_doc(meta, results)
    try:
        paths = write_all(doc, out_dir, charts=not args.no_charts)
    except Exception:  # charts are a convenience: a drawing error must not lose bench.json (written first)
        tee.line("chart rendering failed:\n" + traceback.format_exc())
        paths = write_all(doc, out_dir, charts=False)
    tee.line("wrote " + ", ".join(str(p) for p in paths))
    for line in summary_lines(doc):
        tee.line(line)
    tee.close()
    if any(r["status"] in ("failed", "crashed", "timeout") for r in results):
        return 1
    if args.strict and any(r.get("passed") is False for r in doc["records"]):
        return 2
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    return main_parent(args)


if __name__ == "__main__":
    sys.exit(main())

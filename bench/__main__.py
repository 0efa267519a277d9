"""Benchmark CLI: ``python -m leandiffusion.bench [--suite NAME ...] [--quick | --smoke] [--part K/N]
[--comfyui PATH] [--budget S] --out DIR``.

Discovers ``bench/suite_*.py`` and runs each selected suite in its own Python process (so suites never share CUDA
state and a crash or a hang in one is recorded as failed with its error while the others still run), then writes
``DIR/bench.json``, ``DIR/BENCHMARKS.md``, ``DIR/bench.log`` and the PNG charts (see ``report.py``), rewriting
bench.json and BENCHMARKS.md after every suite so a killed run keeps what it measured.

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

The last lines of the output are a compact summary table (``report.summary_lines``), because the device tool
returns only the tail of a command's output. Exit status: 0 when every suite ended ok or skipped, 1 when one
failed, crashed or timed out, 2 with ``--strict`` when a target failed.
"""
from __future__ import annotations

import argparse
import ast
import datetime
import io
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

PKG = __package__ or "leandiffusion.bench"
BENCH_DIR = Path(__file__).parent
DEFAULT_BUDGET_S = {"smoke": 100.0, "quick": 575.0, "full": 540.0}
DEFAULT_WEIGHT_S = {"smoke": 10.0, "quick": 60.0, "full": 240.0}
WEIGHT_CONST = {"smoke": "SMOKE_BUDGET_S", "quick": "QUICK_BUDGET_S", "full": "FULL_BUDGET_S"}
SOFT_FRACTION = 0.85  # the suite's own budget (ctx.time_budget_s), as a fraction of its share
OVERRUN_FRACTION = 0.5  # a suite is killed once it has also used this fraction of the time left to the others
MIN_SHARE_S = {"smoke": 5.0, "quick": 20.0, "full": 20.0}  # below this (or half its weight) a suite is skipped
KILL_GRACE_S = 5.0

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SuiteInfo:
    name: str
    path: Path
    module: Optional[str]  # dotted module name for suites inside the package, None for --suite-dir files
    constants: dict

    def weight(self, mode: str) -> float:
        value = self.constants.get(WEIGHT_CONST[mode], DEFAULT_WEIGHT_S[mode])
        return float(value) if isinstance(value, (int, float)) and value > 0 else DEFAULT_WEIGHT_S[mode]

    @property
    def requires_comfyui(self) -> bool:
        return bool(self.constants.get("REQUIRES_COMFYUI", False))


def read_constants(path: Path) -> dict:
    """Module-level ``NAME = <literal>`` assignments of a suite file, read without importing it."""
    out = {}
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except SyntaxError:  # the worker will report the real error when it imports the suite
        return out
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    return out


def discover(suite_dir: Optional[Path] = None) -> dict[str, SuiteInfo]:
    """``{name: SuiteInfo}`` for every ``suite_<name>.py`` in the package (or in ``suite_dir``), sorted by name."""
    folder = BENCH_DIR if suite_dir is None else Path(suite_dir)
    found = {}
    for path in sorted(folder.glob("suite_*.py")):
        name = path.stem[len("suite_"):]
        module = f"{PKG}.{path.stem}" if suite_dir is None else None
        found[name] = SuiteInfo(name, path, module, read_constants(path))
    return found


def parse_part(text: Optional[str]) -> Optional[tuple[int, int]]:
    if text is None:
        return None
    pieces = text.split("/")
    if len(pieces) != 2 or not all(p.strip().isdigit() for p in pieces):
        raise ValueError(f"--part={text!r}: expected K/N such as 1/4")
    k, n = (int(p) for p in pieces)
    if not (1 <= k <= n):
        raise ValueError(f"--part={text!r}: K must be between 1 and N")
    return k, n


def split_parts(suites: list[SuiteInfo], n: int, mode: str) -> list[list[SuiteInfo]]:
    """Deal suites into ``n`` parts balancing the weights (longest first, ties by name); each part sorted by name."""
    parts: list[list[SuiteInfo]] = [[] for _ in range(n)]
    loads = [0.0] * n
    for s in sorted(suites, key=lambda s: (-s.weight(mode), s.name)):
        i = min(range(n), key=lambda j: (loads[j], j))
        parts[i].append(s)
        loads[i] += s.weight(mode)
    return [sorted(p, key=lambda s: s.name) for p in parts]


def share_s(remaining_s: float, weights: list[float]) -> float:
    """The share of ``remaining_s`` of the first suite in ``weights`` (the suites still to run)."""
    total = sum(weights)
    return remaining_s * weights[0] / total if total > 0 else 0.0


def kill_after_s(remaining_s: float, share: float) -> float:
    """When a suite's process is killed: its share plus ``OVERRUN_FRACTION`` of what the later suites would get
    (so a slow suite eats into the others' time, but never all of it; the last suite may use all that is left)."""
    return share + OVERRUN_FRACTION * max(remaining_s - share, 0.0)


# --------------------------------------------------------------------------------------------- worker
def worker_main(args) -> int:
    """Child process: run one suite, flushing its result document to ``args.result`` after every record."""
    import importlib
    import importlib.util

    from .harness import BenchContext
    from .report import format_row

    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(name)s: %(message)s")
    mode = args.mode
    ctx = BenchContext(args.worker, Path(args.out), smoke=mode == "smoke", quick=mode == "quick",
                       comfyui=None if args.comfyui is None else Path(args.comfyui), time_budget_s=args.budget_s,
                       deadline=args.deadline, sink=Path(args.result),
                       on_record=lambda rec: print("ROW " + format_row(rec.__dict__), flush=True))
    ctx.flush()
    try:
        if args.module:
            module = importlib.import_module(args.module)
        else:
            spec = importlib.util.spec_from_file_location(f"leandiffusion_bench_ext_suite_{args.worker}", args.path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        declared = getattr(module, "SUITE", None)
        if declared != args.worker:
            raise ValueError(f"{args.path}: SUITE={declared!r}, expected {args.worker!r} (the file name after suite_)")
        run = getattr(module, "run", None)
        if not callable(run):
            raise TypeError(f"{args.path}: defines no run(ctx) function")
        run(ctx)
    except Exception:  # a suite's failure is a result to record, never a reason to lose its records
        ctx.flush("failed", traceback.format_exc())
        traceback.print_exc(file=sys.stdout)
        return 1
    ctx.flush("ok")
    return 0


# --------------------------------------------------------------------------------------------- parent
class Tee:
    """Writes lines to stdout and to bench.log."""

    def __init__(self, log_path: Path):
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "a", encoding="utf-8")
        self._lock = threading.Lock()

    def line(self, text: str) -> None:
        with self._lock:
            sys.stdout.write(text + "\n")
            sys.stdout.flush()
            self._log.write(text + "\n")
            self._log.flush()

    def close(self) -> None:
        self._log.close()


def _child_env(mode: str) -> dict:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    if mode == "smoke":
        env["CUDA_VISIBLE_DEVICES"] = ""
    # Make the package importable in the child the way it is here (a symlinked or PYTHONPATH checkout).
    root = Path(sys.modules[PKG.rsplit(".", 1)[0]].__file__).parent.parent if PKG.count(".") == 1 else None
    if root is not None and (root / PKG.split(".")[0]).exists():
        env["PYTHONPATH"] = os.pathsep.join([str(root)] + [p for p in [env.get("PYTHONPATH", "")] if p])
    return env


def _kill_group(proc: subprocess.Popen) -> None:
    """End the suite process we started (its own process group, so its children go with it)."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, KILL_GRACE_S)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue


class _ForkedWorker:
    """A forked child running ``worker_main``; the subset of ``subprocess.Popen`` that ``run_suite`` uses."""

    def __init__(self, args):
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: own session (so a kill takes its children too), output into the pipe
            code = 1
            try:
                os.close(read_fd)
                os.setsid()
                os.dup2(write_fd, 1)
                os.dup2(write_fd, 2)
                os.close(write_fd)
                sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
                sys.stderr = sys.stdout
                logging.getLogger().handlers.clear()
                code = worker_main(args)
            except BaseException:  # the child must never return into the parent's code path
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                os._exit(code)
        os.close(write_fd)
        self.pid = pid
        self.returncode: Optional[int] = None
        self.stdout = io.TextIOWrapper(io.FileIO(read_fd, "r"), errors="replace")

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        end = None if timeout is None else time.time() + timeout
        while self.poll() is None:
            if end is not None and time.time() > end:
                raise subprocess.TimeoutExpired(f"fork:{self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode


def run_suite(info: SuiteInfo, mode: str, out_dir: Path, tmp_dir: Path, share: float, comfyui: Optional[str],
              tee: Tee, isolation: str = "spawn", kill_after: Optional[float] = None) -> dict:
    """Run one suite in a child process: ``SOFT_FRACTION * share`` seconds of budget, killed after
    ``kill_after`` seconds (default ``share``); return its result document.

    ``isolation``: "spawn" starts a fresh interpreter (always on a GPU: no CUDA state crosses a fork); "fork"
    forks this process, which has already imported torch and diffusers (smoke mode: saves the several seconds
    each fresh interpreter spends importing them, which decides whether CI's smoke run fits two minutes).
    """
    result_path = tmp_dir / f"{info.name}.json"
    budget = round(share * SOFT_FRACTION, 1)
    deadline = time.time() + budget
    cmd = [sys.executable, "-m", PKG, "--worker", info.name, "--mode", mode, "--out", str(out_dir),
           "--result", str(result_path), "--budget-s", str(budget), "--deadline", repr(deadline),
           "--path", str(info.path)]
    if info.module:
        cmd += ["--module", info.module]
    if comfyui:
        cmd += ["--comfyui", comfyui]
    kill_after = share if kill_after is None else max(kill_after, share)
    tee.line(f"--- suite {info.name}: budget {budget:.0f}s (killed at {kill_after:.0f}s), mode {mode}, {isolation}")
    start = time.time()
    tail: list[str] = []

    def pump(stream):
        for line in stream:
            line = line.rstrip("\n")
            tail.append(line)
            del tail[:-40]
            tee.line(f"[{info.name}] {line}")

    if isolation == "fork":
        proc = _ForkedWorker(parse_args(cmd[3:]))
        stream = proc.stdout
    else:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                env=_child_env(mode), start_new_session=True, errors="replace")
        stream = proc.stdout
    reader = threading.Thread(target=pump, args=(stream,), daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=max(kill_after, 1.0))
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(proc)
    reader.join(timeout=10)
    stream.close()
    seconds = time.time() - start
    result = None
    if result_path.exists():
        try:
            result = json.loads(result_path.read_text())
        except json.JSONDecodeError:
            result = None
    if result is None:
        result = {"suite": info.name, "status": "running", "error": "", "skipped": [], "records": []}
    last = "\n".join(tail[-15:])
    if timed_out:
        result["status"] = "timeout"
        result["error"] = (f"killed after {seconds:.0f}s (suite budget {budget:.0f}s, share {share:.0f}s); "
                           f"last output:\n{last}")
    elif result.get("status") == "running" or proc.returncode not in (0, 1):
        result["status"] = "crashed"
        result["error"] = f"exit code {proc.returncode} without a result; last output:\n{last}"
    result["seconds"] = round(seconds, 1)
    result["budget_s"] = budget
    return result


def _skipped(info: SuiteInfo, reason: str) -> dict:
    return {"suite": info.name, "status": "skipped", "error": "", "seconds": 0.0, "budget_s": 0.0,
            "skipped": [{"case": "*", "reason": reason}], "records": []}


def build_doc(meta: dict, results: list[dict]) -> dict:
    from .report import SCHEMA_VERSION, normalise_record

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
    from .report import summary_lines, write_all

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


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m leandiffusion.bench",
                                 description="Run LeanDiffusion's benchmark suites against their peers.")
    ap.add_argument("--suite", action="extend", nargs="+", help="suite name(s) to run (default: all)")
    ap.add_argument("--skip", action="extend", nargs="+", help="suite name(s) to leave out")
    ap.add_argument("--quick", action="store_true", help="GPU subset: every suite in one 10-minute device call")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny models: plumbing and record-shape check (CI)")
    ap.add_argument("--part", help="K/N: run the K-th of N balanced groups of suites (full suite in N calls)")
    ap.add_argument("--comfyui", help="path of a ComfyUI checkout: its KSampler/VAEDecodeTiled/... join as peers")
    ap.add_argument("--budget", type=float, help="seconds for the whole invocation (default smoke 100, quick 575, full 540)")
    ap.add_argument("--out", help="output folder for bench.json, BENCHMARKS.md, bench.log and charts")
    ap.add_argument("--suite-dir", type=Path, help=argparse.SUPPRESS)  # suites outside the package (tests)
    ap.add_argument("--no-charts", action="store_true", help="skip the PNG charts")
    ap.add_argument("--strict", action="store_true", help="exit 2 when any target fails")
    ap.add_argument("--list", action="store_true", help="list the suites found and their weights")
    ap.add_argument("--isolation", choices=("auto", "spawn", "fork"), default="auto",
                    help="how suites get their process: auto = fork for --smoke (fast), spawn otherwise")
    # worker (internal): one suite in this process
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=("smoke", "quick", "full"), help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--budget-s", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--module", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick and args.smoke:
        ap.error("--quick and --smoke exclude each other: smoke is the CPU check, quick the short GPU run")
    try:
        parse_part(args.part)
    except ValueError as exc:
        ap.error(str(exc))
    args.argv = list(argv)
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    return main_parent(args)


if __name__ == "__main__":
    sys.exit(main())

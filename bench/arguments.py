"""The command line of ``python -m leandiffusion.bench``, the parent's options and the worker's internal ones."""
from __future__ import annotations

import argparse
from pathlib import Path

from .schedule import parse_part


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

"""The suite process: imports one suite, runs it on a ``BenchContext`` and flushes its result document to a file
after every record, so that what it measured before a crash or a kill survives."""
from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import traceback
from pathlib import Path

from .summary import format_row


def worker_main(args) -> int:
    """Child process: run one suite, flushing its result document to ``args.result`` after every record."""
    from .harness import BenchContext  # torch: imported in the suite's process only

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

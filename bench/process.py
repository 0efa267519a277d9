"""Run one suite in a process of its own, under a time limit, and collect its result document.

A suite never shares CUDA state with another, and a crash, a raise or a hang in one is recorded (status
``crashed`` / ``failed`` / ``timeout`` with its last output) while the others still run.
"""
from __future__ import annotations

import io
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Optional

from .arguments import parse_args
from .schedule import PKG, SOFT_FRACTION, SuiteInfo
from .worker import worker_main

KILL_GRACE_S = 5.0


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

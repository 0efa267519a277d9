"""Start the headless runner (``python -m leandiffusion.run``) as a child process, as a user's shell would.

- ``runner_env``: the environment with ``PYTHONPATH`` extended by the folder that holds this checkout's
  ``leandiffusion``, so the child imports the code under test (a symlinked or PYTHONPATH checkout as well as an
  installed one).
- ``runner_process``: the child starts with Ctrl-C (SIGINT) at its default disposition, so Python turns it into
  ``KeyboardInterrupt`` as in a terminal, however the test run itself was started. A process inherits an ignored
  SIGINT across exec, and a shell without job control starts background commands with SIGINT ignored
  (``nohup pytest ... &``, a script that runs the suite in the background); Python then leaves it ignored, and a
  test that sends SIGINT to the runner waited for an exit that never came (seen: the Ctrl-C tests of
  ``test_run_failure_paths`` and ``test_run_local`` timed out in such a run, and passed in a terminal).
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator, Optional, Sequence

import leandiffusion


def runner_env(extra: Optional[dict] = None) -> dict:
    env = dict(os.environ, **(extra or {}))
    parent = str(Path(leandiffusion.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), parent) if p)
    return env


@contextlib.contextmanager
def _sigint_not_ignored() -> Iterator[None]:
    """While the child is started: SIGINT handled (not ignored) here, so the child gets the default disposition
    (exec resets a handled signal to the default, and keeps an ignored one ignored); put back afterwards."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextlib.contextmanager
def runner_process(args: Sequence[str], env_extra: Optional[dict] = None, **popen_kw) -> Iterator[subprocess.Popen]:
    """``python -m leandiffusion.run *args`` with text stdout/stderr pipes (``popen_kw`` passed to Popen), ended
    when the block ends: a runner still running then (a test that failed while waiting for it) gets SIGTERM, on
    which it stops the ComfyUI it started, then SIGKILL (its ComfyUI dies with it: parent-death signal). Before, a
    failed wait left the runner and its ComfyUI running after the test run, with their temporary folder."""
    kw = dict(env=runner_env(env_extra), text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    kw.update(popen_kw)
    with _sigint_not_ignored():
        proc = subprocess.Popen([sys.executable, "-m", "leandiffusion.run", *args], **kw)
    with proc:  # closes the pipes and reaps the child
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()

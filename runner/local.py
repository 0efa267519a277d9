"""Start a private, headless ComfyUI with this pack linked in, and always stop it again.

Invariant: after ``LocalComfyUI.stop()`` (called by ``__exit__`` on success, on any error and on Ctrl-C) no process
of the server's process group remains and its temporary folder is gone. The server runs in its own session
(process group) so it is stopped as a group; on Linux it also gets SIGTERM if the runner itself dies
(``PR_SET_PDEATHSIG``), so even a killed runner leaves no server behind.

What it starts: ``PYTHON main.py --listen 127.0.0.1 --port <free port> --extra-model-paths-config <tmp yaml>
--output-directory <tmp> --user-directory <tmp> --database-url sqlite:///:memory: --disable-auto-launch`` (plus
``--cpu`` and extra arguments on request) in the ComfyUI folder. The yaml's ``custom_nodes:`` points at a temporary
folder holding one symlink, ``leandiffusion`` -> this pack, so the pack loads from outside ComfyUI's tree (skipped
when ComfyUI's own ``custom_nodes`` already holds this pack). Model folders: ComfyUI's own ``models/``, plus
``models_dir`` and each of ``extra_models_dirs`` (same sub-folder names) when given.

The interpreter: ``python`` argument, else ``$COMFYUI_PYTHON``, else ``COMFYUI_PATH/.venv/bin/python`` or
``COMFYUI_PATH/venv/bin/python`` when present (``scripts/setup_comfyui.sh`` makes ``.venv``), else this interpreter.
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

from .client import ComfyClient
from .errors import ServerUnreachable

logger = logging.getLogger(__name__)

PACK_ROOT = Path(__file__).resolve().parent.parent
PACK_LINK_NAME = "leandiffusion"
MODEL_FOLDERS = ("checkpoints", "diffusers", "loras", "upscale_models", "vae", "embeddings", "text_encoders",
                 "diffusion_models")


def comfyui_python(comfyui_path: Path, python: Optional[str] = None) -> str:
    """The interpreter that runs ComfyUI (see the module docstring for the order of choices)."""
    if python:
        return python
    if os.environ.get("COMFYUI_PYTHON"):
        return os.environ["COMFYUI_PYTHON"]
    for venv in (".venv", "venv"):
        candidate = Path(comfyui_path) / venv / "bin" / "python"
        if candidate.exists():
            return str(candidate)
    return sys.executable


ACCELERATOR_PROBE = ("import torch; print(torch.cuda.is_available() or torch.backends.mps.is_available() "
                     "or (hasattr(torch, 'xpu') and torch.xpu.is_available()))")


def torch_has_accelerator(python: str, cwd: Optional[Path] = None, timeout: float = 120.0) -> Optional[bool]:
    """Whether ``python``'s torch sees a GPU (CUDA/ROCm, MPS or XPU), asked in a subprocess; ``None`` when it cannot
    say (no torch, the interpreter fails, ``timeout`` seconds pass). Why: ComfyUI without ``--cpu`` dies on a torch
    built without CUDA, and only that interpreter knows its torch."""
    try:
        done = subprocess.run([python, "-c", ACCELERATOR_PROBE], cwd=cwd, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as exc:
        logger.info("could not ask %s whether its torch has a GPU: %s", python, exc)
        return None
    answer = (done.stdout.strip().splitlines() or [""])[-1]
    return {"True": True, "False": False}.get(answer) if done.returncode == 0 else None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child between fork and exec (Linux only; best effort elsewhere)
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class LocalComfyUI:
    """A ComfyUI server started from ``comfyui_path`` for the duration of a ``with`` block."""

    def __init__(self, comfyui_path: str | os.PathLike, python: Optional[str] = None, cpu: bool = False,
                 extra_args: Sequence[str] = (), models_dir: Optional[str | os.PathLike] = None,
                 input_dir: Optional[str | os.PathLike] = None, start_timeout: float = 180.0,
                 log_path: Optional[str | os.PathLike] = None, pack_dir: Path = PACK_ROOT,
                 extra_models_dirs: Sequence[str | os.PathLike] = ()):
        self.comfyui_path = Path(comfyui_path).expanduser().resolve()
        if not (self.comfyui_path / "main.py").is_file():
            raise ServerUnreachable(f"--comfyui {comfyui_path}: no ComfyUI there (main.py is missing); point it at a "
                                    f"ComfyUI checkout, e.g. one made by scripts/setup_comfyui.sh")
        if models_dir is not None and not Path(models_dir).is_dir():
            raise ServerUnreachable(f"models folder {models_dir} does not exist; create it or leave it out")
        self.python = comfyui_python(self.comfyui_path, python)
        self.cpu = cpu
        self.extra_args = list(extra_args)
        self.models_dir = Path(models_dir).resolve() if models_dir is not None else None
        self.extra_models_dirs = [Path(d).resolve() for d in extra_models_dirs]
        self.input_dir = Path(input_dir).resolve() if input_dir is not None else None
        self.start_timeout = start_timeout
        self.pack_dir = Path(pack_dir).resolve()
        self.log_path = Path(log_path) if log_path is not None else None
        self.proc: Optional[subprocess.Popen] = None
        self.tmp: Optional[Path] = None
        self.url: Optional[str] = None
        self._log = None

    # ----------------------------------------------------------------------------------------- set-up
    def _pack_already_installed(self) -> bool:
        own = self.comfyui_path / "custom_nodes"
        return own.is_dir() and any(p.resolve() == self.pack_dir for p in own.iterdir())

    def _write_config(self) -> Path:
        assert self.tmp is not None
        nodes = self.tmp / "custom_nodes"
        nodes.mkdir()
        lines = ["leandiffusion:"]
        if not self._pack_already_installed():
            (nodes / PACK_LINK_NAME).symlink_to(self.pack_dir, target_is_directory=True)
            lines.append(f"  custom_nodes: {nodes}")
        if self.models_dir is not None:
            lines.append(f"  base_path: {self.models_dir}")
            lines.extend(f"  {folder}: {folder}" for folder in MODEL_FOLDERS)
        for i, folder in enumerate(self.extra_models_dirs):
            lines += [f"leandiffusion_models_{i + 1}:", f"  base_path: {folder}"]
            lines.extend(f"  {sub}: {sub}" for sub in MODEL_FOLDERS)
        config = self.tmp / "extra_model_paths.yaml"
        config.write_text("\n".join(lines) + "\n" if len(lines) > 1 else "{}\n")
        return config

    def command(self, port: int, config: Path) -> list[str]:
        assert self.tmp is not None
        cmd = [self.python, "main.py", "--listen", "127.0.0.1", "--port", str(port),
               "--extra-model-paths-config", str(config), "--output-directory", str(self.tmp / "output"),
               "--user-directory", str(self.tmp / "user"), "--database-url", "sqlite:///:memory:",
               "--disable-auto-launch"]
        if self.input_dir is not None:
            cmd += ["--input-directory", str(self.input_dir)]
        if self.cpu:
            cmd.append("--cpu")
        return cmd + self.extra_args

    # ----------------------------------------------------------------------------------------- life cycle
    def start(self) -> str:
        """Start the server and wait until it answers; return its URL. Raises ``ServerUnreachable`` (exit 4)."""
        if self.proc is not None:
            raise RuntimeError("this LocalComfyUI is already started")
        try:
            self.tmp = Path(tempfile.mkdtemp(prefix="leandiffusion-comfyui-"))
            for sub in ("output", "user"):
                (self.tmp / sub).mkdir()
            config = self._write_config()
            port = free_port()
            log_file = self.log_path or self.tmp / "comfyui.log"
            log_file.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(log_file, "wb")
            self.log_file = log_file
            cmd = self.command(port, config)
            logger.info("starting ComfyUI: %s", " ".join(cmd))
            try:
                self.proc = subprocess.Popen(cmd, cwd=self.comfyui_path, stdin=subprocess.DEVNULL, stdout=self._log,
                                             stderr=subprocess.STDOUT, start_new_session=True,
                                             preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
            except OSError as exc:
                raise ServerUnreachable(f"cannot run ComfyUI's interpreter {self.python}: {exc.strerror or exc}; "
                                        f"point --python (or COMFYUI_PYTHON) at the python of ComfyUI's environment"
                                        ) from exc
            self.url = f"http://127.0.0.1:{port}"
            self._wait_ready()
            return self.url
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        assert self.proc is not None and self.url is not None
        client = ComfyClient(self.url)
        deadline = time.monotonic() + self.start_timeout
        while True:
            code = self.proc.poll()
            if code is not None:
                raise ServerUnreachable(f"ComfyUI exited with code {code} while starting",
                                        [f"ComfyUI exited with code {code} while starting; the end of its log:"]
                                        + self.log_tail(15))
            try:
                client.ping(timeout=2)
                return
            except ServerUnreachable:
                pass
            if time.monotonic() >= deadline:
                raise ServerUnreachable(f"ComfyUI did not answer within {self.start_timeout:g} s of starting",
                                        [f"ComfyUI did not answer within {self.start_timeout:g} s of starting; "
                                         f"the end of its log:"] + self.log_tail(15))
            time.sleep(0.25)

    def stop(self) -> None:
        """Stop the server's whole process group (SIGTERM, then SIGKILL after 10 s) and remove the temp folder."""
        proc, self.proc = self.proc, None
        if proc is not None:
            for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass
                try:
                    proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
            try:  # anything the server spawned into its group
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self._log is not None:
            self._log.close()
            self._log = None
        if self.tmp is not None:
            if self.log_path is None:
                self._last_log = self.log_text()
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None

    def exited(self, wait: float = 0.0) -> Optional[int]:
        """The server's exit code once it has exited (waiting up to ``wait`` seconds), else ``None``."""
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout=wait) if wait > 0 else self.proc.poll()
        except subprocess.TimeoutExpired:
            return None

    def pack_import_error(self, context: int = 15) -> list[str]:
        """The log lines ending in ComfyUI's "Cannot import <this pack> module for custom nodes: ..." (with the
        traceback before it), indented; empty when the pack imported (or the log does not say)."""
        names = {str(self.pack_dir)}
        if self.tmp is not None:
            names.add(str(self.tmp / "custom_nodes" / PACK_LINK_NAME))
        lines = self.log_text().splitlines()
        for i, line in enumerate(lines):
            if "Cannot import " in line and any(f"Cannot import {name} module" in line for name in names):
                return ["  " + text for text in lines[max(0, i - context + 1):i + 1]]
        return []

    def log_text(self) -> str:
        path = getattr(self, "log_file", None)
        if path is not None and Path(path).exists():
            return Path(path).read_text(errors="replace")
        return getattr(self, "_last_log", "")

    def log_tail(self, n: int) -> list[str]:
        return ["  " + line for line in self.log_text().splitlines()[-n:]]

    def __enter__(self) -> "LocalComfyUI":
        self.start()
        return self

    def __exit__(self, *exc) -> bool:
        self.stop()
        return False

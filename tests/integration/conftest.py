"""Session fixture: the real ComfyUI from ``COMFYUI_PATH``, on the CPU, with this pack loaded from outside its tree.

Set-up (once per machine): ``COMFYUI_PATH=DIR bash scripts/setup_comfyui.sh`` (see docs/runner.md). ComfyUI runs
with ``COMFYUI_PYTHON`` when set, else ``COMFYUI_PATH/.venv/bin/python`` (what the set-up script makes), else this
interpreter. Tests carry the ``comfyui`` marker; without ``COMFYUI_PATH`` they skip with that reason
(tests/conftest.py).
"""
import os
from pathlib import Path

import pytest

from leandiffusion.runner.local import LocalComfyUI


def comfyui_server_pids(tag: str = "") -> set[int]:
    """Pids of every ComfyUI process the runner started (its command line names a runner temp folder).

    With ``tag``, only those whose environment holds ``LEANDIFFUSION_TEST_TAG=<tag>``: the servers started by one
    test's runner (a child inherits the runner's environment), not by a concurrent test session on this machine."""
    pids = set()
    marker = f"LEANDIFFUSION_TEST_TAG={tag}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            if b"main.py" not in cmdline or not any(b"leandiffusion-comfyui-" in part for part in cmdline):
                continue
            if tag and marker not in (entry / "environ").read_bytes().split(b"\0"):
                continue
        except OSError:
            continue
        pids.add(int(entry.name))
    return pids


@pytest.fixture
def server_pids():
    """The function listing runner-started ComfyUI pids (tests compare before/after)."""
    return comfyui_server_pids


@pytest.fixture(scope="session")
def comfyui(tmp_path_factory):
    """A started ``LocalComfyUI`` (``.url``, ``.log_text()``, ``.input_dir``); stopped, and checked gone, at the end."""
    root = tmp_path_factory.mktemp("comfyui")
    models, inputs = root / "models", root / "input"
    for folder in (models / "checkpoints", models / "diffusers", models / "loras", models / "upscale_models", inputs):
        folder.mkdir(parents=True)
    server = LocalComfyUI(os.environ["COMFYUI_PATH"], cpu=True, models_dir=models, input_dir=inputs,
                          log_path=root / "comfyui.log", start_timeout=300)
    server.start()
    pid = server.proc.pid
    try:
        yield server
    finally:
        server.stop()
    assert pid not in comfyui_server_pids(), f"ComfyUI (pid {pid}) is still running after stop()"


@pytest.fixture(scope="session")
def clip_l_model_files(comfyui):
    """The server's models folder with a random full-size CLIP-L (``text_encoders/``) and an SD1 checkpoint holding
    the same CLIP-L that ComfyUI's CheckpointLoaderSimple accepts (``tests/kit/clip_l.py``); written once."""
    from leandiffusion.tests.kit.clip_l import write_clip_l_model_files

    return write_clip_l_model_files(comfyui.models_dir)

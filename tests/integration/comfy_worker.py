"""Runs a worker script under ComfyUI's interpreter with the pack importable, for the tests that compare the pack's
math with ComfyUI's own functions in one process (same torch build on both sides).

Invariant: the worker gets ``COMFYUI_PATH PACK_PARENT *args CASES_JSON OUT_JSON``, where ``PACK_PARENT`` holds a link
named ``leandiffusion`` to the pack under test, and its JSON answer comes back; a failing worker fails the test with
its stderr.
"""
import json
import os
import subprocess
from pathlib import Path

import leandiffusion
from leandiffusion.runner.local import comfyui_python


def run_comfy_worker(worker: str, folder: Path, cases: list, *args: str, timeout: int = 1800) -> dict:
    """The worker's JSON answer for ``cases`` (written to ``folder``)."""
    (folder / "cases.json").write_text(json.dumps(cases))
    pack_parent = folder / "pack"
    pack_parent.mkdir()
    (pack_parent / "leandiffusion").symlink_to(Path(leandiffusion.__file__).parent, target_is_directory=True)
    comfy_path = os.environ["COMFYUI_PATH"]
    run = subprocess.run([comfyui_python(comfy_path), worker, comfy_path, str(pack_parent), *args,
                          str(folder / "cases.json"), str(folder / "out.json")], capture_output=True, text=True,
                         timeout=timeout)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads((folder / "out.json").read_text())

"""Runs a worker script under ComfyUI's interpreter with this pack importable as ``leandiffusion`` (a link in the
test's folder) and returns the JSON it wrote; shared by the integration tests that compare inside one process."""
import json
import os
import subprocess
from pathlib import Path

import leandiffusion
from leandiffusion.runner.local import comfyui_python


def run_pack_worker(worker: str, folder: Path, cases: list, *args: str, timeout: int = 1800):
    """``python WORKER COMFYUI_PATH PACK_PARENT *args CASES_JSON OUT_JSON`` -> the parsed OUT_JSON."""
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

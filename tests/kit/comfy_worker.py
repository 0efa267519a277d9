"""Runs a comparison worker script under ComfyUI's own interpreter and reads back its JSON answer; the one runner of
every test that compares the pack with ComfyUI's code inside one ComfyUI process.

Invariant: the worker is called as ``python WORKER COMFYUI_PATH PACK_PARENT [ARGS...] CASES_JSON OUT_JSON``, where
``PACK_PARENT`` holds a link named ``leandiffusion`` to the package under test (the checkout this process imported,
since the pack is not installed in ComfyUI's environment); a failing worker fails the test with its stderr.
Why a subprocess: ComfyUI's modules and its environment (scipy, torchsde, einops) are a reference that never enters
the pack's process, while both sides inside the worker share one torch build.
"""
import json
import os
import subprocess
from pathlib import Path

import leandiffusion
from leandiffusion.runner.local import comfyui_python


def run_comfy_worker(worker: str, folder: Path, cases: list, *args, timeout: int = 1800) -> dict:
    """Write ``cases`` to ``folder``, run ``worker`` with ComfyUI's interpreter (``COMFYUI_PATH``) and the extra
    ``args`` (as strings), return its parsed JSON answer."""
    (folder / "cases.json").write_text(json.dumps(cases))
    pack_parent = folder / "pack"
    pack_parent.mkdir(exist_ok=True)
    link = pack_parent / "leandiffusion"
    if not link.exists():
        link.symlink_to(Path(leandiffusion.__file__).parent, target_is_directory=True)
    comfy_path = os.environ["COMFYUI_PATH"]
    run = subprocess.run([comfyui_python(comfy_path), worker, comfy_path, str(pack_parent), *map(str, args),
                          str(folder / "cases.json"), str(folder / "out.json")], capture_output=True, text=True,
                         timeout=timeout)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads((folder / "out.json").read_text())

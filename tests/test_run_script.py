"""``python PATH/TO/PACK/run.py`` runs the headless runner without installing the pack, whatever the pack folder is
called (ComfyUI-Manager clones it as e.g. ``custom_nodes/ComfyUI-LeanDiffusion``).

Guards: the README's runner examples need ``leandiffusion`` importable; a user who installed the pack the README's
way (a clone in ``custom_nodes/``) had no ``leandiffusion`` package, and ``python run.py`` failed with "attempted
relative import with no known parent package". The child hides any installed ``leandiffusion`` (CI installs the
pack) and runs the file as ``python run.py`` would.
"""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_AS_SCRIPT = """
import importlib.abc, runpy, sys
class HideInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "leandiffusion":
            raise ModuleNotFoundError("No module named 'leandiffusion' (hidden by the test)", name=name)
sys.meta_path.insert(0, HideInstalled())
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _run(script, *args, cwd):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "COMFYUI_PATH")}
    return subprocess.run([sys.executable, "-c", _AS_SCRIPT, str(script), *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=120)


def test_run_py_as_a_script_from_any_folder_name(tmp_path):
    link = tmp_path / "ComfyUI-LeanDiffusion"
    link.symlink_to(ROOT, target_is_directory=True)
    proc = _run(link / "run.py", "--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout and "--comfyui" in proc.stdout


def test_run_py_as_a_script_reads_the_workflow(tmp_path):
    """Past argument parsing: the workflow is read and checked through the bootstrapped package; without a server
    or ComfyUI folder the runner says how to name one (exit 2), as ``python -m leandiffusion.run`` does."""
    proc = _run(ROOT / "run.py", str(ROOT / "workflows_api" / "quickstart.api.json"), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "say where ComfyUI is" in proc.stderr

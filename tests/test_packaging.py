"""Packaging promises: requirements.txt mirrors pyproject's runtime deps (minus torch), every sub-package is listed;
the project's pytest settings remove a passing test's temporary folder."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pyproject():
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_requirements_txt_mirrors_pyproject_without_torch():
    deps = {d for d in _pyproject()["project"]["dependencies"] if d.split(">=")[0] != "torch"}
    lines = {l.strip() for l in (ROOT / "requirements.txt").read_text().splitlines() if l.strip() and not l.startswith("#")}
    assert lines == deps


def test_every_python_package_folder_is_listed():
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    found = {"leandiffusion"}
    for init in ROOT.rglob("__init__.py"):
        parts = init.parent.relative_to(ROOT).parts
        if parts and not any(p.startswith(".") or p in ("fixtures", "build") for p in parts):
            found.add("leandiffusion." + ".".join(parts))
    missing = sorted(found - listed)
    assert not missing, f"add to [tool.setuptools] packages: {missing}"


def test_comfy_registry_metadata():
    comfy = _pyproject()["tool"]["comfy"]
    assert comfy["PublisherId"] and comfy["DisplayName"]
    assert (ROOT / comfy["Icon"]).is_file()


_BLOCK_HEAVY = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'diffusers', 'transformers', 'safetensors', 'numpy'):
            raise ImportError('blocked for this test: ' + name)
sys.meta_path.insert(0, Block())
"""


def test_runner_starts_without_torch_or_the_node_registry():
    """``python -m leandiffusion.run`` is a thin HTTP client: it must start where torch is not importable (a client
    machine talking to a remote ComfyUI). Before the package's ``__init__`` became lazy it imported the nodes."""
    import os
    import subprocess
    import sys

    code = _BLOCK_HEAVY + "import runpy; sys.argv = ['run', '--help']; runpy.run_module('leandiffusion.run', run_name='__main__')"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout and "--server" in proc.stdout


def test_node_mappings_load_on_first_access():
    import leandiffusion
    from leandiffusion import nodes

    assert leandiffusion.NODE_CLASS_MAPPINGS is nodes.NODE_CLASS_MAPPINGS
    assert leandiffusion.NODE_DISPLAY_NAME_MAPPINGS is nodes.NODE_DISPLAY_NAME_MAPPINGS
    assert "LeanStreamSampler" in leandiffusion.NODE_CLASS_MAPPINGS
    import pytest

    with pytest.raises(AttributeError, match="no_such_name"):
        leandiffusion.no_such_name  # noqa: B018


def test_a_passing_tests_tmp_path_is_removed_and_a_failing_ones_kept(tmp_path):
    """Under the project's pytest settings a passing test's ``tmp_path`` is removed when the test ends; a failing
    one's stays for inspection. Before, pytest kept every test's folder of the last three runs: about 0.9 GB per
    full run (tiny checkpoints, ESRGAN weights) left in the system's temporary folder."""
    (tmp_path / "test_probe.py").write_text("def test_passes(tmp_path):\n    (tmp_path / 'f').write_bytes(b'x')\n\n\n"
                                            "def test_fails(tmp_path):\n    (tmp_path / 'f').write_bytes(b'x')\n"
                                            "    assert False\n")
    base = tmp_path / "base"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-c",
                           str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path), "--basetemp", str(base),
                           str(tmp_path / "test_probe.py")], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert "1 failed, 1 passed" in proc.stdout, proc.stdout + proc.stderr
    assert sorted(p.name for p in base.iterdir() if not p.is_symlink()) == ["test_fails0"]  # + pytest's links

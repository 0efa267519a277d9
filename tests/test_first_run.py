"""A new user's first run: ``scripts/setup_comfyui.sh``, the package build, the README's quickstart.

``setup_comfyui.sh`` runs without a network or a real install: a fake interpreter (``COMFYUI_PYTHON``) answers the
script's questions (torch's version, ``sys.prefix``) and records each ``pip install`` instead of installing; a fake
``git`` fails as an offline clone does.

Guards: a second setup run reinstalled everything because the stamp hashed ``torch==2.13.0`` on the first run and
the installed ``torch==2.13.0+cpu`` on the next; offline without ``COMFYUI_PATH`` the script stopped on a raw git
error that did not say how to point it at a ComfyUI; building the package warned that ``project.license`` as a table
is deprecated; the README did not say the quickstart's picture is noise.
"""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SETUP = ROOT / "scripts" / "setup_comfyui.sh"

needs_bash = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("sha256sum") is None,
                                reason="needs bash and sha256sum (the script's own requirements)")

# After the first ``pip install`` the fake interpreter reports the installed torch (and torchvision) as pip would.
_FAKE_PYTHON = """#!/usr/bin/env bash
STATE="{state}"
case "$*" in
  "-m pip install"*) echo "$*" >> "$STATE/pip.log"; touch "$STATE/installed"; exit 0 ;;
  *'version("torch")'*) [ -f "$STATE/installed" ] && {{ echo "{torch}"; exit 0; }}; exit 1 ;;
  *'version("torchvision")'*) [ -f "$STATE/installed" ] && {{ echo "0.28.0"; exit 0; }}; exit 1 ;;
  *sys.prefix*) echo "$STATE/prefix" ;;
  "-c import torchvision") exit 0 ;;
  "-") cat > /dev/null ;;
  *) exec "{python}" "$@" ;;
esac
"""


def _fake_tree(tmp_path: Path, installed_torch: str) -> dict:
    comfy = tmp_path / "ComfyUI"
    comfy.mkdir()
    (comfy / "main.py").write_text("")
    (comfy / "requirements.txt").write_text("torch\ntorchvision\ntorchaudio\naiohttp\npyyaml\n")
    state = tmp_path / "state"
    (state / "prefix").mkdir(parents=True)
    fake = tmp_path / "python"
    fake.write_text(_FAKE_PYTHON.format(state=state, torch=installed_torch, python=sys.executable))
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMFYUI_")}
    return dict(env, COMFYUI_PATH=str(comfy), COMFYUI_PYTHON=str(fake), STATE=str(state))


def _setup(env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, env=env, timeout=120)


@needs_bash
@pytest.mark.parametrize("installed_torch", ["2.13.0+cpu", "2.13.0"])
def test_a_second_setup_run_installs_nothing(tmp_path, installed_torch):
    """The stamp is the same whether torch is pinned from constraints-cpu.txt (first run, no torch yet) or read
    back from the interpreter (every later run), with or without the ``+cpu`` local label."""
    env = _fake_tree(tmp_path, installed_torch)
    pip_log = Path(env["STATE"]) / "pip.log"
    first = _setup(env)
    assert first.returncode == 0, first.stderr
    assert len(pip_log.read_text().splitlines()) == 1
    second = _setup(env)
    assert second.returncode == 0, second.stderr
    assert len(pip_log.read_text().splitlines()) == 1, f"the second run installed again:\n{second.stderr}"
    assert "dependencies already installed" in second.stderr
    assert second.stdout.strip().splitlines()[-1] == f"COMFYUI_PATH={env['COMFYUI_PATH']}"


@needs_bash
def test_a_changed_requirement_installs_again(tmp_path):
    """The stable stamp still notices what matters: a requirement ComfyUI adds is installed on the next run."""
    env = _fake_tree(tmp_path, "2.13.0+cpu")
    assert _setup(env).returncode == 0
    with open(Path(env["COMFYUI_PATH"]) / "requirements.txt", "a") as f:
        f.write("spandrel\n")
    assert _setup(env).returncode == 0
    assert len((Path(env["STATE"]) / "pip.log").read_text().splitlines()) == 2


@needs_bash
def test_an_offline_clone_says_how_to_point_at_a_comfyui(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    git = bin_dir / "git"
    git.write_text("#!/usr/bin/env bash\necho \"fatal: unable to access 'https://github.com/': Could not resolve "
                   "host: github.com\" >&2\nexit 128\n")
    git.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMFYUI_")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", COMFYUI_PATH=str(tmp_path / "cache" / "ComfyUI"))
    proc = _setup(env)
    assert proc.returncode == 1
    assert "could not clone ComfyUI v0.3.64 from https://github.com/comfyanonymous/ComfyUI.git" in proc.stderr
    assert "Set COMFYUI_PATH to an existing ComfyUI folder" in proc.stderr
    assert "COMFYUI_SOURCE to a local git" in proc.stderr
    assert not (tmp_path / "cache" / "ComfyUI").exists()


_APPLY_PYPROJECT = """
import json, sys, warnings
from setuptools.config.pyprojecttoml import apply_configuration
from setuptools.dist import Distribution
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    dist = apply_configuration(Distribution(), sys.argv[1])
print(json.dumps({"warnings": [w.category.__name__ + ": " + str(w.message).splitlines()[0] for w in caught],
                  "license_expression": getattr(dist.metadata, "license_expression", None)}))
"""


def test_the_package_metadata_builds_without_deprecation_warnings():
    """``project.license`` is an SPDX expression (a TOML table is deprecated since setuptools 77), and the build
    requires a setuptools that reads it. setuptools runs in a child: importing it changes ``sys.path``."""
    import json
    import tomllib
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("setuptools")
    except PackageNotFoundError:
        pytest.skip("setuptools is not installed")
    if tuple(int(x) for x in installed.split(".")[:2]) < (77, 0):
        pytest.skip(f"setuptools {installed} predates SPDX license expressions")
    proc = subprocess.run([sys.executable, "-c", _APPLY_PYPROJECT, str(ROOT / "pyproject.toml")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not [w for w in result["warnings"] if "Deprecation" in w], result["warnings"]
    assert result["license_expression"] == "MIT"
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    floor = next(re.fullmatch(r"setuptools>=([\d.]+)", r).group(1) for r in requires if r.startswith("setuptools"))
    assert tuple(int(x) for x in floor.split(".")) >= (77, 0, 3), f"build-system requires setuptools>={floor}"


def test_the_readme_quickstart_says_the_tiny_models_picture_is_noise():
    readme = (ROOT / "README.md").read_text()
    quickstart = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    assert "picture is noise" in quickstart
    assert "workflows_api/quickstart.api.json" in quickstart


def test_the_readme_states_no_test_counts():
    """Test counts in the README went stale with every added test; the test run itself reports them."""
    counts = re.findall(r"\b\d+ (?:passed|failed|skipped|tests?)\b", (ROOT / "README.md").read_text())
    assert not counts, counts

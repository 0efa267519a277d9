"""Packaging promises: requirements.txt mirrors pyproject's runtime deps (minus torch), every sub-package is listed."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pyproject():
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_requirements_txt_mirrors_pyproject_without_torch():
    deps = {d for d in _pyproject()["project"]["dependencies"] if not d.startswith("torch")}
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

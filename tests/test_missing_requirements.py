"""A ComfyUI Python without the pack's requirements gets one warning at start-up naming what is missing and the
install line, not a bare ``No module named 'diffusers'`` at the first run.

Guards: the node modules import diffusers lazily, so the pack registered its nodes silently in an environment where
``pip install -r requirements.txt`` had not run (or failed), and every model node then failed when queued.
"""
import importlib.util
import logging
import os
import sys

from leandiffusion import nodes


def _hide(monkeypatch, *names):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None if name in names else real(name, *a, **k))


def test_nothing_is_reported_when_the_requirements_are_installed(caplog):
    assert nodes.missing_requirements() == []
    with caplog.at_level(logging.WARNING):
        nodes.warn_missing_requirements()
    assert not caplog.records


def test_a_missing_requirement_is_one_warning_with_the_install_line(monkeypatch, caplog):
    _hide(monkeypatch, "diffusers")
    assert nodes.missing_requirements() == ["diffusers"]
    with caplog.at_level(logging.WARNING):
        nodes.warn_missing_requirements()
    (record,) = caplog.records
    text = record.getMessage()
    assert "diffusers is not installed" in text
    assert f"{sys.executable} -m pip install -r " in text
    assert os.path.isfile(text.rsplit(" ", 1)[1]), "the warning must name the pack's requirements.txt"


def test_a_finder_that_refuses_the_name_counts_as_missing(monkeypatch):
    def refuse(name, *a, **k):
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.setattr(importlib.util, "find_spec", refuse)
    assert nodes.missing_requirements() == ["diffusers", "transformers", "safetensors"]


def test_torch_below_the_floor_is_one_warning_naming_what_fails(caplog):
    """requirements.txt leaves torch to ComfyUI, so pip never upgrades an old one. Under PyTorch 2.3 (tested with
    2.3.1) ``torch.OutOfMemoryError`` does not exist, so ESRGAN's tile loop turned any error (out of memory, a
    cancel) into AttributeError,
    and a compiled UNet kept computing a LoRA after it was removed; the pack said nothing about it at start-up."""
    assert nodes.torch_too_old("2.3.1+cu121") and nodes.torch_too_old("1.13.1")
    assert not any(nodes.torch_too_old(v) for v in ("2.4.0", "2.4.1+cu121", "2.13.0+cpu", "2.10.0a0+git1234", "3.0.0"))
    with caplog.at_level(logging.WARNING):
        nodes.warn_old_torch("2.13.0+cpu")
    assert not caplog.records
    with caplog.at_level(logging.WARNING):
        nodes.warn_old_torch("2.3.1+cu121")
    (record,) = caplog.records
    text = record.getMessage()
    assert text.startswith("LeanDiffusion: PyTorch 2.3.1+cu121 is older than 2.4,") and sys.executable in text


def test_the_torch_floor_is_pyprojects():
    import tomllib
    from pathlib import Path

    deps = tomllib.loads((Path(nodes.__file__).parents[1] / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_dep,) = [d for d in deps if d.split(">=")[0] == "torch"]
    assert torch_dep == "torch>={}.{}".format(*nodes.MIN_TORCH)

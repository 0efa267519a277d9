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

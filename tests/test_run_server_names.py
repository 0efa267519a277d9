"""Output names a server lists: read with POSIX and Windows rules, saved only inside ``--out``.

Guards: the runner checked a server-given ``subfolder`` with POSIX rules only, so Windows forms (``\\Windows\\Temp``,
``D:evil``) passed and resolved outside ``--out``, and a ``filename`` of ``.`` wrote ``<parent of --out>/out_1``.
Every unusable name is refused before anything is fetched or created; a Windows server's relative subfolder
(``a\\b``) still saves under ``--out``.
"""
from pathlib import Path

import pytest

from leandiffusion.runner.client import ComfyClient
from leandiffusion.runner.errors import ExecutionFailed
from leandiffusion.tests.fixtures.fake_comfyui import FakeComfyUI, tiny_png


@pytest.fixture
def fake():
    with FakeComfyUI() as server:
        yield server


def _entry(filename, subfolder):
    return {"outputs": {"9": {"images": [{"filename": filename, "subfolder": subfolder, "type": "output"}]}}}


@pytest.mark.parametrize("filename,subfolder", [
    ("x.png", "\\Windows\\Temp"), ("x.png", "D:evil"), ("x.png", "C:\\Users"), ("x.png", "\\\\host\\share"),
    ("x.png", "a\\..\\..\\b"), ("x.png", "/etc"), ("x.png", "../outside"),
    (".", ""), ("..", ""), ("", ""), ("D:x.png", ""), ("..\\x.png", ""), ("a/x.png", ""), ("\\x.png", ""),
    ("x\0.png", ""),
])
def test_an_unusable_server_name_is_refused_before_fetching(fake, tmp_path, filename, subfolder):
    out = tmp_path / "out"
    with pytest.raises(ExecutionFailed, match=r"ComfyUI listed an output image with an unusable name"):
        ComfyClient(fake.url).save_images(_entry(filename, subfolder), out)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing beside --out, and no --out either


def test_a_windows_servers_relative_subfolder_saves_under_out(fake, tmp_path):
    fake.files[("x.png", "a\\b", "output")] = tiny_png()
    saved = ComfyClient(fake.url).save_images(_entry("x.png", "a\\b"), tmp_path / "out")
    assert saved == [tmp_path / "out" / "a" / "b" / "x.png"] and Path(saved[0]).read_bytes() == tiny_png()

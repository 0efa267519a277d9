"""A started ComfyUI gets ``--cpu`` when its interpreter's torch sees no GPU, and the runner says so on stderr.

Guards: ``python run.py WORKFLOW`` on a machine whose torch has no CUDA started ComfyUI without ``--cpu``, which
died with "Torch not compiled with CUDA enabled" (exit 4) and no hint of ``--cpu``. The interpreter is asked in a
subprocess; a wrapper script stands in for it (its answer to the probe is set by the test, anything else runs the
fake ComfyUI with this interpreter), so the tests do not depend on this machine's GPU.
"""
import os
import sys
from pathlib import Path

import pytest

from leandiffusion.runner.cli import main
from leandiffusion.runner.errors import EXIT_OK
from leandiffusion.runner.local import torch_has_accelerator

FIXTURES = Path(__file__).parent / "fixtures"
FAKE = FIXTURES / "fake_comfyui.py"


def _interpreter(tmp_path: Path, probe_answer: str, probe_exit: int = 0) -> str:
    """A 'python' whose ``-c`` probe prints ``probe_answer`` and exits ``probe_exit``; other calls run this one."""
    path = tmp_path / "python"
    path.write_text(f"#!/bin/sh\nif [ \"$1\" = \"-c\" ]; then echo '{probe_answer}'; exit {probe_exit}; fi\n"
                    f"exec {sys.executable} \"$@\"\n")
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize("answer,code,expected", [("False", 0, False), ("True", 0, True),
                                                  ("ModuleNotFoundError: torch", 1, None), ("garbage", 0, None)])
def test_the_probe_reads_the_interpreters_answer(tmp_path, answer, code, expected):
    assert torch_has_accelerator(_interpreter(tmp_path, answer, code)) is expected


def test_the_probe_says_nothing_for_a_missing_or_stalled_interpreter(tmp_path):
    assert torch_has_accelerator(str(tmp_path / "no-python")) is None
    stalled = tmp_path / "stalled"
    stalled.write_text("#!/bin/sh\nexec sleep 30\n")
    stalled.chmod(0o755)
    assert torch_has_accelerator(str(stalled), timeout=0.5) is None


@pytest.mark.parametrize("answer,extra,cpu_expected", [("False", [], True), ("True", [], False),
                                                       ("False", ["--comfyui-arg=--directml"], False)])
def test_a_started_comfyui_gets_cpu_when_its_torch_sees_no_gpu(fake_comfyui_dir, tmp_path, capsys, answer, extra,
                                                                cpu_expected):
    log = tmp_path / "comfyui.log"
    code = main([str(FIXTURES / "core_image.api.json"), "--comfyui", str(fake_comfyui_dir), "--python",
                 _interpreter(tmp_path, answer), "--out", str(tmp_path / "out"), "--comfyui-log", str(log), *extra])
    err = capsys.readouterr().err
    assert code == EXIT_OK, err
    args_line = next(line for line in log.read_text().splitlines() if line.startswith("fake ComfyUI args:"))
    assert ("--cpu" in args_line.split()) is cpu_expected
    assert ("sees no GPU; starting ComfyUI with --cpu" in err) is cpu_expected


def test_cpu_typed_by_hand_skips_the_probe(fake_comfyui_dir, tmp_path, capsys):
    marker = tmp_path / "asked"
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nif [ \"$1\" = \"-c\" ]; then touch {marker}; echo False; exit 0; fi\n"
                      f"exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    code = main([str(FIXTURES / "core_image.api.json"), "--comfyui", str(fake_comfyui_dir), "--python", str(python),
                 "--out", str(tmp_path / "out"), "--cpu", "-q"])
    assert code == EXIT_OK, capsys.readouterr().err
    assert not os.path.exists(marker)

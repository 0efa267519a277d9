"""The runner CLI against an in-process fake ComfyUI (tests/fixtures/fake_comfyui.py, recorded 0.3.64 bodies).

Guards the documented contract: images saved through /view into --out (complete files only, never overwriting),
--set applied, UI workflows converted, one plain line per problem, and the exit codes 0 / 2 / 3 / 4.
"""
import json
import socket
from pathlib import Path

import pytest

from leandiffusion.runner.cli import main
from leandiffusion.runner.errors import EXIT_EXECUTION, EXIT_INVALID, EXIT_OK, EXIT_UNREACHABLE
from leandiffusion.tests.fixtures.fake_comfyui import RECORDED, FakeComfyUI

FIXTURES = Path(__file__).parent / "fixtures"
API = str(FIXTURES / "core_image.api.json")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def fake():
    with FakeComfyUI() as server:
        yield server


def _run(fake, *args, workflow=API):
    return main([workflow, "--server", fake.url, "-q", *args])


def _error_lines(capsys):
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]


def test_success_saves_every_image_and_applies_overrides(fake, tmp_path, capsys):
    out = tmp_path / "out"
    code = main([API, "--server", fake.url, "--out", str(out), "--set", "1.width=40",
                 "--set", "SaveImage.filename_prefix=run"])  # with the progress bar
    assert code == EXIT_OK
    files = sorted(p.name for p in out.iterdir())
    assert files == ["run_00001_.png", "run_00002_.png"]  # no partial (hidden) files left
    assert all((out / f).read_bytes().startswith(PNG_MAGIC) for f in files)
    sent = fake.prompts[-1]
    assert sent["client_id"] and sent["prompt"]["1"]["inputs"]["width"] == 40
    assert str(out / "run_00001_.png") in capsys.readouterr().out


def test_second_run_never_overwrites(fake, tmp_path):
    out = tmp_path / "out"
    for _ in range(2):
        fake._counter = 0  # the server restarts its numbering, as a fresh ComfyUI output folder does
        assert _run(fake, "--out", str(out)) == EXIT_OK
    assert sorted(p.name for p in out.iterdir()) == ["core_image_00001_.png", "core_image_00001__1.png",
                                                     "core_image_00002_.png", "core_image_00002__1.png"]


def test_ui_workflow_is_converted_before_submission(fake, tmp_path):
    assert _run(fake, "--out", str(tmp_path), workflow=str(FIXTURES / "core_image.json")) == EXIT_OK
    expected = json.loads((FIXTURES / "core_image_ui.expected.api.json").read_text())
    sent = {nid: {k: v for k, v in n.items() if k != "_meta"} for nid, n in fake.prompts[-1]["prompt"].items()}
    assert sent == expected


def test_without_websocket_the_runner_polls_history(fake, tmp_path):
    fake.drop_websocket = True
    assert _run(fake, "--out", str(tmp_path)) == EXIT_OK
    assert len(list(tmp_path.iterdir())) == 2


def test_convert_only_prints_the_prompt(fake, capsys):
    assert _run(fake, "--convert-only", "--set", "2.width=16", workflow=str(FIXTURES / "core_image.json")) == EXIT_OK
    printed = json.loads(capsys.readouterr().out)
    assert printed["2"]["inputs"]["width"] == 16 and not fake.prompts


def test_convert_only_saves_nothing_so_out_is_not_checked(fake, tmp_path, capsys):
    """--convert-only prints the prompt and saves no image: an --out that could not hold images (here a file) is no
    reason to refuse it."""
    not_a_folder = tmp_path / "file.txt"
    not_a_folder.write_text("x")
    assert _run(fake, "--convert-only", "--out", str(not_a_folder)) == EXIT_OK
    assert json.loads(capsys.readouterr().out) == json.loads(Path(API).read_text())
    assert not fake.prompts


@pytest.mark.parametrize("case, expected", [
    ("wrong_type", ["node 1 (EmptyImage): input 'width' = 'wide' is not a valid INT value"]),
    ("missing_input", ["node 2 (ImageScale): required input 'upscale_method' is missing"]),
    ("two_problems", ["node 1 (EmptyImage): input 'width' = 0 is below its minimum 1",
                      "node 2 (ImageScale): input 'upscale_method' = 'foo' is not one of the allowed values "
                      "(nearest-exact, bilinear, area, bicubic, lanczos)"]),
    ("link_mismatch", ["node 3 (SaveImage): input 'images' expects IMAGE but is linked to output 0 of node 9, "
                       "which gives LATENT"]),
    ("unknown_node", ["node 4 (NoSuchNode): unknown node type; this ComfyUI does not provide it "
                      "(install the node pack that does, or remove the node)"]),
])
def test_refusals_give_one_line_per_problem_and_exit_2(fake, tmp_path, capsys, case, expected):
    fake.refusal = RECORDED["refusals"][case]  # bodies recorded from the real ComfyUI 0.3.64
    assert _run(fake, "--out", str(tmp_path)) == EXIT_INVALID
    assert _error_lines(capsys) == [f"error: {line}" for line in expected]
    assert not list(tmp_path.iterdir())


def test_unknown_nodes_are_all_named_before_submission(fake, tmp_path, capsys):
    prompt = json.loads(Path(API).read_text())
    prompt["7"] = {"class_type": "NoSuchNode", "inputs": {}}
    prompt["8"] = {"class_type": "OtherMissing", "inputs": {}}
    wf = tmp_path / "wf.api.json"
    wf.write_text(json.dumps(prompt))
    assert _run(fake, workflow=str(wf)) == EXIT_INVALID
    lines = _error_lines(capsys)
    assert len(lines) == 2 and "node 7 (NoSuchNode)" in lines[0] and "node 8 (OtherMissing)" in lines[1]
    assert not fake.prompts


def test_partially_valid_prompt_is_withdrawn_and_refused(fake, tmp_path, capsys):
    fake.partial_refusal = RECORDED["refusals"]["missing_input"]
    assert _run(fake, "--out", str(tmp_path)) == EXIT_INVALID
    assert _error_lines(capsys) == ["error: node 2 (ImageScale): required input 'upscale_method' is missing"]
    assert [path for path, _ in fake.cancelled] == ["/queue", "/interrupt"]


def test_execution_error_exits_3_naming_the_node(fake, tmp_path, capsys):
    fake.fail_node = "2"
    assert _run(fake, "--out", str(tmp_path)) == EXIT_EXECUTION
    assert _error_lines(capsys) == ["error: node 2 (ImageScale) failed: IndexError: index 3 is out of bounds for "
                                    "dimension 3 with size 3"]
    assert not list(tmp_path.iterdir())


def test_execution_error_found_by_polling(fake, tmp_path, capsys):
    fake.fail_node = "2"
    fake.drop_websocket = True
    assert _run(fake, "--out", str(tmp_path)) == EXIT_EXECUTION
    assert "node 2 (ImageScale) failed: IndexError" in _error_lines(capsys)[0]


def test_timeout_cancels_the_prompt_and_exits_3(fake, tmp_path, capsys):
    fake.hang = True
    assert _run(fake, "--out", str(tmp_path), "--timeout", "0.5") == EXIT_EXECUTION
    assert "did not finish within --timeout 0.5 s" in _error_lines(capsys)[0]
    assert [path for path, _ in fake.cancelled] == ["/queue", "/interrupt"]
    assert len(fake.cancelled[0][1]["delete"]) == 1 and fake.cancelled[1][1]["prompt_id"]


def test_unreachable_server_exits_4(tmp_path, capsys):
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert main([API, "--server", f"http://127.0.0.1:{port}", "-q"]) == EXIT_UNREACHABLE
    lines = _error_lines(capsys)
    assert len(lines) == 1 and f"ComfyUI is not reachable at http://127.0.0.1:{port}" in lines[0]


@pytest.mark.parametrize("args, match", [
    (["missing.json"], "cannot read workflow missing.json"),
    ([API, "--set", "nonsense"], "expected NODE_ID.INPUT=VALUE"),
    ([API, "--set", "9.width=1"], "no node with id '9'"),
])
def test_invalid_invocations_exit_2(fake, capsys, args, match):
    assert main([*args, "--server", fake.url, "-q"]) == EXIT_INVALID
    lines = _error_lines(capsys)
    assert len(lines) == 1 and match in lines[0]


def test_no_server_and_no_comfyui_path_exits_2(monkeypatch, capsys):
    monkeypatch.delenv("COMFYUI_PATH", raising=False)
    assert main([API, "-q"]) == EXIT_INVALID
    assert "--server URL" in _error_lines(capsys)[0]


def test_runner_modules_never_import_torch_or_the_nodes():
    # The runner must work on a machine that only talks to a remote ComfyUI: load it as a top-level package from
    # the pack folder (so the pack's __init__ and its nodes are not imported) and check what got imported.
    import subprocess
    import sys

    import leandiffusion

    pack = Path(leandiffusion.__file__).resolve().parent
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import runner.cli, runner.local; "
            "bad = [m for m in ('torch', 'diffusers', 'numpy', 'nodes', 'comfy') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code, str(pack)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr

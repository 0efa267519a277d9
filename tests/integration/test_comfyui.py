"""The pack inside the real ComfyUI (CPU): it imports cleanly, /object_info shows every node as declared, the
runner runs a core-node fixture, every editor workflow converts to its API twin, and the runner's error paths (wrong
input type, missing input, unknown node, execution error) give their exit codes and one line per problem. The shipped
workflows themselves run through ``run.py --tiny`` in ``test_shipped_workflows.py``. Needs ``COMFYUI_PATH`` (see
conftest.py); skipped without it.
"""
import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

import leandiffusion
from leandiffusion.runner.cli import main
from leandiffusion.runner.client import ComfyClient
from leandiffusion.runner.convert import load_workflow, ui_to_api
from leandiffusion.runner.errors import EXIT_EXECUTION, EXIT_INVALID, EXIT_OK
from leandiffusion.runner.local import PACK_LINK_NAME, PACK_ROOT
from leandiffusion.tests.kit.runner_process import runner_env

pytestmark = pytest.mark.comfyui

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
API_DIR = PACK_ROOT / "workflows_api"
UI_TWINS = [p for p in sorted((PACK_ROOT / "workflows").glob("*.json")) if (API_DIR / f"{p.stem}.api.json").exists()]


def _strip_meta(prompt):
    return {nid: {k: v for k, v in node.items() if k != "_meta"} for nid, node in prompt.items()}


def _errors(capsys):
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]


@pytest.fixture(scope="module")
def object_info(comfyui):
    return ComfyClient(comfyui.url).object_info()


# --------------------------------------------------------------------------------------------- the pack loads
def test_log_shows_pack_imported_without_error(comfyui):
    log = comfyui.log_text()
    loaded = re.findall(r"^\s*[\d.]+ seconds( \(IMPORT FAILED\))?: (.*custom_nodes/leandiffusion)\s*$", log, re.M)
    assert loaded, "ComfyUI's import-time list does not mention the pack:\n" + log[-3000:]
    assert all(failed == "" for failed, _ in loaded), "ComfyUI reports IMPORT FAILED for the pack"
    assert not re.search(r"Cannot import .*leandiffusion", log), log[-3000:]


def test_object_info_lists_every_pack_node_as_declared(object_info):
    mappings = leandiffusion.NODE_CLASS_MAPPINGS
    ours = {name for name, spec in object_info.items()
            if str(spec.get("python_module", "")).endswith("." + PACK_LINK_NAME)}
    assert ours == set(mappings), "nodes ComfyUI lists for the pack differ from NODE_CLASS_MAPPINGS"
    for node_id, cls in mappings.items():
        spec = object_info[node_id]
        declared = cls.INPUT_TYPES()
        for section in ("required", "optional"):
            listed = spec["input"].get(section) or {}
            assert list(listed) == list(declared.get(section) or {}), f"{node_id} {section} inputs"
            for name, conf in (declared.get(section) or {}).items():
                want, got = conf[0], listed[name][0]
                assert isinstance(got, list) if isinstance(want, (list, tuple)) else got == want, f"{node_id}.{name}"
        assert spec["output"] == list(cls.RETURN_TYPES), f"{node_id} outputs"
        if getattr(cls, "RETURN_NAMES", None):
            assert spec["output_name"] == list(cls.RETURN_NAMES), f"{node_id} output names"
        assert spec["category"] == cls.CATEGORY
        assert spec["display_name"] == leandiffusion.NODE_DISPLAY_NAME_MAPPINGS.get(node_id, node_id)


# --------------------------------------------------------------------------------------------- running workflows
def test_core_fixture_workflow_runs(comfyui, tmp_path):
    from PIL import Image

    out = tmp_path / "out"
    assert main([str(FIXTURES / "core_image.api.json"), "--server", comfyui.url, "--out", str(out), "-q"]) == EXIT_OK
    images = sorted(out.glob("core_image_*.png"))
    assert len(images) == 2  # batch_size 2
    for path in images:
        with Image.open(path) as im:
            assert im.size == (32, 24)


def test_ui_fixture_converts_like_the_editor_and_runs(comfyui, object_info, tmp_path):
    _, workflow = load_workflow((FIXTURES / "core_image.json").read_text())
    expected = json.loads((FIXTURES / "core_image_ui.expected.api.json").read_text())
    assert _strip_meta(ui_to_api(workflow, object_info)) == expected
    out = tmp_path / "out"
    assert main([str(FIXTURES / "core_image.json"), "--server", comfyui.url, "--out", str(out), "-q"]) == EXIT_OK
    assert len(list(out.glob("core_image_ui_*.png"))) == 2


@pytest.mark.parametrize("ui_path", UI_TWINS, ids=lambda p: p.name)
def test_shipped_ui_workflow_converts_to_its_api_twin(object_info, ui_path):
    _, workflow = load_workflow(ui_path.read_text())
    _, api = load_workflow((API_DIR / f"{ui_path.stem}.api.json").read_text())
    assert _strip_meta(ui_to_api(workflow, object_info)) == _strip_meta(api)


# --------------------------------------------------------------------------------------------- error paths
def _variant(tmp_path, change):
    prompt = json.loads((FIXTURES / "core_image.api.json").read_text())
    change(prompt)
    path = tmp_path / "variant.api.json"
    path.write_text(json.dumps(prompt))
    return str(path)


@pytest.mark.parametrize("change, expected", [
    (lambda p: p["1"]["inputs"].update(width="wide"),
     "node 1 (EmptyImage): input 'width' = 'wide' is not a valid INT value"),
    (lambda p: p["2"]["inputs"].pop("upscale_method"),
     "node 2 (ImageScale): required input 'upscale_method' is missing"),
    (lambda p: p.update({"9": {"class_type": "NoSuchNode", "inputs": {}}}),
     "node 9 (NoSuchNode): unknown node type; this ComfyUI does not provide it (install the node pack that does, "
     "or remove the node)"),
], ids=["wrong_input_type", "missing_input", "unknown_node"])
def test_invalid_workflow_exits_2_with_one_line(comfyui, tmp_path, capsys, change, expected):
    code = main([_variant(tmp_path, change), "--server", comfyui.url, "--out", str(tmp_path / "out"), "-q"])
    assert code == EXIT_INVALID
    assert _errors(capsys) == [f"error: {expected}"]


def test_execution_error_exits_3(comfyui, tmp_path, capsys):
    code = main([str(FIXTURES / "core_execution_error.api.json"), "--server", comfyui.url, "--out",
                 str(tmp_path / "out"), "-q"])
    assert code == EXIT_EXECUTION
    assert _errors(capsys) == ["error: node 2 (ImageToMask) failed: IndexError: index 3 is out of bounds for "
                               "dimension 3 with size 3"]


def test_runner_started_comfyui_leaves_no_server(comfyui, tmp_path, server_pids):
    tag = uuid.uuid4().hex  # marks this runner's server: concurrent ComfyUI servers elsewhere do not count
    result = subprocess.run([sys.executable, "-m", "leandiffusion.run", str(FIXTURES / "core_image.api.json"),
                             "--comfyui", os.environ["COMFYUI_PATH"], "--cpu", "--out", str(tmp_path / "out"), "-q",
                             "--start-timeout", "300"], env=runner_env({"LEANDIFFUSION_TEST_TAG": tag}),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == EXIT_OK, result.stderr
    assert len(list((tmp_path / "out").glob("*.png"))) == 2
    assert server_pids(tag) == set()  # the server the runner started is gone

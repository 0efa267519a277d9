"""Every shipped API workflow runs as a user runs it on a CPU-only machine without its models:
``python run.py workflows_api/NAME.api.json --comfyui COMFYUI_PATH --tiny --out DIR`` in a subprocess, with no
``--cpu`` typed (the runner adds it when ComfyUI's torch sees no GPU, and says so), exits 0 and writes every output
node's images. Each run starts and stops its own ComfyUI, as the runner does for a user.

Every file in ``workflows_api/`` is a case, so a workflow added there is covered without a change here; a workflow
whose models ``--tiny`` has no stand-in for fails here (add its stand-ins to ``runner/tiny.py``). The stand-in files
are written once for the module into a temporary ``LEANDIFFUSION_TINY_MODELS``. For time, ``--set`` shrinks what the
pack's nodes declare of ``QUICK`` (2 steps, 64x64 px, one image per prompt) and LoadImage reads a 64x64 picture
(``--input-dir``): the tiny UNet attends at full resolution, so on two CPU cores one step at 1024x1024 takes ~40 s.
Needs ``COMFYUI_PATH`` (a ComfyUI set up by ``scripts/setup_comfyui.sh``); skipped without it. Slow: a ComfyUI start
per workflow.
"""
import json
import os
import subprocess
import sys
import uuid

import pytest

from leandiffusion.runner.convert import load_workflow
from leandiffusion.runner.local import PACK_ROOT, comfyui_python, torch_has_accelerator
from leandiffusion.tests.integration.model_files import write_input_images

pytestmark = [pytest.mark.comfyui, pytest.mark.slow]

API_DIR = PACK_ROOT / "workflows_api"
WORKFLOWS = sorted(p for p in API_DIR.iterdir() if p.is_file())
SAVERS = ("SaveImage", "PreviewImage")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
QUICK = {"steps": 2, "width": 64, "height": 64, "batch_size": 1, "images_per_prompt": 1}


def _quick_sets(prompt: dict) -> list[str]:
    """``--set`` arguments giving ``QUICK`` values to the pack's nodes that declare those inputs as values."""
    sets = []
    for node_id, node in sorted(prompt.items()):
        if not node["class_type"].startswith("Lean"):
            continue
        for name, value in QUICK.items():
            if name in node["inputs"] and not isinstance(node["inputs"][name], list):  # a list is a link
                sets += ["--set", f"{node_id}.{name}={value}"]
    return sets


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="module")
def sees_no_gpu():
    comfyui = os.environ["COMFYUI_PATH"]
    return torch_has_accelerator(comfyui_python(comfyui), cwd=comfyui) is False


@pytest.mark.parametrize("workflow", WORKFLOWS, ids=lambda p: p.name)
def test_shipped_workflow_runs_through_run_py_with_tiny_models(workflow, tiny_models, sees_no_gpu, tmp_path,
                                                               server_pids):
    kind, prompt = load_workflow(workflow.read_text())
    assert kind == "api", f"{workflow.name}: workflows_api/ holds API-format workflows only"
    out, inputs = tmp_path / "out", tmp_path / "input"
    inputs.mkdir()
    write_input_images(prompt, inputs)
    tag = uuid.uuid4().hex
    env = dict(os.environ, LEANDIFFUSION_TINY_MODELS=str(tiny_models), LEANDIFFUSION_TEST_TAG=tag)
    result = subprocess.run([sys.executable, str(PACK_ROOT / "run.py"), str(workflow), "--comfyui",
                             os.environ["COMFYUI_PATH"], "--tiny", "--out", str(out), "--input-dir", str(inputs),
                             "--start-timeout", "300", *_quick_sets(prompt)], env=env, capture_output=True, text=True,
                            timeout=840)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stderr[-6000:]}"
    if sees_no_gpu:
        assert "starting ComfyUI with --cpu" in result.stderr, result.stderr
    for node_id, node in prompt.items():
        if node["class_type"] in SAVERS:
            prefix = node["inputs"].get("filename_prefix", "ComfyUI")
            images = [p for p in out.rglob("*.png") if p.name.startswith(prefix)]
            assert images, f"node {node_id} ({node['class_type']}) wrote no image; stdout:\n{result.stdout}"
            assert all(p.read_bytes().startswith(PNG_MAGIC) for p in images)
    assert any(node["class_type"] in SAVERS for node in prompt.values()), \
        f"{workflow.name} has no output node: {json.dumps(sorted({n['class_type'] for n in prompt.values()}))}"
    assert server_pids(tag) == set()  # the ComfyUI the runner started is gone

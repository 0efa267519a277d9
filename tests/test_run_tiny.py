"""The runner's ``--tiny`` (runner/tiny.py): a workflow runs without its models, on the pack's tiny stand-ins, only
when asked, every change listed, ``--set`` still winning; the stand-in files are written once by ComfyUI's python.

Guards the promise "a user's real workflow never silently swaps models" (without ``--tiny`` the prompt reaches
ComfyUI unchanged, and a missing model's refusal names ``--tiny``) and what the CPU-only acceptance run needs
(``tests/integration/test_shipped_workflows.py`` runs every shipped workflow this way on the real ComfyUI).
"""
import json
import sys
from pathlib import Path

import pytest

from leandiffusion.runner import cli, tiny
from leandiffusion.runner.cli import main
from leandiffusion.runner.errors import EXIT_INVALID, EXIT_OK, EXIT_UNREACHABLE, ServerUnreachable
from leandiffusion.runner.local import PACK_ROOT, LocalComfyUI
from leandiffusion.tests.fixtures.fake_comfyui import RECORDED, FakeComfyUI

API_DIR = PACK_ROOT / "workflows_api"
PACK_INPUTS = {"LeanModelLoader": ["model", "vram_policy", "weight_dtype"],
               "LeanLoraInjector": ["lean_model", "lora_name", "target_blocks"],
               "LeanFusedDDIMSampler": ["lean_model", "positive", "steps", "width"],
               "LeanFlowSampler": ["lean_model", "positive"], "LeanESRGANUpscale": ["image", "model_name"],
               "LeanTiledVAEDecode": ["samples", "lean_model"], "CLIPLoader": ["clip_name", "type", "device"],
               "CLIPTextEncode": ["text", "clip"],
               "LeanSplitModelLoader": ["diffusion_model", "text_encoder", "vae", "vram_policy", "weight_dtype"],
               "LeanEditSampler": ["lean_model", "image", "instruction", "steps"],
               "LeanEditStreamSampler": ["lean_model", "images", "instruction", "steps"]}
QWEN_EDIT = (tiny.QWEN_EDIT_DIT, tiny.QWEN_EDIT_TE, tiny.QWEN_EDIT_VAE)
ZIMAGE = (tiny.ZIMAGE_DIT, tiny.ZIMAGE_TE, tiny.ZIMAGE_VAE)


def _spec(names):
    return {"input": {"required": {name: ["STRING", {}] for name in names}}, "output": [], "output_node": False}


@pytest.fixture
def fake():
    with FakeComfyUI() as server:
        server.object_info = {**RECORDED["object_info"], **{k: _spec(v) for k, v in PACK_INPUTS.items()}}
        yield server


def _workflow(tmp_path, name):
    path = tmp_path / name
    path.write_text((API_DIR / name).read_text())
    return str(path)


def test_tiny_sets_every_model_input_says_so_and_set_still_wins(fake, tmp_path, capsys):
    code = main([_workflow(tmp_path, "lora_hot_swap.api.json"), "--server", fake.url, "--out", str(tmp_path / "o"),
                 "--tiny", "--set", "3.target_blocks=\"mid_block\""])
    assert code == EXIT_OK
    sent = fake.prompts[-1]["prompt"]
    assert sent["1"]["inputs"]["model"] == tiny.TINY_SD and sent["1"]["inputs"]["weight_dtype"] == "auto"
    assert sent["1"]["inputs"]["vram_policy"] == "full"
    assert sent["2"]["inputs"]["lora_name"] == sent["3"]["inputs"]["lora_name"] == tiny.LORA
    assert sent["2"]["inputs"]["target_blocks"] == "" and sent["3"]["inputs"]["target_blocks"] == "mid_block"
    assert sent["4"]["inputs"]["steps"] == 25 and sent["4"]["inputs"]["width"] == 512  # nothing else changes
    err = capsys.readouterr().err
    assert "note: --tiny: node 1 (LeanModelLoader) model: 'v1-5-pruned-emaonly.safetensors' -> " \
           "'tiny-random (test)'" in err
    assert f"loras/{tiny.LORA}" in err and f"-m {tiny.WRITER}" in err  # --server: which files, how to write them


def test_without_tiny_the_workflow_reaches_comfyui_unchanged(fake, tmp_path, capsys):
    path = _workflow(tmp_path, "sdxl_4gb_product_shot.api.json")
    assert main([path, "--server", fake.url, "--out", str(tmp_path / "o")]) == EXIT_OK
    sent = {nid: {k: v for k, v in node.items() if k != "_meta"} for nid, node in fake.prompts[-1]["prompt"].items()}
    shipped = {nid: {k: v for k, v in node.items() if k != "_meta"}
               for nid, node in json.loads(Path(path).read_text()).items()}
    assert sent == shipped and "--tiny" not in capsys.readouterr().err


def test_a_missing_model_is_refused_naming_tiny(fake, tmp_path, capsys):
    fake.refusal = {"error": {"type": "prompt_outputs_failed_validation", "message": "Prompt outputs failed validation",
                              "details": "", "extra_info": {}},
                    "node_errors": {"1": {"class_type": "LeanModelLoader", "dependent_outputs": ["4"], "errors": [
                        {"type": "value_not_in_list", "message": "Value not in list",
                         "details": "model: 'v1-5-pruned-emaonly.safetensors' not in ['tiny-random (test)']",
                         "extra_info": {"input_name": "model", "input_config": [["tiny-random (test)"], {}],
                                        "received_value": "v1-5-pruned-emaonly.safetensors"}}]}}}
    assert main([_workflow(tmp_path, "sd15_fast.api.json"), "--server", fake.url, "-q"]) == EXIT_INVALID
    err = capsys.readouterr().err.splitlines()
    assert err[0] == ("error: node 1 (LeanModelLoader): input 'model' = 'v1-5-pruned-emaonly.safetensors' is not one "
                      "of the allowed values (tiny-random (test))")
    assert err[1].startswith("  to try the workflow without its models") and err[1].endswith("add --tiny")


@pytest.mark.parametrize("holds, loader", [("LeanFlowSampler", tiny.TINY_ZIMAGE), ("CLIPLoader", tiny.SD1_CLIP_L),
                                           ("LeanTiledVAEDecode", tiny.TINY_SD)])
def test_the_loaders_stand_in_follows_what_the_workflow_feeds_it(holds, loader):
    prompt = {"1": {"class_type": "LeanModelLoader", "inputs": {"model": "real.safetensors"}},
              "2": {"class_type": holds, "inputs": {}}}
    object_info = {k: _spec(v) for k, v in PACK_INPUTS.items()}
    sets = tiny.tiny_overrides(prompt, object_info)
    assert ("1", "model", loader) in sets
    if holds == "CLIPLoader":
        assert ("2", "clip_name", tiny.CLIP_L) in sets and ("2", "type", "stable_diffusion") in sets


@pytest.mark.parametrize("holds, files", [("LeanEditSampler", QWEN_EDIT), ("LeanEditStreamSampler", QWEN_EDIT),
                                          ("LeanFlowSampler", ZIMAGE), ("SaveImage", ZIMAGE)])
def test_the_split_loaders_stand_ins_follow_the_sampler_the_workflow_feeds(holds, files):
    prompt = {"1": {"class_type": "LeanSplitModelLoader", "inputs": {"diffusion_model": "real.safetensors"}},
              "2": {"class_type": holds, "inputs": {}}}
    sets = tiny.tiny_overrides(prompt, {k: _spec(v) for k, v in PACK_INPUTS.items()})
    assert [(name, value) for _, name, value in sets if name != "weight_dtype"] == \
        list(zip(("diffusion_model", "text_encoder", "vae"), files))
    assert tiny.files_needed({"LeanSplitModelLoader", holds}) == [files[0]]  # the set's DiT is written last


def test_an_edit_workflow_gets_the_tiny_qwen_edit_files_says_so_and_set_still_wins(fake, tmp_path, capsys):
    fake.object_info = {**fake.object_info, "LoadImage": _spec(["image"]), "SaveImage": _spec(["images"])}
    code = main([_workflow(tmp_path, "qwen_image_edit.api.json"), "--server", fake.url, "--out", str(tmp_path / "o"),
                 "--tiny", "--set", "1.vae=\"mine.safetensors\""])
    assert code == EXIT_OK
    sent = fake.prompts[-1]["prompt"]
    assert (sent["1"]["inputs"]["diffusion_model"], sent["1"]["inputs"]["text_encoder"]) == QWEN_EDIT[:2]
    assert sent["1"]["inputs"]["vae"] == "mine.safetensors" and sent["1"]["inputs"]["vram_policy"] == "auto"
    assert sent["2"]["inputs"]["image"] == "example.png"  # LoadImage keeps its file (ComfyUI's input folder)
    assert sent["3"]["inputs"]["steps"] == 40
    err = capsys.readouterr().err
    assert ("note: --tiny: node 1 (LeanSplitModelLoader) text_encoder: 'qwen_2.5_vl_7b.safetensors' -> "
            f"'{tiny.QWEN_EDIT_TE}'") in err
    assert f"diffusion_models/{tiny.QWEN_EDIT_DIT}" in err and tiny.ZIMAGE_DIT not in err


def test_files_needed_follow_the_node_types_in_either_format():
    assert tiny.files_needed(tiny.class_types("api", json.loads((API_DIR / "quickstart.api.json").read_text()))) == []
    product = json.loads((API_DIR / "sdxl_4gb_product_shot.api.json").read_text())
    assert tiny.files_needed(tiny.class_types("api", product)) == [tiny.LORA, tiny.UPSCALER]
    for name, dit in (("qwen_image_edit", tiny.QWEN_EDIT_DIT), ("qwen_image_edit_batch", tiny.QWEN_EDIT_DIT),
                      ("z_image_turbo", tiny.ZIMAGE_DIT)):
        shipped = json.loads((API_DIR / f"{name}.api.json").read_text())
        assert tiny.files_needed(tiny.class_types("api", shipped)) == [dit]
    ui = {"nodes": [{"type": "CLIPLoader"}, {"type": "LeanModelLoader"}, "not a node"]}
    assert tiny.files_needed(tiny.class_types("ui", ui)) == [tiny.CLIP_L, tiny.SD1_CLIP_L]


def test_a_started_comfyui_gets_the_stand_ins_its_workflow_needs(fake_comfyui_dir, tmp_path, monkeypatch):
    written = []
    monkeypatch.setenv("LEANDIFFUSION_TINY_MODELS", str(tmp_path / "tiny"))
    monkeypatch.setattr(cli, "write_files", lambda python, pack, folder, names, quiet: written.append((folder, names)))
    monkeypatch.setattr(cli, "torch_has_accelerator", lambda *a, **k: True)
    args = cli.build_parser().parse_args(["x.api.json", "--tiny", "-q", "--python", sys.executable])
    workflow = json.loads((API_DIR / "upscale_only.api.json").read_text())
    server = cli._local_server(str(fake_comfyui_dir), args, ("api", workflow))
    assert written == [(tmp_path / "tiny", [tiny.UPSCALER])]
    assert server.extra_models_dirs == [(tmp_path / "tiny").resolve()]


def test_extra_model_folders_reach_comfyuis_model_paths(fake_comfyui_dir, tmp_path):
    extra = tmp_path / "tiny"
    extra.mkdir()
    with LocalComfyUI(fake_comfyui_dir, python=sys.executable, extra_models_dirs=[extra]) as server:
        pass
    log = server.log_text()
    assert f"leandiffusion_models_1:\n  base_path: {extra.resolve()}\n  checkpoints: checkpoints\n" in log
    assert "  text_encoders: text_encoders\n" in log


def test_the_writer_writes_each_file_once_with_the_given_python(tmp_path, capsys):
    folder = tmp_path / "tiny"
    tiny.write_files(sys.executable, PACK_ROOT, folder, [tiny.LORA, tiny.UPSCALER])
    lora, upscaler = folder / "loras" / tiny.LORA, folder / "upscale_models" / tiny.UPSCALER
    assert lora.stat().st_size > 1000 and upscaler.stat().st_size > 1000
    assert "writing the stand-in model files" in capsys.readouterr().err
    from safetensors.torch import load_file

    assert any(k.startswith("lora_unet_") for k in load_file(str(lora)))
    assert not list(folder.rglob(".*partial*"))
    before = lora.stat().st_mtime_ns
    tiny.write_files("/no/such/python", PACK_ROOT, folder, [tiny.LORA])  # present: nothing runs
    assert lora.stat().st_mtime_ns == before


def test_a_writer_that_fails_is_exit_4_with_its_output(tmp_path):
    python = tmp_path / "python"  # a ComfyUI interpreter without the pack's requirements
    python.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'safetensors'\" >&2\nexit 1\n")
    python.chmod(0o755)
    with pytest.raises(ServerUnreachable) as failed:
        tiny.write_files(str(python), PACK_ROOT, tmp_path / "tiny", [tiny.LORA], quiet=True)
    assert failed.value.exit_code == EXIT_UNREACHABLE
    assert "install the pack's requirements.txt with that python" in failed.value.lines[0]
    assert failed.value.lines[1:] == ["  ModuleNotFoundError: No module named 'safetensors'"]


def test_the_qwen_edit_stand_ins_load_as_an_editor_beside_the_zimage_ones(tmp_path, monkeypatch):
    """Both split sets share one folder (``tiny_models_dir()``): each family finds its own diffusers folder's
    tokenizer there, and the Qwen set's text encoder keeps its vision tower, so the Edit samplers can run it."""
    from leandiffusion import bridge
    from leandiffusion.memory.split_files import load_split_engine
    from leandiffusion.tests.kit.tiny_model_files import write_files

    write_files(tmp_path, {kind: f"{sub}/{name}" for name, (kind, sub) in tiny.FILES.items()
                           if kind in ("zimage", "qwen_image_edit")})
    assert not list(tmp_path.rglob(".*partial*"))
    monkeypatch.setenv(bridge.MODELS_ENV, str(tmp_path))
    monkeypatch.setattr(bridge, "comfy_qwen_tokenizer_dir", lambda: None)  # only the written folders may answer
    qwen = load_split_engine(*QWEN_EDIT, "full", device="cpu")
    zimage = load_split_engine(*ZIMAGE, "full", device="cpu")
    assert qwen.family == "qwen_image" and qwen.parts.text_encoder.visual is not None
    assert zimage.family == "zimage"
    from transformers import AutoTokenizer

    written = AutoTokenizer.from_pretrained(str(tmp_path / "diffusers" / tiny.QWEN_EDIT_TAG / "tokenizer"))
    assert qwen.parts.tokenizer.get_vocab() == written.get_vocab()
    assert zimage.parts.tokenizer.get_vocab() != written.get_vocab()  # the two tokenizers differ: a mix-up fails

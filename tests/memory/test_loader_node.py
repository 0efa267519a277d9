"""The Memory Pool Loader node: contract, model list, tiny model, real files, errors.

Guards the node contract (IDs, inputs, outputs) and "tiny-random (test) builds the kit's tiny SD1.x
model in memory (cached per process)".
"""
import pytest
import torch

from leandiffusion.memory import load as load_mod
from leandiffusion.nodes.loader import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS, LeanModelLoader
from leandiffusion.tests.kit import save_diffusers_folder, save_ldm_checkpoint, tiny_components


@pytest.fixture()
def models_dir(tmp_path, monkeypatch):
    save_ldm_checkpoint(tiny_components("sd1"), tmp_path / "checkpoints" / "tiny-sd1.safetensors")
    save_diffusers_folder(tiny_components("sd2"), tmp_path / "diffusers" / "tiny-sd2")
    monkeypatch.setenv("LEANDIFFUSION_MODELS", str(tmp_path))
    return tmp_path


def test_contract():
    assert NODE_CLASS_MAPPINGS["LeanModelLoader"] is LeanModelLoader
    assert NODE_DISPLAY_NAME_MAPPINGS["LeanModelLoader"] == "Memory Pool Loader"
    assert LeanModelLoader.CATEGORY == "LeanDiffusion/loaders"
    assert LeanModelLoader.RETURN_TYPES == ("LEAN_MODEL", "STRING")
    req = LeanModelLoader.INPUT_TYPES()["required"]
    assert list(req) == ["model", "vram_policy", "vram_budget_gb", "weight_dtype", "vae_dtype"]
    assert req["vram_policy"][0] == ["auto", "full", "balanced", "lowvram", "stream"]
    assert req["vram_budget_gb"][0] == "FLOAT" and req["vram_budget_gb"][1]["default"] == 4.0
    assert req["vram_budget_gb"][1]["min"] == 0.5
    assert req["weight_dtype"][0] == ["auto", "fp16", "bf16", "fp32", "fp8_e4m3fn", "fp8_e4m3fn_fast"]
    assert "fp8_e4m3fn_fast" in req["weight_dtype"][1]["tooltip"]
    assert req["vae_dtype"][0] == ["auto", "fp32", "fp16", "bf16"]
    assert req["model"][0][0] == "tiny-random (test)"


def test_model_list_has_checkpoints_and_folders(models_dir):
    choices = LeanModelLoader.INPUT_TYPES()["required"]["model"][0]
    assert "tiny-sd1.safetensors" in choices and "tiny-sd2" in choices


def test_nested_diffusers_folders_are_listed_and_load_like_comfyuis_diffusers_loader(models_dir):
    """ComfyUI's DiffusersLoader lists every folder under diffusers/ that holds a model_index.json, at any depth.
    Bug: the menu listed top-level folder names only, so an organisation folder ("stabilityai") was offered and
    failed ("has no model_index.json") while the model inside it was never offered."""
    save_diffusers_folder(tiny_components("sd1"), models_dir / "diffusers" / "org" / "tiny-sd1-nested")
    (models_dir / "diffusers" / "not-a-model").mkdir()
    choices = LeanModelLoader.INPUT_TYPES()["required"]["model"][0]
    assert "org/tiny-sd1-nested" in choices and "tiny-sd2" in choices
    assert "org" not in choices and "not-a-model" not in choices
    engine, _ = LeanModelLoader().load("org/tiny-sd1-nested", "full", 4.0, "fp32", "auto")
    assert engine.family == "sd1"


def test_tiny_model_loads_and_is_cached_per_process():
    node = LeanModelLoader()
    load_mod._tiny_cached.cache_clear()
    e1, plan = node.load("tiny-random (test)", "balanced", 4.0, "auto", "auto")
    e2, _ = node.load("tiny-random (test)", "full", 4.0, "auto", "auto")
    assert load_mod._tiny_cached.cache_info().misses == 1
    assert e1.parts.unet is not e2.parts.unet  # each engine owns its modules (placements never collide)
    assert e1.family == "sd1" and "policy balanced" in plan and "text" in plan and "unet" in plan
    assert e1.pool is not None and e1.placement.name == "balanced"


def test_files_load_through_the_node(models_dir):
    node = LeanModelLoader()
    engine, plan = node.load("tiny-sd1.safetensors", "stream", 0.5, "fp32", "auto")
    assert engine.family == "sd1" and "policy stream" in plan
    engine2, _ = node.load("tiny-sd2", "lowvram", 4.0, "auto", "fp32")
    assert engine2.family == "sd2" and engine2.stage_device("text") == torch.device("cpu")


@pytest.mark.parametrize("args,match", [
    (("nope.safetensors", "full", 4.0, "auto", "auto"), "nope.safetensors"),
    (("../x.safetensors", "full", 4.0, "auto", "auto"), "outside"),
    (("tiny-random (test)", "full", 4.0, "fp8", "auto"), "weight_dtype='fp8': expected one of auto, fp16, bf16, fp32, "
                                                           "fp8_e4m3fn, fp8_e4m3fn_fast"),
    (("tiny-random (test)", "full", 4.0, "auto", "int8"), "vae_dtype='int8'"),
    (("tiny-random (test)", "turbo", 4.0, "auto", "auto"), "vram_policy='turbo'"),
    (("tiny-random (test)", "full", float("inf"), "auto", "auto"), "vram_budget_gb=inf"),
    (("tiny-random (test)", "full", "4 GB", "auto", "auto"), "vram_budget_gb='4 GB'"),  # was float()'s bare error
])
def test_bad_inputs_give_clear_errors(models_dir, args, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
        LeanModelLoader().load(*args)


def test_load_reports_progress_and_honours_cancel_between_stages(models_dir, monkeypatch):
    """Three progress units (read/convert, parts, placement), each reached once; Cancel between stages stops the
    load with no engine made (the placement stage never runs after a cancel in the first stage)."""
    from leandiffusion import bridge

    events = []

    class Bar:
        def __init__(self, total, desc="", quiet=False):
            events.append(("total", total))

        def update(self, n=1):
            events.append(("update", n))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(bridge, "ProgressBar", Bar)
    engine, _ = LeanModelLoader().load("tiny-sd1.safetensors", "full", 4.0, "auto", "auto")
    assert engine.family == "sd1"
    assert events == [("total", 3)] + [("update", 1)] * 3

    checks = []

    def cancel_at_second_check():
        checks.append(1)
        if len(checks) == 2:
            raise bridge.Interrupted("cancel")

    placed = []
    monkeypatch.setattr(load_mod, "build_engine", lambda *a, **k: placed.append(1))
    bridge.set_interrupt_hook(cancel_at_second_check)
    try:
        with pytest.raises(bridge.Interrupted):
            LeanModelLoader().load("tiny-sd1.safetensors", "full", 4.0, "auto", "auto")
    finally:
        bridge.set_interrupt_hook(None)
    assert len(checks) == 2 and not placed


def test_defaults_and_outputs_are_the_documented_ones():
    """docs/loader.md: every COMBO defaults to `auto`, the budget to 4.0 GB; outputs `lean_model` then `memory_plan`
    (saved workflows depend on the defaults and the output names)."""
    req = LeanModelLoader.INPUT_TYPES()["required"]
    assert [req[k][1]["default"] for k in ("vram_policy", "weight_dtype", "vae_dtype")] == ["auto"] * 3
    assert req["model"][1]["default"] == "tiny-random (test)"
    assert LeanModelLoader.RETURN_NAMES == ("lean_model", "memory_plan")


def test_an_upper_case_checkpoint_name_reruns_when_its_file_changes(tmp_path, monkeypatch):
    """The menu lists and the loader loads a ``.SAFETENSORS`` checkpoint (suffixes compared in lower case); its
    fingerprint must follow the file too (a case-sensitive suffix test in ``IS_CHANGED`` would look the name up as a
    diffusers folder, find none and never change)."""
    import os

    monkeypatch.setenv("LEANDIFFUSION_MODELS", str(tmp_path))
    path = tmp_path / "checkpoints" / "OLD.SAFETENSORS"
    path.parent.mkdir()
    path.write_bytes(b"first")
    assert "OLD.SAFETENSORS" in LeanModelLoader.INPUT_TYPES()["required"]["model"][0]
    first = LeanModelLoader.IS_CHANGED(model="OLD.SAFETENSORS")
    (tmp_path / "new").write_bytes(b"second, longer")
    os.replace(tmp_path / "new", path)
    assert LeanModelLoader.IS_CHANGED(model="OLD.SAFETENSORS") != first

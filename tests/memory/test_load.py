"""``memory/load.py`` beside the loader node's tests: names, dtypes and the engine's fields, checks before reading.

Guards: a checkpoint is one whatever its suffix's case; a model's display name is the file's stem or the folder's
own name; the weight and VAE dtypes each follow their own input, and the engine keeps the placement's text dtype
and pool; a bad ``vae_dtype`` is refused before the file is read; Cancel before the read reads nothing.
"""
from __future__ import annotations

import pytest
import torch

from leandiffusion import bridge
from leandiffusion.memory import load as load_mod
from leandiffusion.tests.kit import save_diffusers_folder, save_ldm_checkpoint, tiny_components, tiny_parts


@pytest.fixture()
def models_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LEANDIFFUSION_MODELS", str(tmp_path))
    return tmp_path


def test_display_names_are_the_files_stem_and_the_folders_own_name(models_dir):
    save_ldm_checkpoint(tiny_components("sd1"), models_dir / "checkpoints" / "my-model.safetensors")
    save_diffusers_folder(tiny_components("sd1"), models_dir / "diffusers" / "org" / "tiny-nested")
    assert load_mod.load_components("my-model.safetensors")[1] == "my-model"
    (models_dir / "checkpoints" / "my-model.safetensors").rename(models_dir / "checkpoints" / "Upper.SAFETENSORS")
    components, name = load_mod.load_components("Upper.SAFETENSORS")  # a checkpoint whatever the suffix's case
    assert name == "Upper" and components["family"] == "sd1"
    assert load_mod.load_components("org/tiny-nested")[1] == "tiny-nested"


def test_each_dtype_follows_its_own_input_and_the_engine_keeps_the_placements_fields():
    engine = load_mod.build_engine(tiny_parts("sd1"), "lowvram", 4.0, weight_dtype="bf16", vae_dtype="fp16",
                                   device="cpu")
    assert (engine.dtype, engine.vae_dtype, engine.text_dtype) == (torch.bfloat16, torch.float16, torch.float32)
    assert engine.dtype_for("text") == torch.float32  # lowvram runs the text encoders on the CPU in fp32
    assert engine.pool is not None and engine.placement.pool is engine.pool
    assert engine.plan == engine.placement.report() and "policy lowvram" in engine.plan


def test_a_bad_vae_dtype_is_refused_before_the_file_is_read(monkeypatch):
    read = []
    monkeypatch.setattr(load_mod, "load_components", lambda choice: read.append(choice) or {})
    with pytest.raises(ValueError, match="vae_dtype='fp8': expected one of auto, fp32, fp16, bf16"):
        load_mod.load_engine("tiny-random (test)", "full", 4.0, "auto", "fp8", device="cpu")
    assert read == []


def test_cancel_before_the_read_reads_nothing(monkeypatch):
    read = []
    monkeypatch.setattr(load_mod, "load_components", lambda choice: read.append(choice) or {})
    bridge.set_interrupt_hook(lambda: (_ for _ in ()).throw(bridge.Interrupted("cancel")))
    try:
        with pytest.raises(bridge.Interrupted):
            load_mod.load_engine("tiny-random (test)", "full", 4.0, device="cpu")
    finally:
        bridge.set_interrupt_hook(None)
    assert read == []

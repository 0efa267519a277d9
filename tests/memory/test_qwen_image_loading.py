"""Qwen-Image loads as the family ``qwen_image`` from a QwenImagePipeline folder, under every VRAM policy (what
``stream`` computes: ``test_qwen_image_policies.py``), and the VRAM planner sizes its dual-stream blocks. Guards:
the family comes from ``model_index.json``, never from the folder's name; Qwen-Image-Edit folders are refused with
errors naming the input, the reason and what works, before anything is placed; a damaged folder names the
sub-folder to re-download."""
import json
import shutil

import pytest
import torch

from leandiffusion.memory.families import UnsupportedFamilyError
from leandiffusion.memory.folders import load_diffusers_folder
from leandiffusion.memory.load import load_engine
from leandiffusion.memory.policies import default_dtype, default_working_shape
from leandiffusion.memory.tiny_qwen_image import build_tiny_qwen_image, save_qwen_image_folder
from leandiffusion.memory.units import trace_units


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    built = build_tiny_qwen_image(seed=3)
    return save_qwen_image_folder(built, tmp_path_factory.mktemp("qwen") / "src"), built


@pytest.fixture()
def models(tmp_path, monkeypatch, saved):
    """``copy(name, damage)``: the saved folder under ``diffusers/name``, damaged by ``damage(folder)``."""
    monkeypatch.setenv("LEANDIFFUSION_MODELS", str(tmp_path))

    def copy(name, damage=lambda folder: None):
        folder = tmp_path / "diffusers" / name
        shutil.copytree(saved[0], folder)
        damage(folder)
        return folder
    return copy


def _set_class(name):
    def damage(folder):
        index = json.loads((folder / "model_index.json").read_text())
        (folder / "model_index.json").write_text(json.dumps({**index, "_class_name": name}))
    return damage


def _assert_same_weights(want: torch.nn.Module, got: torch.nn.Module, what: str):
    want, got = want.state_dict(), got.state_dict()
    assert want.keys() == got.keys(), what
    for key in want:
        assert torch.equal(want[key], got[key]), (what, key)


def test_folder_loads_as_qwen_image_with_identical_weights(saved):
    from diffusers import FlowMatchEulerDiscreteScheduler

    folder, built = saved
    loaded = load_diffusers_folder(folder)
    assert loaded["family"] == "qwen_image"
    _assert_same_weights(built["transformer"], loaded["transformer"], "transformer")
    _assert_same_weights(built["vae"], loaded["vae"], "vae")
    # the text stage keeps the language model only: the vision tower and LM head are not read by text-to-image
    _assert_same_weights(built["text_encoder"].model.language_model, loaded["text_encoder"], "text_encoder")
    assert not hasattr(loaded["text_encoder"], "visual") and not hasattr(loaded["text_encoder"], "lm_head")
    reference = FlowMatchEulerDiscreteScheduler.from_pretrained(str(folder / "scheduler")).config
    for key, value in loaded["scheduler_config"].items():
        assert reference[key] == value, key
    assert reference["use_dynamic_shifting"] and reference["shift_terminal"] == 0.02
    assert loaded["tokenizer"]("a cat").input_ids == built["tokenizer"]("a cat").input_ids


@pytest.mark.parametrize("name", ["tiny-zimage", "sdxl-base-1.0", "qwen-image-edit"])
def test_the_family_comes_from_the_files_not_the_name(models, name):
    engine = load_engine(models(name).name, "full", device="cpu")
    assert engine.family == "qwen_image" and engine.parts.is_flow


@pytest.mark.parametrize("cls", ["QwenImageEditPipeline", "QwenImageEditPlusPipeline"])
def test_edit_folders_are_refused_as_not_supported_yet(models, cls, opened_sessions):
    folder = models("my-model", _set_class(cls))
    with pytest.raises(UnsupportedFamilyError, match=rf"model='my-model': detected family 'qwen_image_edit' .*{cls}"
                                                     r".*not supported yet; Qwen-Image text-to-image folders"):
        load_engine(folder.name, "full", device="cpu")
    assert opened_sessions == []


@pytest.mark.parametrize("policy", ["full", "balanced", "lowvram", "stream"])
def test_loads_under_every_policy(models, policy):
    engine = load_engine(models("tiny-qwen").name, policy, device="cpu")
    assert engine.placement.name == policy and engine.family == "qwen_image"
    assert f"policy {policy}" in engine.plan and "(qwen_image)" in engine.plan
    assert engine.dtype == torch.float32 and engine.text_dtype == torch.float32  # the CPU computes in fp32


@pytest.mark.parametrize("part", ["transformer", "text_encoder", "vae", "tokenizer"])
def test_a_missing_sub_folder_names_it_and_the_fix(models, part):
    folder = models("broken", lambda f: shutil.rmtree(f / part))
    with pytest.raises(UnsupportedFamilyError, match=rf"model='broken': the Qwen-Image folder has no '{part}' "
                                                     r"sub-folder \(incomplete download\); re-download the whole"):
        load_diffusers_folder(folder)


def test_a_truncated_weight_file_names_the_sub_folder_and_the_fix(models):
    def truncate(folder):
        weights = next((folder / "transformer").glob("*.safetensors"))
        weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"model='cut': the 'transformer' sub-folder could not be loaded .*"
                                         r"re-download or re-save the folder"):
        load_diffusers_folder(models("cut", truncate))


def test_units_are_the_joint_blocks_sized_for_image_and_text_tokens(saved):
    dit = saved[1]["transformer"]
    small, large = trace_units(dit, (1, 16, 16), torch.float32), trace_units(dit, (1, 32, 32), torch.float32)
    assert [u.name for u in small] == ["transformer_blocks.0", "transformer_blocks.1"]
    assert small[0].nbytes >= sum(p.numel() * 4 for p in dit.transformer_blocks[0].parameters())
    assert large[0].flops > small[0].flops and large[0].out_numel > small[0].out_numel


def test_defaults_bf16_on_cuda_and_native_working_shape(saved):
    from leandiffusion.memory.engine import parts_from_components

    parts = parts_from_components(build_tiny_qwen_image())
    assert default_dtype("qwen_image", torch.device("cuda")) == torch.bfloat16
    assert default_working_shape(parts) == (2, 166, 166)  # 1328 px, Qwen-Image's square size

"""Family detection by the declarative registry, SD2's v/eps rule, and clear errors for bad files.

Guards the acceptance line "a truncated or non-checkpoint file ... and an unknown family each give a clear error".
"""
import pytest
import torch

from leandiffusion.memory import families
from leandiffusion.memory.families import UnsupportedFamilyError, detect_family, sd2_prediction_type
from leandiffusion.memory.ldm import load_ldm_checkpoint, read_header
from leandiffusion.memory.tokenizers import find_tokenizer_dir
from leandiffusion.tests.kit import ldm_state_dict, save_ldm_checkpoint, tiny_components


@pytest.fixture(scope="module")
def shapes():
    return {fam: {k: tuple(v.shape) for k, v in ldm_state_dict(tiny_components(fam)).items()}
            for fam in ("sd1", "sd2", "sdxl")}


def test_supported_families_detected(shapes):
    assert {fam: detect_family(s).name for fam, s in shapes.items()} == {"sd1": "sd1", "sd2": "sd2", "sdxl": "sdxl"}


@pytest.mark.parametrize("extra,name", [
    ({"model.diffusion_model.joint_blocks.0.context_block.adaLN_modulation.1.bias": (9216,)}, "sd3"),
    ({"double_blocks.0.img_attn.norm.key_norm.scale": (128,)}, "flux"),
    ({"conditioner.embedders.0.model.text_projection": (1280, 1280)}, "sdxl-refiner"),
])
def test_unsupported_families_named(shapes, extra, name):
    with pytest.raises(UnsupportedFamilyError, match=f"'{name}'"):
        detect_family({**shapes["sdxl"], **extra})


def test_inpainting_unet_refused(shapes):
    s = dict(shapes["sd1"])
    s["model.diffusion_model.input_blocks.0.0.weight"] = (32, 9, 3, 3)
    with pytest.raises(UnsupportedFamilyError, match="inpaint"):
        detect_family(s)


def test_unknown_and_partial_files_explained(shapes):
    with pytest.raises(UnsupportedFamilyError, match="LoRA"):
        detect_family({"lora_unet_down_blocks_0.lora_down.weight": (4, 32)})
    unet_only = {k: v for k, v in shapes["sd1"].items() if k.startswith("model.diffusion_model.")}
    with pytest.raises(UnsupportedFamilyError, match="text encoders"):
        detect_family(unet_only)
    with pytest.raises(UnsupportedFamilyError, match="no tensors"):
        detect_family({})


def test_flux_by_diffusers_fallback_names_family():
    with pytest.raises(UnsupportedFamilyError, match="flux"):
        detect_family({"double_blocks.0.img_attn.norm.key_norm.scale": (128,)})


def test_sd2_prediction_rule(tmp_path):
    assert sd2_prediction_type({"v_pred": (0,)}) == "v_prediction"
    assert sd2_prediction_type({}, tmp_path / "v2-1_768-ema-pruned.safetensors") == "v_prediction"
    assert sd2_prediction_type({}, tmp_path / "sd21-v.safetensors") == "v_prediction"
    assert sd2_prediction_type({}, tmp_path / "v2-1_512-ema-pruned.safetensors") == "epsilon"
    assert sd2_prediction_type({}, tmp_path / "dreamvision.safetensors") == "epsilon"
    (tmp_path / "mine.yaml").write_text("model:\n  params:\n    parameterization: \"v\"\n")
    assert sd2_prediction_type({}, tmp_path / "mine.safetensors") == "v_prediction"


def test_sd2_sidecar_with_another_parameterization_means_epsilon(tmp_path):
    """``parameterization: "eps"`` (or any value but v) in the sidecar is epsilon, over a name that says 768 and
    over ComfyUI's weight test; only ``v`` means v-prediction."""
    for value in ('"eps"', "eps", "'x0'"):
        (tmp_path / "model_768-v.yaml").write_text(f"model:\n  params:\n    parameterization: {value}\n")
        assert sd2_prediction_type({}, tmp_path / "model_768-v.safetensors") == "epsilon", value
    (tmp_path / "model_768-v.yaml").write_text("model:\n  params:\n    parameterization: V  # v2-inference-v\n")
    assert sd2_prediction_type({}, tmp_path / "model_768-v.safetensors") == "v_prediction"


def test_truncated_file_clear_error(tmp_path):
    path = save_ldm_checkpoint(tiny_components("sd1"), tmp_path / "t.safetensors")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated"):
        load_ldm_checkpoint(path)


def test_non_checkpoint_file_clear_error(tmp_path):
    path = tmp_path / "notes.safetensors"
    path.write_text("this is not a model")
    with pytest.raises(ValueError, match="not a safetensors checkpoint"):
        read_header(path)


def test_lora_like_safetensors_refused(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "lora.safetensors"
    save_file({"lora_unet_x.lora_down.weight": torch.zeros(4, 8)}, str(path))
    (tmp_path / "tokenizer").mkdir()
    with pytest.raises(UnsupportedFamilyError, match="LoRA"):
        load_ldm_checkpoint(path)


def test_missing_tokenizer_says_where(tmp_path):
    path = save_ldm_checkpoint(tiny_components("sd1"), tmp_path / "m.safetensors", tokenizer=False)
    with pytest.raises(ValueError, match="vocab.json and merges.txt"):
        load_ldm_checkpoint(path)


@pytest.mark.parametrize("vocab", ["{not json", "[1, 2]", ""])
def test_damaged_tokenizer_files_are_one_named_error_before_the_weights_are_read(tmp_path, monkeypatch, vocab):
    """A damaged vocab.json makes the tokenizers library raise a plain ``Exception`` ("Error while initializing
    BPE") that names no file; the loader names the file, before the whole checkpoint is read and converted."""
    from leandiffusion.memory import ldm

    path = save_ldm_checkpoint(tiny_components("sd1"), tmp_path / "m.safetensors")
    (tmp_path / "tokenizer" / "vocab.json").write_text(vocab)
    read = []
    monkeypatch.setattr(ldm, "read_tensors", lambda p: read.append(p) or {})
    with pytest.raises(ValueError, match=rf"tokenizer files in {tmp_path / 'tokenizer'} could not be loaded \(.*\); "
                                         r"replace them with CLIP's vocab.json and merges.txt"):
        load_ldm_checkpoint(path)
    assert read == [], "the checkpoint's tensors were read before the tokenizer was checked"


def test_comfy_tokenizer_fallback(tmp_path, monkeypatch):
    from leandiffusion import bridge
    from leandiffusion.memory.tiny import write_tiny_clip_tokenizer

    comfy_dir = write_tiny_clip_tokenizer(tmp_path / "comfy" / "sd1_tokenizer")
    monkeypatch.setattr(bridge, "comfy_tokenizer_dir", lambda: comfy_dir)
    assert find_tokenizer_dir(tmp_path / "model" / "m.safetensors") == comfy_dir


# The explanations for files that are no SD checkpoint.
# AuraFlow's marker keys in diffusers' CHECKPOINT_KEY_NAMES (a family our registry does not list)
AURAFLOW = {k: (8, 8) for k in ("double_layers.0.attn.w2q.weight", "double_layers.0.attn.w1q.weight",
                                "cond_seq_linear.weight", "t_embedder.mlp.0.weight")}


# The SD x4 upscaler's marker key in the same table: in diffusers 0.30 (the floor) too, whose table has no AuraFlow
# (its infer_diffusers_model_type calls AURAFLOW "v1", which says nothing and so is not repeated).
X4_UPSCALER = {"model.diffusion_model.input_blocks.10.0.skip_connection.bias": (8,)}


def test_family_known_only_to_diffusers_is_named():
    from diffusers.loaders.single_file_utils import infer_diffusers_model_type

    assert infer_diffusers_model_type(X4_UPSCALER) == "upscale"  # the premise, in the diffusers that runs the test
    with pytest.raises(UnsupportedFamilyError, match=r"checkpoint: detected family 'upscale' \(by diffusers' key "
                                                     r"table\), which LeanDiffusion does not run; supported families"):
        detect_family(X4_UPSCALER)


def test_text_encoder_only_file_says_what_it_lacks(shapes):
    clip_only = {k: v for k, v in shapes["sd1"].items() if k.startswith("cond_stage_model.")}
    with pytest.raises(UnsupportedFamilyError, match=r"not a complete SD1.x/SD2.x/SDXL checkpoint: it lacks a UNet "
                                                     r"\(model.diffusion_model.\*\), a VAE \(first_stage_model.\*\) "
                                                     r"\(first keys: cond_stage_model.*\); use an all-in-one"):
        detect_family(clip_only)


def test_unet_input_of_the_wrong_rank_is_not_taken_for_sd1(shapes):
    """An SD-like file whose UNet input layer is not a 4-D conv would match SD1 by its second axis alone and then
    fail inside the conversion; the rank check keeps it out and the file is reported as unknown."""
    odd = dict(shapes["sd1"])
    odd[families.UNET_IN] = (32, 4)
    with pytest.raises(UnsupportedFamilyError, match=r"unknown checkpoint family \(first keys: .*\); supported: "
                                                     r"SD1.x, SD2.x, SDXL base"):
        detect_family(odd)


@pytest.mark.parametrize("how", ["missing", "raises"])
def test_without_diffusers_key_table_the_file_is_still_explained(monkeypatch, how):
    """diffusers' ``infer_diffusers_model_type`` is internal API: when it is gone or fails on a file, the
    explanation falls back to what the file lacks instead of failing with diffusers' error."""
    from diffusers.loaders import single_file_utils

    if how == "missing":
        monkeypatch.delattr(single_file_utils, "infer_diffusers_model_type")
    else:
        def broken(checkpoint):
            raise KeyError("double_layers.0.attn.w2q.weight")
        monkeypatch.setattr(single_file_utils, "infer_diffusers_model_type", broken)
    with pytest.raises(UnsupportedFamilyError, match=r"it lacks a UNet .*, a VAE .*, text encoders"):
        detect_family(AURAFLOW)

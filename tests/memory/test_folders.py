"""diffusers folders (``memory/folders.py``): the folders the loader refuses, each with one error naming the model,
what is wrong and what to do, and the tokenizer fallback for folders that carry no tokenizer files.

Guards:
- a folder without its own tokenizer files is named in the error (not a file inside it, such as
  ``model_index.json``), which asks for ``<folder>/tokenizer/``;
- inside ComfyUI such a folder takes ComfyUI's bundled CLIP files; SD2's and SDXL's OpenCLIP towers still pad
  with ``!``, so the token ids equal those of the folder's own tokenizers.
"""
import json
import shutil

import pytest

from leandiffusion import bridge
from leandiffusion.memory.families import UnsupportedFamilyError
from leandiffusion.memory.folders import load_diffusers_folder
from leandiffusion.nodes.loader import LeanModelLoader
from leandiffusion.tests.kit import save_diffusers_folder, tiny_components, tiny_tokenizer_dir


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("diffusers-src")
    return {fam: save_diffusers_folder(tiny_components(fam), root / fam) for fam in ("sd1", "sd2", "sdxl")}


@pytest.fixture()
def models(tmp_path, monkeypatch, saved):
    """``variant(name, family, damage)``: a copy of the saved family's folder under ``diffusers/name``, damaged."""
    monkeypatch.setenv("LEANDIFFUSION_MODELS", str(tmp_path))
    monkeypatch.setattr(bridge, "comfy_tokenizer_dir", lambda: None)  # outside ComfyUI, whatever runs the tests

    def variant(name, family, damage=lambda folder: None):
        folder = tmp_path / "diffusers" / name
        shutil.copytree(saved[family], folder)
        damage(folder)
        return folder
    return variant


def _load(name):
    return LeanModelLoader().load(name, "full", 4.0, "fp32", "auto")


def _set_class(name):
    def damage(folder):
        index = json.loads((folder / "model_index.json").read_text())
        index["_class_name"] = name
        (folder / "model_index.json").write_text(json.dumps(index))
    return damage


def _nine_channel_unet(folder):
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(str(folder / "unet"))
    UNet2DConditionModel.from_config({**unet.config, "in_channels": 9}).save_pretrained(folder / "unet")


@pytest.mark.parametrize("name,family,damage,error,match", [
    ("listed", "sd1", lambda f: (f / "model_index.json").write_text("[1, 2]"), ValueError,
     r"model='listed': its model_index.json holds list, not the pipeline's component table; re-download"),
    ("sd3", "sd1", _set_class("StableDiffusion3Pipeline"), UnsupportedFamilyError,
     r"model='sd3': detected family 'sd3 \(Stable Diffusion 3 / 3.5\)' \(StableDiffusion3Pipeline\), which "
     r"LeanDiffusion does not run; supported families are SD1.x, SD2.x and SDXL base"),
    ("audio", "sd1", _set_class("AudioLDMPipeline"), UnsupportedFamilyError,
     r"model='audio': pipeline class 'AudioLDMPipeline' is not an SD1.x/SD2.x/SDXL or Z-Image text-to-image pipeline"),
    ("refiner", "sdxl", lambda f: shutil.rmtree(f / "text_encoder"), UnsupportedFamilyError,
     r"model='refiner': the folder has no 'text_encoder' sub-folder \(an SDXL refiner \(no first text encoder\)\)"),
    ("no_vae", "sd1", lambda f: shutil.rmtree(f / "vae"), UnsupportedFamilyError,
     r"model='no_vae': the folder has no 'vae' sub-folder \(incomplete\)"),
    ("inpaint", "sd1", _nine_channel_unet, UnsupportedFamilyError,
     r"model='inpaint': UNet with 9 input channels \(inpainting/upscaler/pix2pix family\) is not supported"),
    ("no_tok", "sd1", lambda f: shutil.rmtree(f / "tokenizer"), ValueError,
     r"model='no_tok': no CLIP tokenizer files found \(this diffusers folder has none\); inside ComfyUI they come "
     r"from comfy/sd1_tokenizer. Outside ComfyUI put CLIP's vocab.json and merges.txt in .*no_tok/tokenizer$"),
])
def test_refused_folders_name_the_model_and_the_reason(models, name, family, damage, error, match):
    models(name, family, damage)
    with pytest.raises(error, match=match):
        _load(name)


def test_a_folder_without_model_index_is_not_taken_for_a_diffusers_folder(models):
    folder = models("plain", "sd1", lambda f: (f / "model_index.json").unlink())
    with pytest.raises(ValueError, match=r"model='plain': .*plain has no model_index.json, so it is not a diffusers"):
        _load("plain")
    with pytest.raises(ValueError, match="no model_index.json"):
        load_diffusers_folder(folder)


def _ids(tokenizer):
    return tokenizer(["a red cube, (blue) sky!"], padding="max_length", max_length=77).input_ids


def _reference_ids(bpe_dir, openclip: bool):
    """transformers' own CLIPTokenizer over the same BPE files, padding as the tower's family does."""
    from transformers import CLIPTokenizer

    return _ids(CLIPTokenizer.from_pretrained(str(bpe_dir), pad_token="!" if openclip else "<|endoftext|>"))


TOWERS = {"sd1": {"tokenizer": False}, "sd2": {"tokenizer": True}, "sdxl": {"tokenizer": False, "tokenizer_2": True}}


@pytest.mark.parametrize("family", ["sd1", "sd2", "sdxl"])
def test_a_folder_without_tokenizers_takes_comfyuis_files_padded_per_tower(models, monkeypatch, tmp_path, family):
    bare = models(f"bare-{family}", family, lambda f: [shutil.rmtree(f / sub, ignore_errors=True)
                                                       for sub in ("tokenizer", "tokenizer_2")])
    comfy = tiny_tokenizer_dir(tmp_path / "comfy" / "sd1_tokenizer")  # ComfyUI ships CLIP's BPE files
    monkeypatch.setattr(bridge, "comfy_tokenizer_dir", lambda: comfy)
    loaded = load_diffusers_folder(bare)
    for key, openclip in TOWERS[family].items():  # OpenCLIP towers pad with '!' (id 0), CLIP-L with the end token
        assert _ids(loaded[key]) == _reference_ids(comfy, openclip), key


def test_an_sdxl_folder_without_tokenizer_2_reuses_its_tokenizer_files_padded_for_openclip(models):
    def damage(folder):
        shutil.rmtree(folder / "tokenizer_2")
        shutil.rmtree(folder / "tokenizer")
        tiny_tokenizer_dir(folder / "tokenizer")  # vocab.json + merges.txt, as the folders on the hub have them
    folder = models("half", "sdxl", damage)
    loaded = load_diffusers_folder(folder)
    assert _ids(loaded["tokenizer"]) == _reference_ids(folder / "tokenizer", openclip=False)
    assert _ids(loaded["tokenizer_2"]) == _reference_ids(folder / "tokenizer", openclip=True)


@pytest.mark.parametrize("family, engine_family", [("sd1", "sd1"), ("sd2", "sd2-v")])
def test_a_folders_own_scheduler_settings_win_over_the_family_defaults(models, family, engine_family):
    """A folder saved for v-prediction on the zero-terminal-SNR schedule keeps those settings (diffusers'
    ``DDIMScheduler.from_pretrained`` reads the same folder as the reference); an SD2 folder with a v-prediction
    scheduler is the ``sd2-v`` family."""
    from diffusers import DDIMScheduler

    def damage(folder):
        path = folder / "scheduler" / "scheduler_config.json"
        config = json.loads(path.read_text())
        config.update(prediction_type="v_prediction", rescale_betas_zero_snr=True, timestep_spacing="trailing",
                      steps_offset=0)
        path.write_text(json.dumps(config))
    folder = models(f"zsnr-{family}", family, damage)
    loaded = load_diffusers_folder(folder)
    reference = DDIMScheduler.from_pretrained(str(folder / "scheduler")).config
    for key in ("prediction_type", "rescale_betas_zero_snr", "timestep_spacing", "steps_offset"):
        assert loaded["scheduler_config"][key] == reference[key], key
    assert reference["prediction_type"] == "v_prediction" and reference["rescale_betas_zero_snr"] is True
    assert loaded["family"] == engine_family

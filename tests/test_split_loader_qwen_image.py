"""Memory Pool Loader (split files) with Qwen-Image: ComfyUI's three files (DiT, Qwen2.5-VL, Wan-layout VAE) load
into the same model as the diffusers folder they were written from, bf16 and fp8, and give the folder's LATENT;
a file of another model or part in any input is refused naming the input before any tensor is read.

References are independent of the loader: the diffusers folder loaded by ``from_pretrained`` and the Fused Flow
Sampler run on it; the split files are written by the kit's hand-written inverse layouts.
"""
import pytest
import torch

from leandiffusion import bridge
from leandiffusion.memory import split_files
from leandiffusion.memory.folders import load_qwen_image_folder
from leandiffusion.memory.tiny_qwen_image import build_tiny_qwen_image, save_qwen_image_folder
from leandiffusion.memory.tiny_zimage import build_tiny_zimage
from leandiffusion.nodes.flow import LeanFlowSampler
from leandiffusion.nodes.loader import LeanModelLoader
from leandiffusion.nodes.split_loader import LeanSplitModelLoader
from leandiffusion.tests.kit import qwen_image_split as kit
from leandiffusion.tests.kit import tiny_components
from leandiffusion.tests.kit import zimage_split as zkit

GRIDS = ("bf16", "fp8", "fp8_scaled")


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    """A models folder with a tiny Qwen-Image diffusers folder per precision grid and its split files, plus a
    tiny Z-Image's split files and an SD1 model's parts (the wrong files)."""
    root = tmp_path_factory.mktemp("models")
    refs, names = {}, {}
    for grid in GRIDS:
        components = kit.qwen_grid(build_tiny_qwen_image(seed=3), grid)
        save_qwen_image_folder(components, root / "diffusers" / f"tiny-qwen-{grid}")
        refs[grid] = components
        names[grid] = kit.write_split_files(components, root, grid, dtype=grid, comfy=grid != "fp8")
    zimage = zkit.bf16_grid(build_tiny_zimage(seed=2))
    names["zimage"] = zkit.write_split_files(zimage, root, "zimage", comfy=True)
    sd1 = tiny_components("sd1")
    names["sd1"] = {
        "diffusion_model": zkit.write_single({"model.diffusion_model." + k: v for k, v in
                                              _ldm_unet_stub().items()}, root / "diffusion_models" / "sd1.safetensors"),
        "text_encoder": zkit.write_single({"text_model." + k.removeprefix("text_model."): v for k, v in
                                           sd1["text_encoder"].state_dict().items()},
                                          root / "text_encoders" / "sd1.safetensors"),
        "vae": zkit.write_single(zkit.vae_original(sd1["vae"].state_dict()), root / "vae" / "sd1.safetensors")}
    return root, refs, names


def _ldm_unet_stub() -> dict:
    return {"input_blocks.0.0.weight": torch.zeros(8, 4, 3, 3), "label_emb.0.0.weight": torch.zeros(8, 8)}


@pytest.fixture
def models(library, monkeypatch):
    monkeypatch.setenv(bridge.MODELS_ENV, str(library[0]))
    monkeypatch.setattr(bridge, "comfy_qwen_tokenizer_dir", lambda: None)
    return library


def _load(names, weight_dtype="fp32"):
    return LeanSplitModelLoader().load(names["diffusion_model"], names["text_encoder"], names["vae"], "full", 4.0,
                                       weight_dtype, "fp32")[0]


def _plain(config) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dict(config).items() if not k.startswith("_")}


@pytest.mark.parametrize("grid", GRIDS)
def test_split_files_hold_the_diffusers_folders_weights(models, grid):
    root, _, names = models
    ours = split_files.load_split_components(**names[grid])
    ref = load_qwen_image_folder(root / "diffusers" / f"tiny-qwen-{grid}")
    assert ours["family"] == "qwen_image"
    assert ours["scheduler_config"].items() <= ref["scheduler_config"].items()  # the rest: the class defaults
    # the file carries the vision tower (visual.*), so the split text stage is the whole Qwen2.5-VL (it can edit:
    # tests/test_split_loader_qwen_edit.py); its language model is the folder's text encoder
    ours["text_encoder"] = ours["text_encoder"].language_model
    assert type(ours["text_encoder"]) is type(ref["text_encoder"])
    for part in ("transformer", "text_encoder", "vae"):
        if part != "text_encoder":
            assert _plain(ours[part].config) == _plain(ref[part].config), part
        a, b = ours[part].state_dict(), ref[part].state_dict()
        assert set(a) == set(b), part
        for key in a:
            assert torch.equal(a[key].float(), b[key].float()), (part, key)
    cfg, rcfg = ours["text_encoder"].config, ref["text_encoder"].config
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "rms_norm_eps", "rope_parameters"):
        assert getattr(cfg, key) == getattr(rcfg, key), key


@pytest.mark.parametrize("grid", ["bf16", "fp8"])
def test_split_files_sample_the_folders_latent(models, grid):
    _, _, names = models
    split = _load(names[grid])
    folder, _ = LeanModelLoader().load(f"tiny-qwen-{grid}", "full", 4.0, "fp32", "fp32")
    args = ("a fox in the snow", "blurry", 7, 3, 4.0, 48, 32, 2, "none")
    ours = LeanFlowSampler().run(split, *args)[0]["samples"]
    ref = LeanFlowSampler().run(folder, *args)[0]["samples"]
    assert ours.shape == (2, 16, 4, 6) and ref.abs().max().item() > 1.0
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)


def _swap(names, grid, arg, other):
    return dict(names[grid], **{arg: names[other][arg]})


@pytest.mark.parametrize("arg,other,match", [
    ("diffusion_model", "zimage", r"^diffusion_model='zimage_diffusion_model.safetensors': detected a Z-Image DiT "
                                  r".*, which Qwen-Image does not use; pick the Qwen-Image diffusion model"),
    ("text_encoder", "zimage", r"^text_encoder='zimage_text_encoder.safetensors': detected a Qwen3 text encoder "
                               r".*, which Qwen-Image does not use; pick the Qwen2.5-VL-7B text encoder"),
    ("vae", "zimage", r"^vae='zimage_vae.safetensors': detected a VAE \(original layout\), which Qwen-Image does not "
                      r"use; pick the Qwen-Image VAE"),
    ("diffusion_model", "sd1", r"^diffusion_model='sd1.safetensors': detected a Stable Diffusion / SDXL UNet, which "
                               r"Qwen-Image does not use"),
    ("text_encoder", "sd1", r"^text_encoder='sd1.safetensors': detected a CLIP text encoder .*, which Qwen-Image "
                            r"does not use; pick the Qwen2.5-VL-7B"),
    ("vae", "sd1", r"^vae='sd1.safetensors': detected a VAE \(original layout\), which Qwen-Image does not use"),
])
def test_another_models_file_in_an_input_is_refused_naming_it(models, monkeypatch, arg, other, match):
    _, _, names = models
    monkeypatch.setattr(split_files, "read_tensors", lambda *a: pytest.fail("tensors were read"))
    with pytest.raises(ValueError, match=match):
        split_files.load_split_components(**_swap(names, "bf16", arg, other))


def test_a_non_qwen25_text_encoder_and_a_wan22_vae_are_refused(models, monkeypatch):
    root, _, names = models
    monkeypatch.setattr(split_files, "read_tensors", lambda *a: pytest.fail("tensors were read"))
    zkit.write_single({"model.embed_tokens.weight": torch.zeros(300, 48),
                       "model.layers.0.self_attn.q_proj.weight": torch.zeros(48, 48),
                       "model.layers.0.self_attn.q_proj.bias": torch.zeros(48),
                       "model.layers.0.self_attn.k_proj.bias": torch.zeros(16)},
                      root / "text_encoders" / "wide.safetensors")
    with pytest.raises(ValueError, match=r"^text_encoder='wide.safetensors': a Qwen2.5 of hidden size 48, but the "
                                         r"diffusion model reads text of width 32"):
        split_files.load_split_components(**dict(names["bf16"], text_encoder="wide.safetensors"))
    zkit.write_single({"encoder.conv1.weight": torch.zeros(8, 12, 3, 3, 3),
                       "decoder.conv1.weight": torch.zeros(8, 48, 3, 3, 3),
                       "decoder.middle.0.residual.0.gamma": torch.zeros(8, 1, 1, 1)},
                      root / "vae" / "wan22.safetensors")
    with pytest.raises(ValueError, match=r"^vae='wan22.safetensors': a video VAE with 48 latent channels"):
        split_files.load_split_components(**dict(names["bf16"], vae="wan22.safetensors"))


def test_a_qwen_image_2_1_dit_is_refused_as_not_used(models, monkeypatch):
    root, _, names = models
    zkit.write_single({"txt_norm.weight": torch.zeros(32), "txt_in.text_norm.weight": torch.zeros(32),
                       "transformer_blocks.0.img_mlp.gate_up.weight": torch.zeros(8, 8)},
                      root / "diffusion_models" / "q21.safetensors")
    with pytest.raises(ValueError, match=r"^diffusion_model='q21.safetensors': detected a Qwen-Image 2.1 MMDiT"):
        split_files.load_split_components(**dict(names["bf16"], diffusion_model="q21.safetensors"))


def test_the_tokenizer_comes_from_a_qwen_image_folder_not_a_zimage_one(models, monkeypatch):
    from leandiffusion.memory.qwen_tokenizer import find_qwen_tokenizer_dir

    root, _, _ = models
    assert find_qwen_tokenizer_dir("qwen_image").parent.name.startswith("tiny-qwen-")
    monkeypatch.setattr(bridge, "list_models", lambda *a, **k: [])
    with pytest.raises(ValueError, match=r"Qwen-Image \(Qwen/Qwen-Image\) diffusers model"):
        find_qwen_tokenizer_dir("qwen_image")


def test_real_size_qwen_image_configs_are_inferred_from_shapes_alone():
    """Qwen/Qwen-Image's published transformer (60 blocks, 24 heads of 128, text width 3584, RoPE 16 + 56 + 56) and
    VAE configs (the class defaults) from meta-built modules' shape tables, no tensor allocated."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    from leandiffusion.memory import qwen_image_layouts as layouts
    from leandiffusion.memory.keyrules import shapes_of

    with torch.device("meta"):
        dit = QwenImageTransformer2DModel(num_layers=60)
        vae = AutoencoderKLQwenImage()
    inferred = layouts.transformer_config(shapes_of(dit.state_dict()))
    assert {k: _plain(dit.config)[k] for k in inferred} == _plain(inferred)
    assert inferred["axes_dims_rope"] == (16, 56, 56) and inferred["joint_attention_dim"] == 3584
    wan = shapes_of(convert_wan_vae_to_diffusers(kit.vae_wan(vae.state_dict())))
    assert wan == shapes_of(vae.state_dict())  # the kit's inverse and diffusers' converter agree at real size
    inferred = layouts.vae_config(wan)
    assert {k: _plain(vae.config)[k] for k in inferred} == _plain(inferred)

"""Split-file pieces: fp8 upcast rules, configs inferred from shapes, the layout registry and its refusals.

Guards: scaled fp8 means ``stored * scale`` rounded once to the file's precision; configs inferred from shapes build
the very modules the tiny Z-Image kit builds; a file of the wrong part, a non-Qwen3 text encoder or a 4-channel VAE
is refused naming the input, what was found and the fix, before any tensor is read.
"""
import pytest
import torch

from leandiffusion import bridge
from leandiffusion.memory import split_files
from leandiffusion.memory.fp8_upcast import upcast_dtype, upcast_fp8
from leandiffusion.memory.keyrules import shapes_of
from leandiffusion.memory.tiny_zimage import build_tiny_zimage, save_zimage_folder, transformer_config
from leandiffusion.memory.zimage_configs import qwen3_config, vae_config
from leandiffusion.memory.zimage_configs import transformer_config as inferred_transformer_config
from leandiffusion.tests.kit import tiny_components
from leandiffusion.tests.kit import zimage_split as kit

FP8 = torch.float8_e4m3fn


# ------------------------------------------------------------------------------------------------ fp8
def test_scaled_fp8_is_the_stored_values_times_the_scale_rounded_once():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(6, 5, generator=g) * 100).to(FP8)
    row = (torch.rand(6, generator=g) + 0.5) / 7
    tensors = {"a.weight": w, "a.scale_weight": torch.tensor(0.013), "b.weight": w, "b.weight_scale": row,
               "c.weight": w, "norm.weight": torch.ones(5, dtype=torch.bfloat16),
               "scaled_fp8": torch.zeros(0, dtype=FP8),
               "a.scale_input": torch.tensor(1.0), "b.comfy_quant": torch.zeros(3, dtype=torch.uint8)}
    out = upcast_fp8(tensors, "diffusion_model='x'")
    assert set(out) == {"a.weight", "b.weight", "c.weight", "norm.weight"}
    assert torch.equal(out["a.weight"], (w.float() * torch.tensor(0.013)).to(torch.bfloat16))
    assert torch.equal(out["b.weight"], (w.float() * row[:, None]).to(torch.bfloat16))
    assert torch.equal(out["c.weight"], w.to(torch.bfloat16))  # no scale: exact
    assert out["norm.weight"] is tensors["norm.weight"]


def test_the_upcast_takes_the_files_own_precision():
    w = torch.ones(2, 2, dtype=FP8)
    assert upcast_dtype({"w": w}) == torch.bfloat16  # all fp8
    assert upcast_dtype({"w": w, "n": torch.ones(2, dtype=torch.float16)}) == torch.float16
    assert upcast_dtype({"w": w, "n": torch.ones(2, dtype=torch.float16), "m": torch.ones(2)}) == torch.float32
    assert upcast_dtype({"w": w, "w.scale_weight": torch.ones(())}) == torch.bfloat16  # scales do not count
    out = upcast_fp8({"w.weight": w, "w.weight_scale": torch.tensor(1 / 3), "n": torch.ones(2)}, "vae='x'")
    assert out["w.weight"].dtype == torch.float32 and torch.equal(out["w.weight"], torch.full((2, 2), 1 / 3))


def test_block_wise_scales_are_refused_naming_the_input():
    tensors = {"a.weight": torch.ones(4, 4, dtype=FP8), "a.weight_scale": torch.ones(2, 2)}
    with pytest.raises(ValueError, match=r"^text_encoder='q.safetensors': a.weight_scale holds 4 scales .*"
                                         r"\(block-wise fp8"):
        upcast_fp8(tensors, "text_encoder='q.safetensors'")


# ------------------------------------------------------------------------------------------------ configs
def test_configs_inferred_from_shapes_are_the_kits():
    tiny = build_tiny_zimage(seed=1)
    dit = inferred_transformer_config(shapes_of(tiny["transformer"].state_dict()))
    want = transformer_config()
    assert {k: dit[k] for k in want} == {k: (list(v) if k == "axes_dims" else v) for k, v in want.items()}
    text = qwen3_config(shapes_of(tiny["text_encoder"].state_dict()))
    ref = tiny["text_encoder"].config
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps"):
        assert getattr(text, key) == getattr(ref, key), key
    assert text.rope_parameters["rope_theta"] == ref.rope_parameters["rope_theta"]
    vae = vae_config(shapes_of(tiny["vae"].state_dict()))
    for key in ("latent_channels", "block_out_channels", "layers_per_block", "norm_num_groups", "scaling_factor",
                "shift_factor", "use_quant_conv", "use_post_quant_conv", "down_block_types"):
        assert vae[key] == getattr(tiny["vae"].config, key) or tuple(vae[key]) == tuple(getattr(tiny["vae"].config,
                                                                                                  key)), key


def test_real_size_z_image_turbo_config_is_inferred_from_shapes_alone():
    """Z-Image-Turbo's published transformer config (30 + 2 layers, dim 3840, 30 heads of 128, caption 2560) from a
    shape table of its original-layout file (no tensor allocated)."""
    with torch.device("meta"):
        from diffusers import ZImageTransformer2DModel

        full = ZImageTransformer2DModel()
    cfg = inferred_transformer_config(shapes_of(full.state_dict()))
    for key, value in dict(full.config).items():
        if key in cfg:
            assert cfg[key] == value or list(cfg[key]) == list(value), key


# ------------------------------------------------------------------------------------------------ refusals
@pytest.fixture
def split_dir(tmp_path, monkeypatch):
    """A models folder with the tiny Z-Image's original-layout files plus a diffusers folder for the tokenizer."""
    components = kit.bf16_grid(build_tiny_zimage(seed=2))
    save_zimage_folder(components, tmp_path / "diffusers" / "tiny-zimage")
    names = kit.write_split_files(components, tmp_path, "good")
    monkeypatch.setenv(bridge.MODELS_ENV, str(tmp_path))
    monkeypatch.setattr(bridge, "comfy_qwen_tokenizer_dir", lambda: None)
    read = []
    monkeypatch.setattr(split_files, "read_tensors", lambda *a: read.append(a) or pytest.fail("tensors were read"))
    return tmp_path, components, names


def _fake(keys: dict) -> dict:
    return {k: torch.zeros(shape) for k, shape in keys.items()}


CASES = {
    "clip-l as text encoder": ("text_encoder", "text_encoders",
                               lambda z: {"text_model." + k.removeprefix("text_model."): v
                                          for k, v in tiny_components("sd1")["text_encoder"].state_dict().items()},
                               r"text_encoder='bad.safetensors': detected a CLIP text encoder .* Qwen3-4B"),
    "t5 as text encoder": ("text_encoder", "text_encoders",
                           lambda z: _fake({"shared.weight": (32, 8),
                                            "encoder.block.0.layer.0.SelfAttention.q.weight": (8, 8)}),
                           r"text_encoder='bad.safetensors': detected a T5 / UMT5 encoder"),
    "qwen2.5-vl as text encoder": ("text_encoder", "text_encoders",
                                   lambda z: _fake({"model.layers.0.self_attn.q_proj.weight": (8, 8),
                                                    "model.layers.0.self_attn.q_proj.bias": (8,),
                                                    "visual.patch_embed.proj.weight": (8, 3, 2, 14, 14)}),
                                   r"text_encoder='bad.safetensors': detected a Qwen2.5-VL"),
    "wider qwen3": ("text_encoder", "text_encoders",
                    lambda z: kit.text_encoder_hf(_wider_qwen3()),
                    r"text_encoder='bad.safetensors': a Qwen3 of hidden size 48, but the diffusion model reads "
                    r"captions of width 32"),
    "sd vae": ("vae", "vae", lambda z: kit.vae_original(tiny_components("sd1")["vae"].state_dict()),
               r"vae='bad.safetensors': a VAE with 4 latent channels; Z-Image needs the 16-channel Flux VAE"),
    "sd vae, diffusers layout": ("vae", "vae", lambda z: tiny_components("sdxl")["vae"].state_dict(),
                                 r"vae='bad.safetensors': a VAE with 4 latent channels"),
    "vae as text encoder": ("text_encoder", "text_encoders", lambda z: kit.vae_original(z["vae"].state_dict()),
                            r"text_encoder='bad.safetensors': this file holds a VAE \(original layout\), which belongs "
                            r"in the 'vae' input"),
    "text encoder as diffusion model": ("diffusion_model", "diffusion_models",
                                        lambda z: kit.text_encoder_hf(z["text_encoder"].state_dict()),
                                        r"diffusion_model='bad.safetensors': this file holds a Qwen3 text encoder"),
    "flux dit": ("diffusion_model", "diffusion_models",
                 lambda z: _fake({"double_blocks.0.img_attn.norm.key_norm.scale": (8,)}),
                 r"diffusion_model='bad.safetensors': detected a Flux DiT, which Z-Image does not use"),
    "sd unet": ("diffusion_model", "diffusion_models",
                lambda z: _fake({"model.diffusion_model.input_blocks.0.0.weight": (8, 4, 3, 3)}),
                r"detected a Stable Diffusion / SDXL UNet"),
    "unknown": ("vae", "vae", lambda z: _fake({"foo.weight": (2, 2)}),
                r"vae='bad.safetensors': not a known Z-Image or Qwen-Image part \(first keys: foo.weight\)"),
}


def _wider_qwen3():
    from transformers import Qwen3Model

    from leandiffusion.memory.tiny_zimage import text_config

    config = text_config(259)
    config.hidden_size = 48
    return Qwen3Model(config).state_dict()


@pytest.mark.parametrize("case", sorted(CASES))
def test_wrong_files_are_refused_before_any_tensor_is_read(split_dir, case):
    root, components, names = split_dir
    arg, folder, make, match = CASES[case]
    kit.write_single(make(components), root / folder / "bad.safetensors")
    with pytest.raises(ValueError, match=match):
        split_files.load_split_components(**dict(names, **{arg: "bad.safetensors"}))


@pytest.mark.parametrize("args,match", [
    (dict(vae="nope.safetensors"), r"vae='nope.safetensors' was not found in the 'vae' folder"),
    (dict(text_encoder="../x.safetensors"), r"text_encoder='../x.safetensors' points outside"),
    (dict(diffusion_model=""), r"diffusion_model: expected a model name"),
])
def test_bad_names_are_refused_naming_the_input(split_dir, args, match):
    _, _, names = split_dir
    with pytest.raises(ValueError, match=match):
        split_files.load_split_components(**dict(names, **args))


@pytest.mark.parametrize("kw,match", [(dict(vram_policy="turbo"), r"vram_policy='turbo'"),
                                      (dict(weight_dtype="int4"), r"weight_dtype='int4'"),
                                      (dict(vae_dtype="fp4"), r"vae_dtype='fp4'"),
                                      (dict(vram_budget_gb=-1.0), r"vram_budget_gb=-1.0")])
def test_settings_are_checked_before_any_file_is_opened(split_dir, monkeypatch, kw, match):
    _, _, names = split_dir
    monkeypatch.setattr(split_files, "read_header", lambda *a: pytest.fail("a file was opened"))
    with pytest.raises(ValueError, match=match):
        split_files.load_split_engine(**names, **kw, device="cpu")


def test_a_truncated_file_is_refused_naming_the_input(split_dir):
    root, _, names = split_dir
    path = root / "text_encoders" / names["text_encoder"]
    path.write_bytes(path.read_bytes()[:50])
    with pytest.raises(ValueError, match=r"^text_encoder='good_text_encoder.safetensors' \(50 bytes\) is truncated"):
        split_files.load_split_components(**names)


@pytest.mark.comfyui
def test_comfyuis_own_qwen_tokenizer_files_keep_the_chat_markers_whole():
    """The real files ComfyUI ships (vocab.json, merges.txt, tokenizer_config.json; no tokenizer.json) load offline
    and give Qwen's chat-marker ids (151644, 151645), one each, around the prompt's ordinary BPE tokens."""
    import os
    from pathlib import Path

    from leandiffusion.memory.qwen_tokenizer import load_qwen_tokenizer

    folder = Path(os.environ["COMFYUI_PATH"]) / "comfy" / "text_encoders" / "qwen25_tokenizer"
    tokenizer = load_qwen_tokenizer(folder)
    ids = tokenizer("<|im_start|>user\na cat<|im_end|>\n<|im_start|>assistant\n").input_ids
    assert ids[0] == 151644 and ids.count(151644) == 2 and ids.count(151645) == 1
    assert tokenizer.decode(ids) == "<|im_start|>user\na cat<|im_end|>\n<|im_start|>assistant\n"

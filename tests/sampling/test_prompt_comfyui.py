"""The pack's prompt encoding against ComfyUI's own code (needs COMFYUI_PATH: a ComfyUI 0.3.64 source tree).

``test_*_matches_comfyui`` run ComfyUI's real tokenizer/encoder classes (``comfy/sd1_clip.py``, and
``SDXLClipModel.encode_token_weights`` for the SDXL combination) over the tiny text encoders' weights: the exact
code path CLIPTextEncode runs after loading a checkpoint. ComfyUI builds CLIP from fixed full-size configs when it
loads a checkpoint, so for tiny models the classes are built here from the tiny configs instead.

The end-to-end check through ComfyUI's own CheckpointLoaderSimple and CLIPTextEncode nodes (a full-size CLIP-L,
which ComfyUI needs, inside the real ComfyUI server) is ``tests/integration/test_comfyui_prompts.py``.
"""
import random

import pytest
import torch
from safetensors.torch import save_file

from leandiffusion.sampling.prompt_encoder import encode_texts
from leandiffusion.sampling.prompt_parser import parse_weights
from leandiffusion.tests.kit import tiny_components, tiny_engine, tiny_tokenizer_dir
from leandiffusion.tests.kit.comfy_source import comfyui_imports

pytestmark = pytest.mark.comfyui
TOL = 1e-5
PROMPTS = [
    "a red cube on a table",
    "(red cube:1.3), ((studio light)), [blur], (cat:abc)",
    "escaped \\(not weighted\\) ((nested (deeper:0.7) text)) BREAK end",
    ", ".join(f"word{i} (thing{i}:1.2)" for i in range(12)),
    "x" * 70 + " (" + "y" * 30 + ":1.4)",
    "a photo embedding:style of (a cat embedding:sub_old:1.2), embedding:style, done",
    "a embedding:,style, x",  # a leading comma: ComfyUI's retry gives the name's tail back as text
    "a " * 71 + "(b c d e:1.2)",  # a piece that fills the first chunk exactly
    "a " * 70 + "(b c d e f g h i:1.2)",  # an 8-token piece (the smallest that splits) across the boundary
]


@pytest.fixture(scope="module")
def comfy():
    with comfyui_imports():
        import comfy.sd1_clip
        import comfy.sdxl_clip

    return comfy


def _comfy_state_dict(model):
    sd = {}
    for k, v in model.state_dict().items():
        key = k if k.startswith(("text_model.", "text_projection")) else "text_model." + k
        if key.endswith("token_embedding.weight"):  # ComfyUI's CLIP table has 49408 rows; tiny ids are < 514
            v = torch.cat([v, torch.zeros(49408 - v.shape[0], v.shape[1])])
        sd[key] = v
    return sd


def _comfy_clip(comfy, model, pad, final_norm, projected):
    cfg = model.config
    config = dict(num_hidden_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
                  num_attention_heads=cfg.num_attention_heads, intermediate_size=cfg.intermediate_size,
                  hidden_act=cfg.hidden_act, max_position_embeddings=cfg.max_position_embeddings,
                  eos_token_id=cfg.eos_token_id)
    clip = comfy.sd1_clip.SDClipModel(textmodel_json_config=config, dtype=torch.float32,
                                      special_tokens={"start": 512, "end": 513, "pad": pad},
                                      layer_norm_hidden_state=final_norm, return_projected_pooled=projected)
    missing, unexpected = clip.load_sd(_comfy_state_dict(model))
    assert not unexpected and all("text_projection" in k for k in missing)
    return clip


@pytest.fixture
def emb_dir(tmp_path, monkeypatch):
    folder = tmp_path / "embeddings"
    folder.mkdir()
    monkeypatch.setenv("LEANDIFFUSION_MODELS", str(tmp_path))
    g = torch.Generator().manual_seed(3)
    save_file({"clip_l": torch.randn(2, 64, generator=g), "clip_g": torch.randn(2, 128, generator=g)},
              str(folder / "style.safetensors"))
    torch.save({"clip_l": torch.randn(3, 64, generator=g), "clip_g": torch.randn(3, 128, generator=g)},
               str(folder / "sub_old.pt"))
    return folder


@pytest.mark.parametrize("text", PROMPTS)
def test_sd1_matches_comfyui(comfy, emb_dir, tmp_path, text):
    comps = tiny_components("sd1")
    tok = comfy.sd1_clip.SDTokenizer(tokenizer_path=str(tiny_tokenizer_dir(tmp_path / "tok")),
                                     embedding_directory=str(emb_dir), embedding_size=64, embedding_key="clip_l")
    clip = _comfy_clip(comfy, comps["text_encoder"], 513, True, False)
    with torch.no_grad():
        cond, _ = clip.encode_token_weights(tok.tokenize_with_weights(text))
    ours = encode_texts(tiny_engine("sd1"), [text], cache=None)[0]
    assert ours.context.shape == cond.shape
    assert (ours.context - cond).abs().max().item() <= TOL


@pytest.mark.parametrize("text", PROMPTS)
def test_sdxl_matches_comfyui(comfy, emb_dir, tmp_path, text):
    comps = tiny_components("sdxl")
    tok_dir = str(tiny_tokenizer_dir(tmp_path / "tok"))
    tokenizer = comfy.sdxl_clip.SDXLTokenizer.__new__(comfy.sdxl_clip.SDXLTokenizer)
    tokenizer.clip_l = comfy.sd1_clip.SDTokenizer(tokenizer_path=tok_dir, embedding_directory=str(emb_dir),
                                                  embedding_size=64, embedding_key="clip_l")
    tokenizer.clip_g = comfy.sd1_clip.SDTokenizer(tokenizer_path=tok_dir, embedding_directory=str(emb_dir),
                                                  pad_with_end=False, embedding_size=128, embedding_key="clip_g")
    model = comfy.sdxl_clip.SDXLClipModel.__new__(comfy.sdxl_clip.SDXLClipModel)
    torch.nn.Module.__init__(model)
    model.clip_l = _comfy_clip(comfy, comps["text_encoder"], 513, False, False)
    model.clip_g = _comfy_clip(comfy, comps["text_encoder_2"], 0, False, True)
    for clip in (model.clip_l, model.clip_g):
        clip.set_clip_options({"layer": -2})  # SDXL: penultimate layer (set after init: tiny CLIPs have 2 layers)
    with torch.no_grad():
        cond, pooled = model.encode_token_weights(tokenizer.tokenize_with_weights(text))
    ours = encode_texts(tiny_engine("sdxl"), [text], cache=None)[0]
    assert ours.context.shape == cond.shape
    assert (ours.context - cond).abs().max().item() <= TOL
    assert (ours.pooled - pooled).abs().max().item() <= TOL


def test_parser_fuzz_against_comfyui(comfy):
    sd1_clip = comfy.sd1_clip
    rng = random.Random(1)
    alphabet = ["(", ")", "\\(", "\\)", ":", "1.2", "0.5", "abc", " ", "x", ",", "[", "]", "e", "::", "\\"]
    for _ in range(5000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 16)))
        ref = [(sd1_clip.unescape_important(s), w)
               for s, w in sd1_clip.token_weights(sd1_clip.escape_important(text), 1.0)]
        assert parse_weights(text) == ref, text

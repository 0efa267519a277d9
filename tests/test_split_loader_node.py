"""The Memory Pool Loader (split files) node: Z-Image's ComfyUI split files load into the same model as the diffusers
folder they were converted from, in every accepted layout and precision, and every bad input is refused clearly.

Guards issue 42's split-loader contract: original / Comfy-Org / diffusers key layouts, bf16 and fp8 (plain and
scaled) files, the tokenizer from a Z-Image folder or ComfyUI's files, the same LATENT as the folder, and errors
that name the input before any tensor is read.
"""
import gc
import weakref

import pytest
import torch
from safetensors import safe_open

from leandiffusion import bridge
from leandiffusion.memory import split_files
from leandiffusion.memory.folders import load_zimage_folder
from leandiffusion.memory.tiny_zimage import build_tiny_zimage, save_zimage_folder
from leandiffusion.nodes.loader import LeanModelLoader
from leandiffusion.nodes.split_loader import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS, LeanSplitModelLoader
from leandiffusion.tests.kit import zimage_split as kit

PROMPT = "<|im_start|>user\nA red fox, watercolour: 3 leaves & a moon<|im_end|>\n<|im_start|>assistant\n"
GRIDS = ("bf16", "fp8", "fp8_scaled")
# (id, grid = the file's precision, kit.write_split_files keyword arguments)
VARIANTS = [
    ("comfy-bf16", "bf16", dict(comfy=True)),
    ("original-bf16", "bf16", dict()),
    ("diffusers-bf16", "bf16", dict(layout="diffusers", comfy=True)),
    ("comfy-fp8", "fp8", dict(comfy=True)),
    ("original-fp8", "fp8", dict()),
    ("comfy-scaled-fp8", "fp8_scaled", dict(comfy=True)),
    ("original-scaled-fp8-legacy-folders", "fp8_scaled", dict(scale_suffix=".weight_scale",
                                                              folders=("unet", "clip", "vae"))),
]


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    """A models folder with one diffusers folder per precision grid and every variant's split files."""
    root = tmp_path_factory.mktemp("models")
    refs, names = {}, {}
    for grid in GRIDS:
        components = build_tiny_zimage(seed=5)
        kit.bf16_grid(components) if grid == "bf16" else kit.fp8_grid(components, scaled=grid == "fp8_scaled")
        save_zimage_folder(components, root / "diffusers" / f"tiny-zimage-{grid}")
        refs[grid] = load_zimage_folder(root / "diffusers" / f"tiny-zimage-{grid}")
    for vid, grid, kw in VARIANTS:
        names[vid] = kit.write_split_files(refs[grid], root, vid, dtype=grid, **kw)
    return root, refs, names


@pytest.fixture
def models(library, monkeypatch):
    root, refs, names = library
    monkeypatch.setenv(bridge.MODELS_ENV, str(root))
    monkeypatch.setattr(bridge, "comfy_qwen_tokenizer_dir", lambda: None)  # outside ComfyUI, whatever runs tests
    return root, refs, names


def _load(names, policy="full", weight_dtype="fp32"):
    return LeanSplitModelLoader().load(names["diffusion_model"], names["text_encoder"], names["vae"], policy, 4.0,
                                       weight_dtype, "fp32")


def test_contract_shares_the_memory_pool_loaders_settings():
    assert NODE_CLASS_MAPPINGS["LeanSplitModelLoader"] is LeanSplitModelLoader
    assert NODE_DISPLAY_NAME_MAPPINGS["LeanSplitModelLoader"] == "Memory Pool Loader (split files)"
    assert LeanSplitModelLoader.CATEGORY == "LeanDiffusion/loaders"
    assert LeanSplitModelLoader.RETURN_TYPES == ("LEAN_MODEL", "STRING")
    req = LeanSplitModelLoader.INPUT_TYPES()["required"]
    assert list(req) == ["diffusion_model", "text_encoder", "vae", "vram_policy", "vram_budget_gb", "weight_dtype",
                         "vae_dtype"]
    pool = LeanModelLoader.INPUT_TYPES()["required"]
    for name in ("vram_policy", "vram_budget_gb", "weight_dtype", "vae_dtype"):
        assert req[name] == pool[name], name
    for name, folder in (("diffusion_model", "models/diffusion_models"), ("text_encoder", "models/text_encoders"),
                         ("vae", "models/vae")):
        assert folder in req[name][1]["tooltip"], name


def test_menus_list_each_folder_and_its_older_name(models):
    _, _, names = models
    req = LeanSplitModelLoader.INPUT_TYPES()["required"]
    legacy = names["original-scaled-fp8-legacy-folders"]
    assert legacy["diffusion_model"] in req["diffusion_model"][0]  # from models/unet
    assert legacy["text_encoder"] in req["text_encoder"][0]  # from models/clip
    assert names["comfy-bf16"]["diffusion_model"] in req["diffusion_model"][0]
    assert names["comfy-bf16"]["vae"] in req["vae"][0] and names["comfy-bf16"]["vae"] not in req["text_encoder"][0]


@pytest.mark.parametrize("vid,grid", [(v, g) for v, g, _ in VARIANTS], ids=[v for v, _, _ in VARIANTS])
def test_split_files_hold_the_diffusers_folders_weights(models, vid, grid):
    """Every weight equals the diffusers folder's (the kit puts the folder's weights on the file's bf16 / fp8 grid,
    so the upcast of the stored values is exact), and the tokenizer gives the folder tokenizer's ids."""
    _, refs, names = models
    engine, plan = _load(names[vid])
    assert engine.family == "zimage" and "policy full" in plan
    ref = refs[grid]
    for part, module in (("transformer", engine.parts.unet), ("text_encoder", engine.parts.text_encoder),
                         ("vae", engine.parts.vae)):
        want, got = ref[part].state_dict(), module.state_dict()
        assert want.keys() == got.keys(), part
        wrong = [k for k in want if not torch.equal(want[k], got[k])]
        assert not wrong, f"{part}: {wrong[:5]}"
    assert engine.parts.tokenizer(PROMPT).input_ids == ref["tokenizer"](PROMPT).input_ids
    from diffusers import FlowMatchEulerDiscreteScheduler as Scheduler  # the folder's file spells out every default

    ours, theirs = (dict(Scheduler(**c).config) for c in (engine.parts.scheduler_config, ref["scheduler_config"]))
    assert ours.pop("_use_default_values") and ours == {k: v for k, v in theirs.items() if not k.startswith("_")}
    assert engine.parts.vae.config.shift_factor == ref["vae"].config.shift_factor


@pytest.mark.parametrize("vid", ["comfy-scaled-fp8", "comfy-fp8"])
def test_fp8_weights_are_the_upcast_stored_values(models, vid):
    """Read straight from the file: the fused qkv's first third, times its stored scale, is the loaded to_q."""
    root, _, names = models
    engine, _ = _load(names[vid])
    key = kit.COMFY_PREFIX + "layers.1.attention.qkv.weight"
    with safe_open(str(root / "diffusion_models" / names[vid]["diffusion_model"]), "pt") as f:
        stored = f.get_tensor(key)
        scale = f.get_tensor(key.replace(".weight", ".scale_weight")) if "scaled" in vid else torch.tensor(1.0)
    assert stored.dtype == torch.float8_e4m3fn
    q = stored.float()[:stored.shape[0] // 3] * scale
    assert torch.equal(engine.parts.unet.layers[1].attention.to_q.weight, q.to(torch.bfloat16).float())


def test_split_files_sample_the_folders_latent(models):
    """Issue 42: the split-file loader gives the same LATENT as the diffusers folder it was converted from."""
    from leandiffusion.nodes.flow import LeanFlowSampler

    _, _, names = models
    split, _ = _load(names["comfy-bf16"])
    folder, _ = LeanModelLoader().load("tiny-zimage-bf16", "full", 4.0, "fp32", "fp32")
    args = ("a fox in the snow", "blurry", 7, 2, 2.0, 48, 32, 2, "none")
    ours = LeanFlowSampler().run(split, *args)[0]["samples"]
    ref = LeanFlowSampler().run(folder, *args)[0]["samples"]
    assert ours.shape == (2, 16, 4, 6)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)


def test_is_changed_follows_each_file(models):
    import os

    root, _, names = models
    n = names["original-bf16"]
    first = LeanSplitModelLoader.IS_CHANGED(n["diffusion_model"], n["text_encoder"], n["vae"], vram_policy="full")
    assert LeanSplitModelLoader.IS_CHANGED(n["diffusion_model"], n["text_encoder"], n["vae"]) == first
    path = root / "vae" / n["vae"]
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    assert LeanSplitModelLoader.IS_CHANGED(n["diffusion_model"], n["text_encoder"], n["vae"]) != first
    assert "missing.safetensors" in LeanSplitModelLoader.IS_CHANGED("missing.safetensors", n["text_encoder"], n["vae"])


def test_progress_counts_three_stages_and_cancel_stops_before_placing(models, monkeypatch):
    from leandiffusion.memory import load as load_mod
    from leandiffusion.tests.kit.progress import ComfyLikeBar, cancelled_at_check

    _, _, names = models
    bars = []
    monkeypatch.setattr(bridge, "ProgressBar", lambda *a, **k: bars.append(ComfyLikeBar(*a, **k)) or bars[-1])
    _load(names["original-bf16"])
    assert [bar.seen for bar in bars] == [[(1, 3), (2, 3), (3, 3)]]
    placed = []
    monkeypatch.setattr(load_mod, "build_engine", lambda *a, **k: placed.append(1))
    with cancelled_at_check(2) as checks, pytest.raises(bridge.Interrupted):
        _load(names["original-bf16"])
    assert len(checks) == 2 and not placed


def test_the_tokenizer_comes_from_comfyuis_qwen_files_without_a_zimage_folder(models, tmp_path, monkeypatch):
    """Inside ComfyUI (no Z-Image diffusers folder): ComfyUI's Qwen files (vocab.json, merges.txt and a
    tokenizer_config.json, no tokenizer.json) give the folder tokenizer's ids, chat markers one id each."""
    root, refs, names = models
    only_split = tmp_path / "models"
    for folder in ("diffusion_models", "text_encoders", "vae"):
        (only_split / folder).mkdir(parents=True)
    for arg, folder in (("diffusion_model", "diffusion_models"), ("text_encoder", "text_encoders"), ("vae", "vae")):
        (only_split / folder / names["original-bf16"][arg]).symlink_to(root / folder / names["original-bf16"][arg])
    comfy = kit.write_comfy_style_tokenizer(refs["bf16"]["tokenizer"], tmp_path / "qwen25_tokenizer")
    monkeypatch.setenv(bridge.MODELS_ENV, str(only_split))
    monkeypatch.setattr(bridge, "comfy_qwen_tokenizer_dir", lambda: comfy)
    engine, _ = _load(names["original-bf16"])
    ids = engine.parts.tokenizer(PROMPT).input_ids
    assert ids == refs["bf16"]["tokenizer"](PROMPT).input_ids
    assert ids.count(refs["bf16"]["tokenizer"].convert_tokens_to_ids("<|im_start|>")) == 2
    monkeypatch.setattr(bridge, "comfy_qwen_tokenizer_dir", lambda: None)
    with pytest.raises(ValueError, match=r"no Qwen tokenizer files found .* models/diffusers/<any name>/"):
        _load(names["original-bf16"])


def test_a_failed_load_leaves_no_module_behind(models, monkeypatch):
    """A VAE with a NaN weight is refused after the DiT and the text encoder were built: none of them survives."""
    root, refs, names = models
    vae = kit.vae_original(refs["bf16"]["vae"].state_dict())
    vae["decoder.conv_out.bias"] = vae["decoder.conv_out.bias"].clone()
    vae["decoder.conv_out.bias"][0] = float("nan")
    bad = dict(names["original-bf16"], vae=kit.write_single(vae, root / "vae" / "nan_vae.safetensors"))
    built = []
    real = split_files.load_part
    monkeypatch.setattr(split_files, "load_part", lambda f, *more: built.append(weakref.ref(m := real(f, *more))) or m)
    with pytest.raises(ValueError, match=r"vae='nan_vae.safetensors'.*decoder.conv_out.bias"):
        _load(bad)
    gc.collect()
    assert len(built) == 2 and all(ref() is None for ref in built)
    (root / "vae" / "nan_vae.safetensors").unlink()

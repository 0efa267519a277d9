"""The LeanLoraInjector node contract, and the loader's cache and alpha conventions.

Guards: node ID / inputs / COMBO from the loras folder; the node returns a view and leaves its input unchanged;
files are cached per (path, mtime, size, inode, ctime, device, dtype) and re-read when changed (also by a copy that kept
size and mtime), and a loaded LoRA keeps its weights when its file is overwritten in place; PEFT alphas from ``.alpha`` keys,
metadata and rsLoRA; no alpha means alpha = rank.
"""
import json
import os
from pathlib import Path

import pytest
import torch

from leandiffusion.lora import formats, inject_lora, load_lora
from leandiffusion.lora.loader import clear_cache
from leandiffusion.memory.engine import engine_from_parts, parts_from_components
from leandiffusion.nodes.lora import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
from leandiffusion.tests.kit import tiny_components
from leandiffusion.tests.lora import lorafiles as lf


@pytest.fixture()
def models_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LEANDIFFUSION_MODELS", str(tmp_path))
    (tmp_path / "loras" / "sub").mkdir(parents=True)
    return tmp_path


def test_node_contract_and_run(models_dir):
    node = NODE_CLASS_MAPPINGS["LeanLoraInjector"]
    assert NODE_DISPLAY_NAME_MAPPINGS["LeanLoraInjector"] == "Dynamic LoRA Injector"
    assert node.CATEGORY == "LeanDiffusion/lora" and node.RETURN_TYPES == ("LEAN_MODEL",)
    c = tiny_components("sd1")
    engine = engine_from_parts(parts_from_components(c))
    sd = lf.kohya_state_dict({"unet": c["unet"]}, {"unet": lf.ATTN_FF})
    lf.write(sd, models_dir / "loras" / "sub" / "style.safetensors")
    spec = node.INPUT_TYPES()["required"]
    assert list(spec) == ["lean_model", "lora_name", "strength", "strength_text_encoder", "target_blocks", "mode"]
    assert spec["lora_name"][0] == ["sub/style.safetensors"]
    assert spec["mode"][0] == ["unmerged", "merged"]
    assert (spec["strength"][1]["min"], spec["strength"][1]["max"], spec["strength"][1]["default"]) == (-10.0, 10.0, 1.0)
    assert spec["target_blocks"][1]["default"] == ""
    (view,) = node().inject(engine, "sub/style.safetensors", 0.5, 1.0, "", "unmerged")
    assert engine.adapters == () and len(view.adapters) == 1 and view.parts is engine.parts
    with pytest.raises(ValueError, match="lora_name"):
        node().inject(engine, "../escape.safetensors", 0.5, 1.0, "", "unmerged")


def test_node_inputs_and_menu_are_the_documented_ones(models_dir):
    """docs/lora.md's table: both strengths -10..10 (default 1), mode default 'unmerged', and every listed
    extension in the menu (the text-encoder range, the mode default and the '.sft' extension must not change
    unnoticed)."""
    node = NODE_CLASS_MAPPINGS["LeanLoraInjector"]
    for ext in (".safetensors", ".sft", ".pt", ".pth", ".ckpt", ".bin"):
        (models_dir / "loras" / f"a{ext}").write_bytes(b"x")
    (models_dir / "loras" / "notes.txt").write_bytes(b"x")
    spec = node.INPUT_TYPES()["required"]
    assert spec["lora_name"][0] == ["a.bin", "a.ckpt", "a.pt", "a.pth", "a.safetensors", "a.sft"]
    te = spec["strength_text_encoder"][1]
    assert (te["min"], te["max"], te["default"]) == (-10.0, 10.0, 1.0)
    assert spec["mode"][1]["default"] == "unmerged"


def test_node_is_plumbing_over_inject_lora(models_dir):
    """Every widget reaches ``inject_lora`` as itself (a node passing ``strength`` as the text-encoder strength,
    dropping ``target_blocks`` or always injecting 'unmerged' would pass tests that only count the view's adapters)."""
    c = tiny_components("sd1")
    engine = engine_from_parts(parts_from_components(c))
    roots = {"unet": c["unet"], "text_encoder": c["text_encoder"]}
    path = lf.write(lf.kohya_state_dict(roots, {"unet": lf.ATTN_FF, "text_encoder": lf.TE_LINEARS}),
                    models_dir / "loras" / "both.safetensors")
    blocks = "mid_block, text_encoder"
    (view,) = NODE_CLASS_MAPPINGS["LeanLoraInjector"]().inject(engine, "both.safetensors", 0.5, -0.25, blocks, "merged")
    (got,) = view.adapters
    (want,) = inject_lora(engine, path, strength=0.5, strength_text_encoder=-0.25, target_blocks=blocks,
                          mode="merged").adapters
    assert got.mode == "merged" and dict(got.strengths) == {"unet": 0.5, "text_encoder": -0.25}
    assert got.binding.key == want.binding.key  # same file, mode and targets (the blocks' filter applied)
    everything = inject_lora(engine, path, mode="merged").adapters[0]
    assert got.binding.key != everything.binding.key  # the filter does narrow this file's targets
    assert got.name == "both.safetensors"


def test_cache_per_file_identity(tmp_path):
    clear_cache()
    c = tiny_components("sd1")
    path = lf.write(lf.kohya_state_dict({"unet": c["unet"]}, {"unet": lf.ATTN_FF}), tmp_path / "a.safetensors")
    a = load_lora(path, "cpu", torch.float32)
    assert load_lora(path, "cpu", torch.float32) is a
    assert load_lora(path, "cpu", torch.float64) is not a
    lf.write(lf.kohya_state_dict({"unet": c["unet"]}, {"unet": lf.ATTN_FF}, seed=9), path)
    os.utime(path, ns=(1, 1))
    b = load_lora(path, "cpu", torch.float32)
    assert b is not a and not torch.equal(b.parsed.layers[0].down, a.parsed.layers[0].down)


def test_to_device_packs_plain_ups_per_component_in_layer_order():
    """Each component's plain LoRA ``up`` factors become back-to-back views of one flat tensor, in layer order, with
    the values ``placed`` gives; DoRA and LoHa layers are placed as before (the strength rewrite's layout)."""
    from leandiffusion.lora.loader import to_device
    from leandiffusion.lora.lycoris import LohaLayer

    g = torch.Generator().manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float16)

    def lora(comp, name, out, r=4, magnitude=None):
        return formats.LoraLayer(comp, name, "dotted", rnd(r, 8), rnd(out, r), 0.5, name, magnitude)

    layers = (lora("unet", "a", 6), lora("text_encoder", "t0", 5), lora("unet", "dora", 7, magnitude=torch.ones(1, 8)),
              lora("unet", "b", 3, r=2), LohaLayer("unet", "h", "dotted", rnd(4, 2), rnd(2, 8), rnd(4, 2), rnd(2, 8),
                                                    0.5, "h"), lora("unet", "c", 9), lora("text_encoder", "t1", 2))
    placed = to_device(formats.ParsedLora("peft", layers), torch.device("cpu"), torch.float32).layers
    for before, after in zip(layers, placed):
        want = before.placed(torch.device("cpu"), torch.float32)
        for f in ("down", "up", "w1a", "w1b", "w2a", "w2b"):
            if hasattr(want, f):
                assert torch.equal(getattr(after, f), getattr(want, f)), (before.name, f)
    for comp, names in (("unet", ("a", "b", "c")), ("text_encoder", ("t0", "t1"))):
        ups = [layer.up for layer in placed if layer.name in names]
        base = ups[0].untyped_storage().data_ptr()
        assert all(u.untyped_storage().data_ptr() == base for u in ups)
        offsets = [u.storage_offset() for u in ups]
        assert offsets == [0] + [sum(u.numel() for u in ups[:i]) for i in range(1, len(ups))], comp
        assert ups[0].untyped_storage().nbytes() == sum(u.nbytes for u in ups)
    dora = placed[2]
    assert dora.up.untyped_storage().data_ptr() not in {placed[0].up.untyped_storage().data_ptr(),
                                                        placed[1].up.untyped_storage().data_ptr()}


def test_cache_keeps_the_most_recently_used_files(tmp_path, monkeypatch):
    """The strong cache holds the ``MAX_CACHED`` most recently *used* files: a hit refreshes a file, and the file
    used least recently is the one dropped (with no view holding it, it is read again; the others are not)."""
    import gc

    from leandiffusion.lora import loader
    clear_cache()
    c = tiny_components("sd1")
    paths = [lf.write(lf.kohya_state_dict({"unet": c["unet"]}, {"unet": lf.ATTN_FF}, rank=2, seed=i),
                      tmp_path / f"l{i}.safetensors") for i in range(loader.MAX_CACHED + 1)]
    reads = []
    real_read = loader.read_state_dict
    monkeypatch.setattr(loader, "read_state_dict", lambda p: reads.append(Path(p).name) or real_read(p))
    for p in paths[:-1]:
        load_lora(p, "cpu", torch.float32)
    load_lora(paths[0], "cpu", torch.float32)  # a hit: l0 becomes the most recent
    load_lora(paths[-1], "cpu", torch.float32)  # one file too many: l1, the least recently used, goes
    gc.collect()  # no view holds any of them: only the strong cache keeps them loaded
    reads.clear()
    for p in [paths[0], *paths[2:], paths[1]]:
        load_lora(p, "cpu", torch.float32)
    assert reads == ["l1.safetensors"]
    clear_cache()


def test_cache_sees_a_copy_that_kept_size_and_mtime(tmp_path):
    """``cp -p`` / ``rsync -a`` of another LoRA with the same shapes: same size, same mtime, new contents."""
    clear_cache()
    c = tiny_components("sd1")
    path = lf.write(lf.kohya_state_dict({"unet": c["unet"]}, {"unet": lf.ATTN_FF}), tmp_path / "a.safetensors")
    a = load_lora(path, "cpu", torch.float32)
    st = os.stat(path)
    lf.write(lf.kohya_state_dict({"unet": c["unet"]}, {"unet": lf.ATTN_FF}, seed=9), path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (os.stat(path).st_size, os.stat(path).st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    b = load_lora(path, "cpu", torch.float32)
    assert b is not a and not torch.equal(b.parsed.layers[0].down, a.parsed.layers[0].down)



def test_cache_sees_an_in_place_rewrite_that_kept_inode_size_and_mtime(tmp_path):
    """Rewritten in place (same inode) with the old mtime put back: only the ctime tells the new contents apart
    (the other cache tests change the inode or the mtime too)."""
    from safetensors.torch import save

    clear_cache()
    c = tiny_components("sd1")
    path = lf.write(lf.kohya_state_dict({"unet": c["unet"]}, {"unet": lf.ATTN_FF}), tmp_path / "a.safetensors")
    a = load_lora(path, "cpu", torch.float32)
    st = os.stat(path)
    new = lf.kohya_state_dict({"unet": c["unet"]}, {"unet": lf.ATTN_FF}, seed=9)
    with open(path, "r+b") as f:
        f.write(save({k: v.contiguous() for k, v in new.items()}))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    now = os.stat(path)
    assert (now.st_ino, now.st_size, now.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)
    assert now.st_ctime_ns != st.st_ctime_ns
    b = load_lora(path, "cpu", torch.float32)
    assert b is not a and not torch.equal(b.parsed.layers[0].down, a.parsed.layers[0].down)


def test_a_loaded_lora_keeps_its_weights_when_the_file_is_overwritten_in_place(tmp_path):
    """``cp retrained.safetensors a.safetensors`` rewrites the same inode. The cached LoRA (still used by the views
    ComfyUI keeps) held views of the mapped file, so its weights became the new file's (a shorter file: SIGBUS)."""
    from safetensors.torch import save

    clear_cache()
    c = tiny_components("sd1")
    path = lf.write(lf.kohya_state_dict({"unet": c["unet"]}, {"unet": lf.ATTN_FF}), tmp_path / "a.safetensors")
    a = load_lora(path, "cpu", torch.float32)
    before = a.parsed.layers[0].down.clone()
    new = lf.kohya_state_dict({"unet": c["unet"]}, {"unet": lf.ATTN_FF}, seed=9)
    with open(path, "r+b") as f:
        f.write(save({k: v.contiguous() for k, v in new.items()}))
    assert not torch.equal(load_lora(path, "cpu", torch.float32).parsed.layers[0].down, before)  # re-read: new file
    assert torch.equal(a.parsed.layers[0].down, before)

def test_alpha_conventions():
    down, up = torch.randn(4, 8), torch.randn(6, 4)
    kohya = formats.parse_lora({"lora_unet_x.lora_down.weight": down, "lora_unet_x.lora_up.weight": up})
    assert kohya.format == "kohya" and kohya.layers[0].scale == 1.0  # no alpha: alpha = rank
    kohya = formats.parse_lora({"lora_unet_x.lora_down.weight": down, "lora_unet_x.lora_up.weight": up,
                                "lora_unet_x.alpha": torch.tensor(2.0)})
    assert kohya.layers[0].scale == 0.5
    peft = {"unet.a.b.lora_A.weight": down, "unet.a.b.lora_B.weight": up,
            "text_encoder.c.lora_A.weight": down, "text_encoder.c.lora_B.weight": up}
    assert [l.scale for l in formats.parse_lora(peft).layers] == [1.0, 1.0]
    meta = {"lora_adapter_metadata": json.dumps({"unet.lora_alpha": 8, "unet.alpha_pattern": {"b": 2},
                                                 "text_encoder.lora_alpha": 16, "text_encoder.use_rslora": True})}
    parsed = {(l.component, l.name): l.scale for l in formats.parse_lora(peft, meta).layers}
    assert parsed == {("unet", "a.b"): 0.5, ("text_encoder", "c"): 8.0}
    with_alpha_keys = dict(peft, **{"unet.a.b.alpha": torch.tensor(12.0)})
    assert {l.name: l.scale for l in formats.parse_lora(with_alpha_keys).layers}["a.b"] == 3.0


def test_loaded_layers_fold_scale_into_up(tmp_path):
    down, up = torch.randn(4, 8), torch.randn(6, 4)
    path = lf.write({"lora_unet_x.lora_down.weight": down, "lora_unet_x.lora_up.weight": up,
                     "lora_unet_x.alpha": torch.tensor(1.0)}, tmp_path / "s.safetensors")
    layer = load_lora(path, "cpu", torch.float64).parsed.layers[0]
    assert layer.scale == 1.0 and torch.equal(layer.up, up.double() * 0.25)
    assert layer.down.dtype == torch.float64


def test_a_load_for_some_components_holds_only_their_layers(tmp_path):
    """The loader loads a LoRA per stage when the stages compute on other devices / dtypes (``lowvram``: text
    encoders on the CPU in fp32): each load holds its components' layers only, so no layer is applied twice
    (the other tests load every component). Counts from the file's own keys."""
    clear_cache()
    c = tiny_components("sd1")
    sd = lf.kohya_state_dict({"unet": c["unet"], "text_encoder": c["text_encoder"]},
                             {"unet": lf.ATTN_FF, "text_encoder": lf.TE_LINEARS})
    path = lf.write(sd, tmp_path / "both.safetensors")
    downs = [k for k in sd if k.endswith(".lora_down.weight")]
    n_unet = sum(k.startswith("lora_unet_") for k in downs)
    assert 0 < n_unet < len(downs)
    everything = load_lora(path, "cpu", torch.float32)
    unet_only = load_lora(path, "cpu", torch.float32, ["unet"])
    text_only = load_lora(path, "cpu", torch.float32, ["text_encoder", "text_encoder_2"])
    assert len(everything.parsed.layers) == len(downs)
    assert [layer.component for layer in unet_only.parsed.layers] == ["unet"] * n_unet
    assert [layer.component for layer in text_only.parsed.layers] == ["text_encoder"] * (len(downs) - n_unet)

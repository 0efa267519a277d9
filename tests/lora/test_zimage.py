"""Z-Image LoRAs: the injector's unmerged LoRA on the Z-Image DiT computes what diffusers' own loader computes
(``ZImagePipeline.load_lora_weights`` + ``set_adapters``), for the diffusers/PEFT layout and the model's original
(ComfyUI / kohya-style) layout, at several strengths, without rebuilding anything when the strength changes.

Guards: the PEFT component name ``transformer`` and its metadata alphas (``lora_alpha``, ``alpha_pattern``); the
original names (``diffusion_model.`` / ``lora_unet_`` prefixes, every factor spelling, ``.alpha``), a fused
``attention.qkv`` layer split onto to_q/to_k/to_v, ``attention.out``, ``x_embedder`` / ``final_layer``; redundant
fused copies next to split layers (dropped as diffusers does, refused when they differ); a LoRA for the other
architecture refused by name with the model untouched; keys that match no module listed, never skipped.
"""
import pytest
import torch

from leandiffusion.lora import inject_lora
from leandiffusion.memory.engine import parts_from_components
from leandiffusion.memory.load import build_engine
from leandiffusion.memory.tiny_zimage import build_tiny_zimage, save_zimage_folder
from leandiffusion.nodes.lora import NODE_CLASS_MAPPINGS
from leandiffusion.tests.kit import tiny_components, tiny_engine
from leandiffusion.tests.kit import zimage_lora as zl
from leandiffusion.tests.lora import lorafiles as lf

TOL = 1e-5
STRENGTHS = (0.5, 1.0, -0.7)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("zimage_lora")
    save_zimage_folder(build_tiny_zimage(seed=0), root / "folder")
    return root


@pytest.fixture(scope="module")
def transformer():
    return build_tiny_zimage(seed=0)["transformer"]


@pytest.fixture(scope="module")
def engine():
    return build_engine(parts_from_components(build_tiny_zimage(seed=0)), "full", device="cpu")


@pytest.fixture(scope="module")
def inputs(transformer):
    return zl.dit_inputs(transformer)


def _max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def _ours(view, inputs):
    with view.session("unet"):
        return zl.run_dit(view.parts.unet, inputs)


def _matches_diffusers(engine, models, inputs, path, ref_path=None):
    """Ours at every strength of ``STRENGTHS`` equals diffusers' transformer with ``ref_path`` (default: the same
    file) loaded and set to that strength; every strength reuses one binding and rewrites the same buffers."""
    pipe = zl.diffusers_pipeline(models / "folder", ref_path or path)
    assert zl.peft_layers(pipe.transformer) == len(zl.target_names(engine.parts.unet))  # the reference loads all
    before = lf.snapshot(engine.parts.unet)
    base = zl.run_dit(engine.parts.unet, inputs)
    views, buffers = [], []
    for s in STRENGTHS:
        views.append(inject_lora(engine, path, s))
        pipe.set_adapters(["ref"], adapter_weights=[s])
        ref = zl.run_dit(pipe.transformer, inputs)
        binding = views[-1].adapters[-1].binding
        with views[-1].session("unet"):
            ours = zl.run_dit(views[-1].parts.unet, inputs)
            for buf, up in zip(binding._up_s["unet"], binding._up["unet"]):
                assert torch.equal(buf, s * up)
        buffers.append([t.data_ptr() for t in binding._up_s["unet"]])
        assert _max_diff(ref, base) > 0.05, "the LoRA must move the output for the comparison to mean anything"
        assert _max_diff(ours, ref) <= TOL, s
    assert len({id(v.adapters[-1].binding) for v in views}) == 1  # no rebuild: one binding for every strength
    assert len({v.adapters[-1].graph_key for v in views}) == 1 and buffers[0] == buffers[1] == buffers[2]
    lf.assert_untouched(before, engine.parts.unet)


def test_peft_layout_from_save_lora_weights_matches_diffusers(engine, models, inputs, transformer):
    path = zl.save_peft_lora(transformer, models / "peft")
    _matches_diffusers(engine, models, inputs, path)


@pytest.mark.parametrize("prefix,spelling", [("diffusion_model.", "lora_down"), ("diffusion_model.", "lora_A"),
                                             ("diffusion_model.", "lora.down"), ("lora_unet_", "lora_down"),
                                             ("lora_unet_", "lora.down")])
def test_original_layout_matches_diffusers(engine, models, inputs, transformer, prefix, spelling):
    """The model's own names with a fused qkv. diffusers reads fused qkv in the ``lora.down`` spelling only, and
    not the original x_embedder / final_layer names: its reference file holds the same tensors that way; in that
    spelling both read the very same file."""
    factors = zl.original_factors(transformer, seed=3)
    same = spelling == "lora.down"
    sd = zl.original_state_dict(factors, prefix, spelling, embedders="diffusers" if same else "original")
    assert any(k.startswith(prefix) and "attention" + ("_" if prefix == "lora_unet_" else ".") + "qkv" in k
               for k in sd)
    path = zl.write(sd, models / f"orig_{prefix}{spelling}.safetensors")
    ref = path if same else zl.write(zl.original_state_dict(factors, prefix, "lora.down", embedders="diffusers"),
                                     models / f"ref_{prefix}{spelling}.safetensors")
    _matches_diffusers(engine, models, inputs, path, ref)


def test_redundant_fused_copies_next_to_split_layers(engine, models, inputs, transformer):
    """A file with a fused qkv and a bare out next to split to_q/to_k/to_v and to_out.0 of the same blocks (some
    trainers write both): the copies carry the same delta, so the result is diffusers' (which skips them); a copy
    that differs is refused rather than one of the two picked silently."""
    factors = zl.original_factors(transformer, seed=4)
    fused = zl.original_state_dict(factors, spelling="lora.down", embedders="diffusers")
    split = zl.original_state_dict(factors, spelling="lora.down", fused=False, embedders="none")
    split = {k.replace("attention.out", "attention.to_out.0"): v for k, v in split.items() if ".attention." in k}
    path = zl.write({**fused, **split}, models / "redundant.safetensors")
    _matches_diffusers(engine, models, inputs, path, ref_path=path)
    key = "diffusion_model.layers.1.attention.to_k.lora.up.weight"
    bad = zl.write({**fused, **split, key: split[key] * 1.5}, models / "redundant_bad.safetensors")
    before = lf.snapshot(engine.parts.unet)
    with pytest.raises(ValueError, match=r"both target unet\.layers\.1\.attention\.to_k with different deltas"):
        inject_lora(engine, bad)
    lf.assert_untouched(before, engine.parts.unet)


def test_merged_mode_equals_unmerged_and_restores_the_weights(engine, models, inputs, transformer):
    path = zl.write(zl.original_state_dict(zl.original_factors(transformer, seed=5)), models / "merged.safetensors")
    before = lf.snapshot(engine.parts.unet)
    unmerged = _ours(inject_lora(engine, path, 0.8), inputs)
    merged = _ours(inject_lora(engine, path, 0.8, mode="merged"), inputs)
    assert _max_diff(merged, unmerged) <= TOL
    lf.assert_untouched(before, engine.parts.unet)


@pytest.fixture()
def loras(tmp_path, monkeypatch):
    monkeypatch.setenv("LEANDIFFUSION_MODELS", str(tmp_path))
    return tmp_path / "loras"


def test_a_lora_of_the_other_architecture_names_lora_name_and_leaves_the_model_untouched(engine, transformer, loras):
    node = NODE_CLASS_MAPPINGS["LeanLoraInjector"]()
    sd1 = tiny_components("sd1")
    lf.write(lf.kohya_state_dict({"unet": sd1["unet"], "text_encoder": sd1["text_encoder"]},
                                 {"unet": lf.ATTN_FF, "text_encoder": lf.TE_LINEARS}), loras / "sd_style.safetensors")
    zl.write(zl.original_state_dict(zl.original_factors(transformer)), loras / "z_style.safetensors")
    before = lf.snapshot(engine.parts.unet, engine.parts.text_encoder)
    with pytest.raises(ValueError, match=r"lora_name='sd_style.safetensors': a SD1.x / SD2.x / SDXL LoRA \(layers "
                                         r"such as lora_(unet|te)_.*the model is zimage \(Z-Image.*pick a "
                                         r"Z-Image LoRA for this model, or load a SD1.x / SD2.x / SDXL model"):
        node.inject(engine, "sd_style.safetensors", 1.0, 1.0, "", "unmerged")
    lf.assert_untouched(before, engine.parts.unet, engine.parts.text_encoder)
    (view,) = node.inject(engine, "z_style.safetensors", 1.0, 1.0, "", "unmerged")
    assert len(view.adapters) == 1 and engine.adapters == ()
    sd = tiny_engine("sd1")
    before = lf.snapshot(sd.parts.unet, sd.parts.text_encoder)
    with pytest.raises(ValueError, match=r"lora_name='z_style.safetensors': a Z-Image LoRA \(layers such as "
                                         r"diffusion_model\..*the model is sd1 .*pick a SD1.x / SD2.x / SDXL LoRA"):
        node.inject(sd, "z_style.safetensors", 1.0, 1.0, "", "unmerged")
    lf.assert_untouched(before, sd.parts.unet, sd.parts.text_encoder)


def test_keys_that_match_no_module_are_listed(engine, models, transformer):
    sd = zl.original_state_dict(zl.original_factors(transformer, rank=2))
    for key, (out, inp) in {"diffusion_model.layers.0.attention.norm_q": (32, 32),
                            "diffusion_model.layers.7.feed_forward.w1": (170, 64)}.items():
        sd.update({key + ".lora_down.weight": torch.zeros(2, inp), key + ".lora_up.weight": torch.zeros(out, 2)})
    before = lf.snapshot(engine.parts.unet)
    with pytest.raises(ValueError, match=r"2 of \d+ layers match no module of the zimage model.*"
                                         r"layers\.0\.attention\.norm_q.*layers\.7\.feed_forward\.w1"):
        inject_lora(engine, zl.write(sd, models / "unmatched.safetensors"))
    lf.assert_untouched(before, engine.parts.unet)


def test_a_fused_qkv_layer_whose_rows_do_not_split_in_three_is_refused(engine, models):
    key = "diffusion_model.layers.0.attention.qkv"
    sd = {key + ".lora_down.weight": torch.zeros(2, 64), key + ".lora_up.weight": torch.zeros(190, 2)}
    with pytest.raises(ValueError, match=r"fused qkv layer diffusion_model\.layers\.0\.attention\.qkv has an up "
                                         r"factor with 190 rows, not a multiple of 3"):
        inject_lora(engine, zl.write(sd, models / "bad_qkv.safetensors"))


def test_target_blocks_select_z_image_modules(engine, models, inputs, transformer):
    """diffusers module prefixes select the DiT's blocks; every other module keeps no LoRA term."""
    path = zl.write(zl.original_state_dict(zl.original_factors(transformer, seed=6)), models / "blocks.safetensors")
    view = inject_lora(engine, path, 1.0, target_blocks="layers.1, noise_refiner")
    names = {t.module_name for t in view.adapters[-1].binding.targets}
    assert names and all(n.startswith(("layers.1.", "noise_refiner.")) for n in names)
    assert {"layers.1.attention.to_q", "layers.1.attention.to_v", "noise_refiner.0.feed_forward.w2"} <= names
    assert _max_diff(_ours(view, inputs), zl.run_dit(engine.parts.unet, inputs)) > 0.01

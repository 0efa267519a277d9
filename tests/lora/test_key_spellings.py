"""Every key spelling ComfyUI 0.3.64's LoraLoader accepts for an SD1.x / SD2.x / SDXL layer reaches the same module
at the same scale here, or the file is refused by name (``lora/formats.py``, ``lora/keymap.py``).

Guards (each failed on the code before this file):
- the files ComfyUI itself writes, from its LoRA trainer and its "Extract and Save Lora" node
  (``diffusion_model.<LDM name>.lora_up.weight`` / ``.alpha``, ``text_encoders.clip_l.transformer.text_model...``,
  ``...clip_g...`` for SDXL's second encoder), were refused as an "unrecognised key layout"; so were SimpleTuner's
  ``lycoris_<module>`` files, kohya names with the PEFT factor spellings (``lora_unet_....lora_A.weight``), and PEFT
  keys in the attention-processor module spelling ComfyUI's key map uses (``unet.<attn>.processor.to_q.lora_A.weight``,
  ``.processor.to_out`` = ``to_out.0``). Each now computes exactly what the kohya spelling of the same factors does.
- layers for the CLIP-L ``text_projection`` (SD1.x, SDXL) and SD2.x's last OpenCLIP layer, modules ComfyUI patches
  but no image depends on (the engine leaves them out), were refused with "use a LoRA made for this model family",
  wrong for a file made for it: they are now skipped with a warning that names them (the picture is ComfyUI's).

The ``comfyui``-marked test runs ComfyUI's own ``model_lora_keys_unet`` / ``model_lora_keys_clip`` on the full-size
SD1.5, SD2.x and SDXL layouts (meta device) and, for every alias family they generate and every factor spelling
``load_lora`` reads, checks that a file of all those aliases resolves to ComfyUI's module for each alias, with
ComfyUI's scale (``alpha / rank``, or 1 without an alpha; alpha stored 0-d or as one element).
"""
import re

import pytest
import torch

from leandiffusion.lora import inject_lora
from leandiffusion.lora.formats import parse_lora
from leandiffusion.lora.keymap import resolve, targetable_modules
from leandiffusion.tests.kit import tiny_engine
from leandiffusion.tests.kit.comfy_source import comfyui_imports, without_torchvision
from leandiffusion.tests.lora import lorafiles as lf
from leandiffusion.tests.lora.test_target_blocks import _comfy_unet_config

UNET_ALL = re.compile(lf.ATTN_FF.pattern + "|" + lf.LOCON.pattern)
TE2 = re.compile(lf.TE_LINEARS.pattern + "|^text_projection$")
FACTORS = {  # every spelling of (down, up) that ComfyUI's LoRAAdapter.load reads, by a name for the test id
    "lora_down": (".lora_down.weight", ".lora_up.weight"), "lora_A": (".lora_A.weight", ".lora_B.weight"),
    "lora.down": (".lora.down.weight", ".lora.up.weight"),
    "lora_linear_layer": (".lora_linear_layer.down.weight", ".lora_linear_layer.up.weight"),
    "lora_A.default": (".lora_A.default.weight", ".lora_B.default.weight"), "lora_A_bare": (".lora_A", ".lora_B")}


@pytest.fixture(scope="module")
def sdxl():
    engine = tiny_engine("sdxl")
    roots = {"unet": engine.parts.unet, "text_encoder": engine.parts.text_encoder,
             "text_encoder_2": engine.parts.text_encoder_2}
    pats = {"unet": UNET_ALL, "text_encoder": lf.TE_LINEARS, "text_encoder_2": TE2}
    ldm = lf.tiny_sdxl_ldm_names(engine.parts.unet)
    sd = lf.kohya_state_dict(roots, pats, rank=4, seed=3, ldm_names=ldm, varied_alpha=True)
    # alphas as files store them: 0-d, one element, or none (scale 1)
    for i, key in enumerate(sorted(k for k in sd if k.endswith(".alpha"))):
        if i % 3 == 1:
            sd[key] = sd[key].reshape(1)
        elif i % 3 == 2:
            del sd[key]
    spelled = {}  # kohya layer base -> (ComfyUI base, lycoris_ base, PEFT processor-spelling base)
    for comp, pattern in pats.items():
        root = roots[comp]
        for name in lf.module_names(root, pattern):
            fname = lf.file_name(root, name)
            if comp == "unet":
                kohya = "lora_unet_" + ldm[name].replace(".", "_")
                processor = re.sub(r"\.(to_q|to_k|to_v|to_out)(\.0)?$", r".processor.\1", name)
                spelled[kohya] = ("diffusion_model." + ldm[name], "lycoris_" + name.replace(".", "_"),
                                  "unet." + processor)
            else:
                kohya = {"text_encoder": "lora_te1_", "text_encoder_2": "lora_te2_"}[comp] + fname.replace(".", "_")
                clip = {"text_encoder": "clip_l", "text_encoder_2": "clip_g"}[comp]
                spelled[kohya] = (f"text_encoders.{clip}.transformer.{fname}", kohya, f"{comp}.{fname}")
    assert any(".processor.to_out" in s[2] for s in spelled.values())
    assert "lora_te2_text_projection" in spelled
    return engine, sd, spelled


def _respell(sd: dict, spelled: dict, which: int, factors: tuple) -> dict:
    """``sd`` (kohya keys) with each layer base replaced by spelling ``which`` of ``spelled`` and the factors by
    ``factors``."""
    renamed = {".lora_down.weight": factors[0], ".lora_up.weight": factors[1]}
    out = {}
    for key, tensor in sd.items():
        base, suffix = key.split(".", 1)
        out[spelled[base][which] + renamed.get("." + suffix, "." + suffix)] = tensor
    return out


@pytest.mark.parametrize("spelling,which,factors", [
    ("comfyui", 0, FACTORS["lora_down"]),  # ComfyUI's trainer and LoRA extractor
    ("comfyui_A_B", 0, FACTORS["lora_A"]),
    ("lycoris_", 1, FACTORS["lora_down"]),  # SimpleTuner (UNet; the text encoders keep lora_te1_/lora_te2_)
    ("kohya_A_B", 1, FACTORS["lora_A"]),
    ("kohya_lora.down", 1, FACTORS["lora.down"]),
    ("peft_processor", 2, FACTORS["lora_A"]),
])
def test_comfyui_spellings_compute_what_kohya_does(sdxl, tmp_path, spelling, which, factors):
    engine, sd, spelled = sdxl
    ref = lf.view_outputs(inject_lora(engine, lf.write(sd, tmp_path / "kohya.safetensors"), 0.7, 1.3))
    assert lf.max_diff(ref, lf.view_outputs(engine)) > 0.05
    other = _respell(sd, spelled, which, factors)
    view = inject_lora(engine, lf.write(other, tmp_path / f"{spelling}.safetensors"), 0.7, 1.3)
    assert len(view.adapters[0].binding.targets) == len({k.rsplit(".lora_", 1)[0] for k in sd if ".lora_" in k})
    assert all(torch.equal(a, b) for a, b in zip(lf.view_outputs(view), ref))


def test_comfyui_spelling_of_loha_and_dora(tmp_path):
    """ComfyUI's trainer writes LoHa / LoKr in its own spelling too (``diffusion_model.<LDM name>.hada_w1_a``...)."""
    engine = tiny_engine("sdxl")
    ldm = lf.tiny_sdxl_ldm_names(engine.parts.unet)
    for case in ("loha_lowrank", "lokr_both_lowrank", "dora_in", "locon_tucker"):
        sd = lf.lycoris_case({"unet": engine.parts.unet}, {"unet": UNET_ALL}, case, seed=4, ldm_names=ldm)
        table = {"lora_unet_" + v.replace(".", "_"): "diffusion_model." + v for v in ldm.values()}
        comfy = {table[k.split(".", 1)[0]] + "." + k.split(".", 1)[1]: v for k, v in sd.items()}
        ref = lf.view_outputs(inject_lora(engine, lf.write(sd, tmp_path / f"{case}_k.safetensors"), 0.8))
        got = lf.view_outputs(inject_lora(engine, lf.write(comfy, tmp_path / f"{case}_c.safetensors"), 0.8))
        assert lf.max_diff(ref, lf.view_outputs(engine)) > 0.01, case
        assert all(torch.equal(a, b) for a, b in zip(got, ref)), case


def test_two_spellings_of_one_factor_are_refused(sdxl, tmp_path):
    engine, sd, _ = sdxl
    key = next(k for k in sd if k.endswith(".lora_down.weight"))
    sd = {**sd, key.replace(".lora_down.weight", ".lora_A.weight"): sd[key].clone()}
    before = lf.snapshot(engine.parts.unet, engine.parts.text_encoder, engine.parts.text_encoder_2)
    with pytest.raises(ValueError, match=rf"layer {re.escape(key.split('.')[0])} holds its lora_down factor twice"):
        inject_lora(engine, lf.write(sd, tmp_path / "twice.safetensors"))
    lf.assert_untouched(before, engine.parts.unet, engine.parts.text_encoder, engine.parts.text_encoder_2)


@pytest.mark.parametrize("family,key", [
    ("sd1", "lora_te_text_projection"), ("sdxl", "lora_te1_text_projection"),
    ("sd2", "lora_te_text_model_encoder_layers_{n}_mlp_fc1"),
    ("sd2", "text_encoders.clip_h.transformer.text_model.encoder.layers.{n}.mlp.fc1")])
def test_layers_of_modules_no_image_depends_on_are_skipped_with_a_warning(tmp_path, caplog, family, key):
    """ComfyUI patches these modules to no effect on the image; the same file here gives the picture of the file
    without those layers, and a warning names them (it was refused)."""
    engine = tiny_engine(family)
    te = engine.parts.text_encoder
    key = key.format(n=te.config.num_hidden_layers)  # SD2's last OpenCLIP layer, which the engine leaves out
    width = te.config.hidden_size
    roots = {"unet": engine.parts.unet, "text_encoder": te}
    live = lf.kohya_state_dict(roots, {"unet": lf.ATTN_FF, "text_encoder": lf.TE_LINEARS}, rank=2, seed=5)
    dead = {key + ".lora_down.weight": torch.randn(2, width), key + ".lora_up.weight": torch.randn(width, 2)}
    ref = lf.view_outputs(inject_lora(engine, lf.write(live, tmp_path / "live.safetensors"), 0.9, 1.1))
    with caplog.at_level("WARNING", logger="leandiffusion.lora.keymap"):
        view = inject_lora(engine, lf.write({**live, **dead}, tmp_path / "with_dead.safetensors"), 0.9, 1.1)
    assert all(torch.equal(a, b) for a, b in zip(lf.view_outputs(view), ref))
    assert lf.max_diff(ref, lf.view_outputs(engine)) > 0.01
    assert re.search(rf"skipping 1 layers for text-encoder modules that no image depends on.*ComfyUI applies them "
                     rf"without effect: {re.escape(key)}$", caplog.text, re.M)


def test_extra_text_layers_of_another_family_still_name_the_family(tmp_path):
    """Only SD2's own dropped layer counts as left out: an SD2 file's text layers 12-22 on SD1 are a family error."""
    engine = tiny_engine("sd1")
    n = engine.parts.text_encoder.config.num_hidden_layers
    key = f"lora_te_text_model_encoder_layers_{n}_mlp_fc1"
    sd = {key + ".lora_down.weight": torch.zeros(2, 32), key + ".lora_up.weight": torch.zeros(32, 2)}
    with pytest.raises(ValueError, match=rf"1 of 1 layers match no module of the sd1 model.*: {key}$"):
        inject_lora(engine, lf.write(sd, tmp_path / "sd2te.safetensors"))


# --------------------------------------------------------------------------------------------- ComfyUI's key maps
SD2_UNET = dict(sample_size=96, in_channels=4, out_channels=4, block_out_channels=(320, 640, 1280, 1280),
                layers_per_block=2, down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
                up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3, cross_attention_dim=1024,
                attention_head_dim=(5, 10, 20, 20), use_linear_projection=True, norm_num_groups=32)
# OpenCLIP-H as the engine loads it: 23 of its 24 layers (SD2 conditions on the penultimate one)
CLIP_H = dict(vocab_size=49408, hidden_size=1024, intermediate_size=4096, num_hidden_layers=23, num_attention_heads=16,
              max_position_embeddings=77, hidden_act="gelu", projection_dim=1024)
CLIPS = {"sd15": {"clip_l": "text_encoder"}, "sd2": {"clip_h": "text_encoder"},
         "sdxl": {"clip_l": "text_encoder", "clip_g": "text_encoder_2"}}


class _ComfyModel:
    """What ComfyUI's ``model_lora_keys_unet`` reads of a model: its state-dict keys and ``unet_config``."""

    def __init__(self, keys, unet_config):
        self.keys, self.model_config = keys, type("Config", (), {"unet_config": unet_config})()

    def state_dict(self):
        return dict.fromkeys(self.keys)


def _family(alias: str) -> str:
    for prefix in ("lora_unet_", "lycoris_", "lora_te1_", "lora_te2_", "lora_te_", "lora_prior_te_", "unet.",
                   "text_encoders.", "text_encoder_2.", "text_encoder.", "diffusion_model."):
        if alias.startswith(prefix):
            if prefix == "lora_unet_":
                ldm = re.match(r"lora_unet_(input_blocks|middle_block|output_blocks|out_\d|time_embed_\d|label_emb_)",
                               alias)
                return prefix + ("ldm" if ldm else "diffusers")
            return prefix
    return "(diffusers name)"


@pytest.fixture(scope="module")
def comfy():
    """ComfyUI's ``comfy`` package from COMFYUI_PATH, imported before the test (its import sets process-wide state:
    ``comfy.model_management``'s torch switches). What the engine imports is imported first, so none of it binds the
    torchvision stand-in."""
    import diffusers.loaders.single_file_utils  # noqa: F401
    import transformers.modeling_utils  # noqa: F401

    with comfyui_imports(), without_torchvision():
        import comfy.lora
        import comfy.sd1_clip
        import comfy.sdxl_clip
        import comfy.text_encoders.sd2_clip
        import comfy.utils
    return comfy


def _full_size(kind, comfy):
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from leandiffusion.bench.models import CLIP_G, CLIP_L, SD15_UNET, SDXL_UNET

    with torch.device("meta"):
        unet = UNet2DConditionModel(**{"sd15": SD15_UNET, "sd2": SD2_UNET, "sdxl": SDXL_UNET}[kind])
        te = CLIPTextModel(CLIPTextConfig(**(CLIP_H if kind == "sd2" else CLIP_L)))
        te2 = CLIPTextModelWithProjection(CLIPTextConfig(**CLIP_G)) if kind == "sdxl" else None
        clip = {"sd15": comfy.sd1_clip.SD1ClipModel, "sd2": comfy.text_encoders.sd2_clip.SD2ClipModel,
                "sdxl": comfy.sdxl_clip.SDXLClipModel}[kind](device="meta")
    config = _comfy_unet_config(dict(unet.config))
    to_ldm = comfy.utils.unet_to_diffusers(config)
    key_map = comfy.lora.model_lora_keys_unet(_ComfyModel(["diffusion_model." + v for v in to_ldm.values()], config),
                                              {})
    key_map = comfy.lora.model_lora_keys_clip(clip, key_map)
    return {"unet": unet, "text_encoder": te, "text_encoder_2": te2}, key_map, {
        "diffusion_model." + v: k[:-len(".weight")] for k, v in to_ldm.items() if k.endswith(".weight")}


def _our_module(kind, roots, comfy_key, from_ldm):
    """ComfyUI's target weight key -> (component, module name) in the engine's model, None if it has no such
    Linear/Conv2d (norm weights, ComfyUI's UNet-agnostic alias table)."""
    if comfy_key.startswith("diffusion_model."):
        name = from_ldm.get(comfy_key)
        return ("unet", name) if name in targetable_modules(roots["unet"]) else None
    clip, _, rest = comfy_key.partition(".transformer.")
    comp = CLIPS[kind].get(clip)
    if comp is None or not rest.endswith(".weight"):
        return None
    name, modules = rest[:-len(".weight")], targetable_modules(roots[comp])
    flat = name[len("text_model."):] if name.startswith("text_model.") else name
    return next(((comp, n) for n in (name, flat) if n in modules), None)


@pytest.mark.comfyui
@pytest.mark.parametrize("kind", ["sd15", "sd2", "sdxl"])
def test_every_alias_of_comfyuis_key_maps_resolves_like_comfyui(comfy, kind, caplog):
    roots, key_map, from_ldm = _full_size(kind, comfy)
    families, dead = {}, []
    for alias, comfy_key in key_map.items():
        if not isinstance(comfy_key, str) or (kind == "sdxl" and "class_embedding" in alias):
            continue  # class_embedding: ComfyUI's second alias of label_emb; diffusers' SDXL UNet has none
        ours = _our_module(kind, roots, comfy_key, from_ldm)
        if alias.startswith("lora_prior_te_"):  # Stable Cascade's prefix; ComfyUI also maps it onto SDXL's clip_g
            dead.append(alias)
        elif ours is not None:
            families.setdefault(_family(alias), {})[alias] = ours
        elif comfy_key.startswith("clip_") and re.search(r"(text_projection|encoder\.layers\.\d+\.(self_attn|mlp))",
                                                         comfy_key):
            dead.append(alias)
    expected_families = {"lora_unet_ldm", "lora_unet_diffusers", "lycoris_", "unet.", "(diffusers name)",
                         "diffusion_model.", "text_encoders.", "lora_te_", "lora_te1_", "text_encoder."}
    expected_families |= {"lora_te2_", "text_encoder_2."} if kind == "sdxl" else set()
    assert set(families) == expected_families
    for family, aliases in sorted(families.items()):
        for spelling, (down_suffix, up_suffix) in FACTORS.items():
            sd, want = {}, {}
            for i, (alias, (comp, name)) in enumerate(sorted(aliases.items())):
                shape = roots[comp].get_submodule(name).weight.shape
                sd[alias + down_suffix] = torch.full((1, *shape[1:]), 0.01)
                sd[alias + up_suffix] = torch.full((shape[0], 1, 1, 1) if len(shape) == 4 else (shape[0], 1), 0.01)
                alpha = (0.5, 0.25, None)[i % 3]  # ComfyUI: scale = alpha / rank (rank 1), 1 without an alpha
                if alpha is not None:  # stored 0-d or as one element
                    sd[alias + ".alpha"] = torch.tensor(alpha) if i % 2 else torch.tensor([alpha])
                want[(comp, name)] = 1.0 if alpha is None else alpha
            targets = resolve(parse_lora(sd, {}, f"{kind} {family} {spelling}"), roots, kind)
            got = {(t.component, t.module_name): t.layer.scale for t in targets}
            assert got == want, (family, spelling)
    # ComfyUI patches these modules, which no image depends on and the engine leaves out: skipped with a warning
    assert dead
    for alias in dead:
        comfy_key = key_map[alias]
        width = 1280 if "clip_g" in comfy_key else 1024 if "clip_h" in comfy_key else 768
        sd = {alias + ".lora_down.weight": torch.zeros(1, width), alias + ".lora_up.weight": torch.zeros(width, 1)}
        if alias.startswith("lora_prior_te_"):  # not a family the pack loads: refused by name
            with pytest.raises(ValueError, match=rf"match no module.*: {re.escape(alias)}$"):
                resolve(parse_lora(sd, {}, "f"), roots, kind)
            continue
        with caplog.at_level("WARNING", logger="leandiffusion.lora.keymap"):
            caplog.clear()
            assert resolve(parse_lora(sd, {}, "f"), roots, kind) == []
        assert re.search(rf"no image depends on.*: {re.escape(alias)}$", caplog.text, re.M), alias

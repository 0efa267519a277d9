"""``target_blocks`` in the spellings a ComfyUI user types, against references the code under test does not derive.

Guards (each failed on the code before this file):
- ComfyUI / LDM block names (``input_blocks.3``, ``middle_block``, ``output_blocks.1``, ``diffusion_model.`` keys)
  and LoRA Block Weight indices (``IN03``, ``MID``, ``OUT01``) were refused as "names no module", although they are
  what ComfyUI users know; they now select exactly the modules of that LDM block: the UNet output equals an fp64
  merged-weights model where *only* those modules got the delta (LDM names from the hand-written table in
  ``lorafiles``), and, on the real SD1.5 / SDXL layouts, the selection equals ComfyUI's own key map
  (``comfy.utils.unet_to_diffusers``, test marked ``comfyui``).
- text-encoder prefixes worked in one spelling per encoder and transformers version: on transformers 5,
  ``text_encoder.text_model.encoder.layers.0`` (the spelling of LoRA files, diffusers and transformers 4) was refused
  while ``text_encoder_2`` (``CLIPTextModelWithProjection`` keeps ``text_model``) refused the spelling without it.
- a bad selector's message listed the first 8 top-level module names alphabetically (``add_embedding``,
  ``conv_act``... but not ``up_blocks``): it now names the input, the value and this model's valid blocks.
"""
import re

import pytest
import torch

from leandiffusion.lora import inject_lora
from leandiffusion.lora.keymap import Target, targetable_modules
from leandiffusion.lora.targets import filter_targets
from leandiffusion.tests.kit import tiny_engine
from leandiffusion.tests.lora import lorafiles as lf
from leandiffusion.tests.kit.comfy_source import comfyui_imports

TOL = 1e-5
UNET_ALL = re.compile(lf.ATTN_FF.pattern + "|" + lf.LOCON.pattern)


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory):
    engine = tiny_engine("sdxl")
    lf.run_text(engine.parts)
    roots = {"unet": engine.parts.unet, "text_encoder": engine.parts.text_encoder,
             "text_encoder_2": engine.parts.text_encoder_2}
    pats = {"unet": UNET_ALL, "text_encoder": lf.TE_LINEARS, "text_encoder_2": lf.TE_LINEARS}
    ldm = lf.tiny_sdxl_ldm_names(engine.parts.unet)
    sd = lf.kohya_state_dict(roots, pats, rank=4, seed=3, ldm_names=ldm, varied_alpha=True)
    return engine, sd, lf.write(sd, tmp_path_factory.mktemp("tb") / "xl.safetensors"), ldm


def _selected(view):
    return {(t.component, t.module_name) for t in view.adapters[-1].binding.targets}


def _reference_unet(sd, ldm, strength, chosen):
    """A fresh tiny SDXL UNet with W + s * alpha / r * up @ down (fp64) written into the ``chosen`` modules only."""
    unet = tiny_engine("sdxl").parts.unet
    with torch.no_grad():
        for name in lf.module_names(unet, UNET_ALL):
            if not chosen(ldm[name]):
                continue
            key = "lora_unet_" + ldm[name].replace(".", "_")
            down, up = sd[key + ".lora_down.weight"].double(), sd[key + ".lora_up.weight"].double()
            w = unet.get_submodule(name).weight
            delta = (up.flatten(1) @ down.flatten(1)).reshape(w.shape) * (sd[key + ".alpha"].item() / down.shape[0])
            w.copy_((w.double() + strength * delta).float())
    return unet


@pytest.mark.parametrize("spelling", ["input_blocks.3, output_blocks.1", "IN03, out01",
                                      "diffusion_model.input_blocks.3, unet.output_blocks.1"])
def test_ldm_and_block_weight_selectors_touch_exactly_their_blocks(sdxl, spelling):
    engine, sd, path, ldm = sdxl
    before = lf.snapshot(engine.parts.unet)
    view = inject_lora(engine, path, strength=1.4, target_blocks=spelling)
    chosen = lambda name: name.startswith(("input_blocks.3.", "output_blocks.1."))
    want = {("unet", n) for n in lf.module_names(engine.parts.unet, UNET_ALL) if chosen(ldm[n])}
    assert want and _selected(view) == want
    # the same blocks in diffusers naming (lorafiles' hand table: input_blocks.3 = down_blocks.1's resnet+attention,
    # output_blocks.1 = up_blocks.0's second resnet+attention and its upsampler)
    diffusers = inject_lora(engine, path, strength=1.4, target_blocks="down_blocks.1.resnets.0, "
                            "down_blocks.1.attentions.0, up_blocks.0.resnets.1, up_blocks.0.attentions.1, "
                            "up_blocks.0.upsamplers.0")
    assert _selected(diffusers) == want
    inputs = lf.unet_inputs("sdxl")
    with view.session("unet"):
        ours = lf.run_unet(engine.parts.unet, inputs)
    ref = lf.run_unet(_reference_unet(sd, ldm, 1.4, chosen), inputs)
    base = lf.run_unet(engine.parts.unet, inputs)
    assert (ref - base).abs().max() > 0.05
    assert (ours - ref).abs().max() <= TOL
    lf.assert_untouched(before, engine.parts.unet)


@pytest.mark.parametrize("spelling", ["middle_block", "MID", "M00", "diffusion_model.middle_block"])
def test_middle_block_spellings(sdxl, spelling):
    engine, _, path, _ = sdxl
    assert _selected(inject_lora(engine, path, target_blocks=spelling)) == \
        _selected(inject_lora(engine, path, target_blocks="mid_block"))


def test_text_encoder_prefixes_with_and_without_text_model(sdxl):
    engine, _, path, _ = sdxl
    for comp, te in (("text_encoder", engine.parts.text_encoder), ("text_encoder_2", engine.parts.text_encoder_2)):
        want = {(comp, n) for n in lf.module_names(te, lf.TE_LINEARS) if re.search(r"(^|\.)encoder\.layers\.1\.", n)}
        assert want
        for spelled in ("text_model.encoder.layers.1", "encoder.layers.1"):
            assert _selected(inject_lora(engine, path, target_blocks=f"{comp}.{spelled}")) == want, (comp, spelled)


def test_a_component_name_alone_selects_that_whole_component(sdxl):
    """``text_encoder`` / ``text_encoder_2`` / ``unet`` alone: every layer of the LoRA in that component, no other
    (the file covers every attention / MLP Linear of both encoders and the UNet's attention, feed-forward and conv
    layers: ``lorafiles``' patterns, not the selector code, say which)."""
    engine, _, path, _ = sdxl
    roots = {"unet": (engine.parts.unet, UNET_ALL), "text_encoder": (engine.parts.text_encoder, lf.TE_LINEARS),
             "text_encoder_2": (engine.parts.text_encoder_2, lf.TE_LINEARS)}
    for comp, (root, pattern) in roots.items():
        want = {(comp, n) for n in lf.module_names(root, pattern)}
        assert want and _selected(inject_lora(engine, path, target_blocks=comp)) == want, comp
    both = {(c, n) for c in ("text_encoder", "text_encoder_2") for n in lf.module_names(roots[c][0], lf.TE_LINEARS)}
    assert _selected(inject_lora(engine, path, target_blocks="text_encoder_2, text_encoder")) == both


@pytest.mark.parametrize("value,valid", [
    ("input_blocks.9", r"diffusers blocks down_blocks\.0-1, mid_block, up_blocks\.0-1 .*ComfyUI/LDM blocks "
                       r"input_blocks\.0-3, middle_block, output_blocks\.0-3; LoRA Block Weight IN00-IN03, MID, "
                       r"OUT00-OUT03"),
    ("IN07", "input_blocks"), ("up_block.1", "up_blocks"),
    ("text_encoder_2.encoder.layers.9", r"text_encoder_2 alone, or text_encoder_2\.<module>.*encoder\.layers\.0-"),
])
def test_bad_selector_names_input_value_and_valid_blocks(sdxl, value, valid):
    engine, _, path, _ = sdxl
    before = lf.snapshot(engine.parts.unet, engine.parts.text_encoder_2)
    with pytest.raises(ValueError, match=rf"target_blocks: {re.escape(repr(value))} names no module .*valid "
                                         rf"choices: .*{valid}"):
        inject_lora(engine, path, target_blocks=f"mid_block, {value}")
    lf.assert_untouched(before, engine.parts.unet, engine.parts.text_encoder_2)


# --------------------------------------------------------------------------------------------- ComfyUI's key map
def _comfy_unet_config(cfg) -> dict:
    """The keys of ComfyUI's ``unet_config`` that ``comfy.utils.unet_to_diffusers`` reads, from a diffusers config."""
    types = cfg["down_block_types"]
    n = len(types)
    lpb = cfg["layers_per_block"]
    lpb = [lpb] * n if isinstance(lpb, int) else list(lpb)
    tl = cfg["transformer_layers_per_block"]
    tl = [tl] * n if isinstance(tl, int) else list(tl)
    depth = [tl[x] if "CrossAttn" in types[x] else 0 for x in range(n)]
    return {"num_res_blocks": lpb, "channel_mult": [1] * n,
            "transformer_depth": [d for x in range(n) for d in [depth[x]] * lpb[x]],
            "transformer_depth_output": [d for x in range(n) for d in [depth[x]] * (lpb[x] + 1)],
            "transformer_depth_middle": tl[-1]}


@pytest.mark.comfyui
@pytest.mark.parametrize("kind", ["sd15", "sdxl", "tiny_sd1", "tiny_sdxl"])
def test_ldm_selectors_follow_comfyui_key_map(kind):
    with comfyui_imports():
        import comfy.utils
    from diffusers import UNet2DConditionModel

    from leandiffusion.bench.models import SD15_UNET, SDXL_UNET

    if kind.startswith("tiny_"):
        unet = tiny_engine(kind[5:]).parts.unet
    else:
        with torch.device("meta"):
            unet = UNet2DConditionModel(**{"sd15": SD15_UNET, "sdxl": SDXL_UNET}[kind])
    comfy_map = comfy.utils.unet_to_diffusers(_comfy_unet_config(dict(unet.config)))
    modules = targetable_modules(unet)
    ldm_of = {n: comfy_map[n + ".weight"][:-len(".weight")] for n in modules}  # every module has a ComfyUI key
    targets = [Target("unet", n, m, None) for n, m in modules.items()]
    blocks = sorted({".".join(v.split(".")[:2]) for v in ldm_of.values() if v.startswith(("input_", "output_"))}
                    | {"middle_block"})
    for block in blocks:
        want = {n for n, v in ldm_of.items() if v.startswith(block + ".")}
        got = {t.module_name for t in filter_targets(targets, block, {"unet": unet})}
        assert want and got == want, block
        head, _, idx = block.partition(".")
        lbw = "MID" if head == "middle_block" else f"{'IN' if head == 'input_blocks' else 'OUT'}{int(idx):02d}"
        assert {t.module_name for t in filter_targets(targets, lbw, {"unet": unet})} == want, lbw


def test_numbered_selectors_stop_at_the_dot_on_full_size_layouts():
    """``input_blocks.1`` / ``IN01`` / ``output_blocks.1`` / ``encoder.layers.1`` select block 1 only, never blocks 10
    and 11, which full-size models have (SD1.5: input_blocks and output_blocks 0-11; CLIP: 12 layers) and the tiny
    test models do not. Runs without ComfyUI (the ``comfyui`` test above checks every block against its key map);
    the expected modules are SD1.5's LDM layout written out by hand: input_blocks.1 = down_blocks.0's first resnet
    and attention, output_blocks.1 = up_blocks.0's second resnet."""
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from leandiffusion.bench.models import SD15_UNET

    with torch.device("meta"):
        unet = UNet2DConditionModel(**SD15_UNET)
        text = CLIPTextModel(CLIPTextConfig())  # 12 layers
    targets = [Target("unet", n, m, None) for n, m in targetable_modules(unet).items()]
    targets += [Target("text_encoder", n, m, None) for n, m in targetable_modules(text).items()]
    roots = {"unet": unet, "text_encoder": text}

    def chosen(selector):
        return {(t.component, t.module_name) for t in filter_targets(targets, selector, roots)}

    def under(comp, *prefixes):
        return {(t.component, t.module_name) for t in targets
                if t.component == comp and t.module_name.startswith(tuple(p + "." for p in prefixes))}

    in1 = under("unet", "down_blocks.0.resnets.0", "down_blocks.0.attentions.0")
    assert in1 and chosen("input_blocks.1") == in1 and chosen("IN01") == in1
    out1 = under("unet", "up_blocks.0.resnets.1")
    assert out1 and chosen("output_blocks.1") == out1 and chosen("OUT01") == out1
    layer1 = {(c, n) for c, n in under("text_encoder", *{t.module_name.rsplit("encoder.layers.", 1)[0]
                                                            + "encoder.layers.1" for t in targets
                                                            if "encoder.layers." in t.module_name})}
    assert len(layer1) >= 4 and chosen("text_encoder.text_model.encoder.layers.1") == layer1
    assert chosen("down_blocks.1") == under("unet", "down_blocks.1")

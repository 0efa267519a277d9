"""Bad inputs give a clear ValueError/TypeError naming the problem, and leave the input model untouched.

Guards: keys matching no module are listed (never silently ignored); an SDXL LoRA on SD1 (and the reverse) is
refused with the family named; corrupt files; unsupported LyCORIS variants (Tucker, OFT, PEFT DoRA); target_blocks typos; bad strengths.
"""
import re

import pytest
import torch

from leandiffusion.lora import inject_lora
from leandiffusion.memory.engine import engine_from_parts, parts_from_components
from leandiffusion.tests.kit import tiny_components
from leandiffusion.tests.lora import lorafiles as lf

UNET_ATTN = lf.ATTN_FF


@pytest.fixture(scope="module")
def sd1():
    c = tiny_components("sd1")
    engine = engine_from_parts(parts_from_components(c))
    lf.run_text(engine.parts)
    return engine


@pytest.fixture(scope="module")
def sd1_lora(sd1, tmp_path_factory):
    roots = {"unet": sd1.parts.unet, "text_encoder": sd1.parts.text_encoder}
    sd = lf.kohya_state_dict(roots, {"unet": UNET_ATTN, "text_encoder": lf.TE_LINEARS}, rank=2)
    return sd


def _refused(engine, path, match, exc=ValueError, **kwargs):
    before = lf.snapshot(engine.parts.unet, engine.parts.text_encoder)
    with pytest.raises(exc, match=match):
        inject_lora(engine, path, **kwargs)
    lf.assert_untouched(before, engine.parts.unet, engine.parts.text_encoder)


def test_unmatched_keys_are_listed(sd1, sd1_lora, tmp_path):
    sd = dict(sd1_lora)
    for name in ("lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn9_to_q",
                 "lora_te_text_model_encoder_layers_7_mlp_fc1"):
        sd[name + ".lora_down.weight"] = torch.zeros(2, 64)
        sd[name + ".lora_up.weight"] = torch.zeros(64, 2)
    path = lf.write(sd, tmp_path / "extra.safetensors")
    _refused(sd1, path, r"2 of \d+ layers match no module.*(attn9_to_q.*layers_7_mlp_fc1|layers_7_mlp_fc1.*attn9_to_q)")


def test_sdxl_lora_on_sd1_names_the_family(sd1, tmp_path):
    c = tiny_components("sdxl")
    roots = {"unet": c["unet"], "text_encoder": c["text_encoder"], "text_encoder_2": c["text_encoder_2"]}
    sd = lf.kohya_state_dict(roots, {"unet": UNET_ATTN, "text_encoder": lf.TE_LINEARS,
                                     "text_encoder_2": lf.TE_LINEARS},
                             ldm_names=lf.tiny_sdxl_ldm_names(c["unet"]))
    path = lf.write(sd, tmp_path / "sdxl.safetensors")
    _refused(sd1, path, r"text_encoder_2.*sd1 model does not have.*SDXL LoRA")
    unet_only = lf.write({k: v for k, v in sd.items() if k.startswith("lora_unet_")}, tmp_path / "sdxl_unet.safetensors")
    _refused(sd1, unet_only, r"(match no module|do not fit)")


def test_sd1_lora_on_sdxl_is_refused(sd1_lora, tmp_path):
    engine = engine_from_parts(parts_from_components(tiny_components("sdxl")))
    lf.run_text(engine.parts)
    path = lf.write(sd1_lora, tmp_path / "sd1.safetensors")
    before = lf.snapshot(engine.parts.unet, engine.parts.text_encoder, engine.parts.text_encoder_2)
    with pytest.raises(ValueError, match=r"(match no module|do not fit)"):
        inject_lora(engine, path)
    lf.assert_untouched(before, engine.parts.unet, engine.parts.text_encoder, engine.parts.text_encoder_2)


def test_real_width_family_hint(sd1, tmp_path):
    """A LoRA whose cross-attention keys read a 2048-wide context is called an SDXL LoRA in the error."""
    key = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn2_to_k"
    sd = {key + ".lora_down.weight": torch.zeros(2, 2048), key + ".lora_up.weight": torch.zeros(32, 2)}
    _refused(sd1, lf.write(sd, tmp_path / "xl.safetensors"), r"looks like a SDXL LoRA.*do not fit|do not fit.*SDXL")


@pytest.mark.parametrize("content", [b"", b"not a safetensors file at all" * 10, "truncate"])
def test_corrupt_files(sd1, sd1_lora, tmp_path, content):
    path = tmp_path / "bad.safetensors"
    if content == "truncate":
        good = lf.write(sd1_lora, tmp_path / "good.safetensors").read_bytes()
        path.write_bytes(good[: len(good) // 2])
    else:
        path.write_bytes(content)
    _refused(sd1, path, r"could not be read as a safetensors file")
    pt = tmp_path / "bad.pt"
    pt.write_bytes(b"\x80\x04garbage")
    _refused(sd1, pt, r"could not be read as a torch weights file")


@pytest.mark.parametrize("bad_key,kind", [("lora_unet_x.hada_t1", "LoHa with Tucker"),
                                          ("lora_unet_x.lora_magnitude_vector", "PEFT DoRA"),
                                          ("lora_unet_x.oft_blocks", "OFT"), ("lora_unet_x.diff", "full weight difference")])
def test_unsupported_variants(sd1, sd1_lora, tmp_path, bad_key, kind):
    """LoHa, LoKr, DoRA and Tucker LoCon load (tests/lora/test_lycoris*.py); these variants are refused."""
    sd = dict(sd1_lora)
    sd[bad_key] = torch.zeros(2, 2)
    _refused(sd1, lf.write(sd, tmp_path / "v.safetensors"), kind)


def test_incomplete_and_unknown_keys(sd1, sd1_lora, tmp_path):
    sd = dict(sd1_lora)
    sd.pop(next(k for k in sd if k.endswith("lora_up.weight")))
    _refused(sd1, lf.write(sd, tmp_path / "inc.safetensors"), "lack a lora_down or lora_up")
    sd = dict(sd1_lora)
    sd["lora_unet_conv_in.weird"] = torch.zeros(1)
    _refused(sd1, lf.write(sd, tmp_path / "unk.safetensors"), "unknown suffix")
    _refused(sd1, lf.write({"model.weight": torch.zeros(2)}, tmp_path / "ckpt.safetensors"), "unrecognised key layout")


def test_target_blocks_errors(sd1, sd1_lora, tmp_path):
    path = lf.write(sd1_lora, tmp_path / "ok.safetensors")
    _refused(sd1, path, r"'input_blocks.4' names no module.*diffusers", target_blocks="mid_block, input_blocks.4")
    _refused(sd1, path, r"'down_blocks.1' covers no layer of this LoRA", target_blocks="down_blocks.1")
    _refused(sd1, path, r"text_encoder_2.*does not have", target_blocks="text_encoder_2")
    _refused(sd1, path, "contains spaces", target_blocks="mid_block up_blocks.1")
    view = inject_lora(sd1, path, target_blocks=" mid_block , text_encoder ,")
    names = {(t.component, t.module_name.split(".")[0]) for t in view.adapters[0].binding.targets}
    te_top = {n.split(".")[0] for n in lf.module_names(sd1.parts.text_encoder, lf.TE_LINEARS)}
    assert names == {("unet", "mid_block")} | {("text_encoder", t) for t in te_top}


@pytest.mark.parametrize("kwargs,exc,match", [
    ({"strength": "1"}, TypeError, "strength: expected a number"),
    ({"strength": float("nan")}, ValueError, "strength=nan"),
    ({"strength_text_encoder": 11.0}, ValueError, "strength_text_encoder=11.0"),
    ({"mode": "fused"}, ValueError, "mode='fused'"),
    ({"target_blocks": None}, TypeError, "target_blocks"),
    ({"strategy": "fused"}, ValueError, "strategy='fused'"),
    ({"strategy": "preadd"}, ValueError, "expected one of hook, geglu, auto"),  # removed strategy: refused
])
def test_bad_arguments(sd1, sd1_lora, tmp_path, kwargs, exc, match):
    path = lf.write(sd1_lora, tmp_path / "ok.safetensors")
    _refused(sd1, path, match, exc=exc, **kwargs)


@pytest.mark.parametrize("value", [None, "lean_model", {"parts": None}])
def test_not_an_engine_is_a_type_error(sd1_lora, tmp_path, value):
    # bug guarded: a wrong input (e.g. a ComfyUI MODEL) failed with "AttributeError: 'str' object has no attribute 'parts'"
    path = lf.write(sd1_lora, tmp_path / "ok.safetensors")
    with pytest.raises(TypeError, match=rf"lean_model: expected a LEAN_MODEL .*got {type(value).__name__}"):
        inject_lora(value, path)


def test_missing_file(sd1, tmp_path):
    _refused(sd1, tmp_path / "nope.safetensors", "does not exist")


def test_merged_refused_under_weight_streaming(sd1, sd1_lora, tmp_path):
    """Streamed blocks are re-copied from host every step, so a merge would silently vanish: refuse it."""
    from leandiffusion.memory.engine import ResidentPlacement
    from leandiffusion.memory.vram_budget import StageMode, VramBudget

    class StreamingPlacement(ResidentPlacement):
        budget = VramBudget(unet=StageMode.STREAM)

    engine = sd1.with_changes(placement=StreamingPlacement())
    path = lf.write(sd1_lora, tmp_path / "ok.safetensors")
    _refused(engine, path, "cannot be used while the model's VRAM policy streams", mode="merged")
    assert len(inject_lora(engine, path, mode="unmerged").adapters) == 1


# Each refusal names the file, the layer and the problem, and leaves the model untouched.
_Q = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"  # Linear 32 -> 32
_PROJ = "lora_unet_down_blocks_0_attentions_0_proj_in"  # 1x1 conv 32 -> 32
_CONV_IN = "lora_unet_conv_in"  # 3x3 conv 4 -> 32


def _pair(key, down, up):
    return {key + ".lora_down.weight": down, key + ".lora_up.weight": up}


_FIT = r"1 layers do not fit their modules; use a LoRA made for this model family: "


@pytest.mark.parametrize("sd,match", [
    ({}, r"lora bad.safetensors: the file holds no tensors"),
    (_pair(_Q, torch.zeros(2, 32, dtype=torch.int32), torch.zeros(32, 2, dtype=torch.int32)),
     rf"layer {_Q} has non-float factors \(torch.int32, torch.int32\)"),
    (_pair(_Q, torch.zeros(2, 32, 1), torch.zeros(32, 2)),
     rf"layer {_Q} has down \(2, 32, 1\) / up \(32, 2\); expected 2-D \(linear\) or 4-D \(conv\) factors"),
    (_pair(_Q, torch.zeros(2, 32), torch.zeros(32, 3)),
     rf"layer {_Q} has inconsistent factors down \(2, 32\) / up \(32, 3\); expected down \[r, in, ...\] and up"),
    ({**_pair(_PROJ, torch.zeros(2, 32, 1, 1), torch.zeros(32, 2, 1, 1)),
      **_pair("lora_unet_input_blocks_1_1_proj_in", torch.zeros(2, 32, 1, 1), torch.zeros(32, 2, 1, 1))},
     r"layers lora_unet_down_blocks_0_attentions_0_proj_in and lora_unet_input_blocks_1_1_proj_in both target "
     r"unet.down_blocks.0.attentions.0.proj_in; the file is inconsistent"),
    (_pair(_PROJ, torch.zeros(2, 32, 3, 3), torch.zeros(32, 2, 1, 1)),
     _FIT + r"unet.down_blocks.0.attentions.0.proj_in is a \(1, 1\) conv but the LoRA down factor has kernel \(3, 3\)"),
    (_pair(_CONV_IN, torch.zeros(2, 4), torch.zeros(32, 2)),
     _FIT + r"unet.conv_in is a \(3, 3\) conv but the LoRA down factor is linear"),
    (_pair(_CONV_IN, torch.zeros(2, 8, 3, 3), torch.zeros(32, 2, 1, 1)),
     _FIT + r"unet.conv_in maps 4->32 channels but the LoRA maps 8->32"),
    (_pair(_Q, torch.zeros(2, 32, 3, 3), torch.zeros(32, 2, 1, 1)),
     _FIT + r"unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q is Linear but the LoRA down factor is "
            r"a \(3, 3\) conv"),
    (_pair("lora_unet_input_blocks_7_1_transformer_blocks_9_ff_net_2", torch.zeros(2, 32), torch.zeros(32, 2)),
     r"1 of 1 layers match no module of the sd1 model \(the file looks like a SDXL LoRA; the model is sd1\); use a "
     r"LoRA made for this model family: lora_unet_input_blocks_7_1_transformer_blocks_9_ff_net_2"),
])
def test_malformed_or_foreign_kohya_layers_are_named(sd1, tmp_path, sd, match):
    _refused(sd1, lf.write(sd, tmp_path / "bad.safetensors"), rf"lora bad.safetensors: {match}" if sd else match)


def test_malformed_peft_files_are_named(sd1, tmp_path):
    peft = lf.peft_state_dict({"unet": sd1.parts.unet}, {"unet": UNET_ATTN}, rank=2)
    first = sorted(peft)[0].rsplit(".lora_", 1)[0]
    _refused(sd1, lf.write({**peft, "unet.conv_in.weight": torch.zeros(2)}, tmp_path / "a.safetensors"),
             r"lora a.safetensors: keys that are neither lora_A/lora_B weights nor alphas: unet.conv_in.weight")
    no_b = {k: v for k, v in peft.items() if k != first + ".lora_B.weight"}
    _refused(sd1, lf.write(no_b, tmp_path / "b.safetensors"),
             rf"lora b.safetensors: these layers lack a lora_A or lora_B weight: {re.escape(first)}$")
    for raw, what in (("{not json", r"is not valid JSON \(.+\)"), ("[1]", "is not a JSON object")):
        _refused(sd1, lf.write(peft, tmp_path / "c.safetensors", {"lora_adapter_metadata": raw}),
                 rf"lora c.safetensors: the lora_adapter_metadata header {what}")

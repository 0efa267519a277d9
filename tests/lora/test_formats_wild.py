"""LoRA files as they exist in the wild, beyond the basic kohya / PEFT layouts of ``test_vs_diffusers.py``.

Guards:
- diffusers' attention-processor LoRA files (diffusers 0.14-0.20 ``save_attn_procs`` / ``save_lora_weights``:
  ``unet....attn1.processor.to_q_lora.down.weight``, ``text_encoder....self_attn.to_q_lora.down.weight``), which
  diffusers' ``load_lora_weights`` still loads, were refused as an "unrecognised key layout"; they must compute what
  diffusers computes.
- a kohya file carrying a few non-LoRA keys (an embedded textual inversion, a stray tensor) was refused with
  "unrecognised key layout" listing its *valid* kohya keys as the example; the error must name the foreign keys.
"""
import re

import pytest
import torch

from leandiffusion.lora import inject_lora
from leandiffusion.memory.engine import engine_from_parts, parts_from_components
from leandiffusion.tests.kit import tiny_components
from leandiffusion.tests.lora import lorafiles as lf
from leandiffusion.tests.lora.test_vs_diffusers import _compare

_TE_OLD = {"q_proj": "to_q", "k_proj": "to_k", "v_proj": "to_v", "out_proj": "to_out"}


def _attn_processor_key(key: str):
    """A PEFT key in diffusers' old attention-processor spelling (None for layers that format had no name for)."""
    role = {"A": "down", "B": "up"}
    m = re.fullmatch(r"(unet\..*attn[12])\.(to_q|to_k|to_v|to_out\.0)\.lora_([AB])\.weight", key)
    if m:
        return f"{m[1]}.processor.{m[2].replace('.0', '')}_lora.{role[m[3]]}.weight"
    m = re.fullmatch(r"(text_encoder\..*self_attn)\.(q_proj|k_proj|v_proj|out_proj)\.lora_([AB])\.weight", key)
    if m:
        return f"{m[1]}.{_TE_OLD[m[2]]}_lora.{role[m[3]]}.weight"
    return None


def test_diffusers_attn_processor_format_matches_diffusers(tmp_path):
    c = tiny_components("sd1")
    roots = {"unet": c["unet"], "text_encoder": c["text_encoder"]}
    sd = lf.peft_state_dict(roots, {"unet": lf.ATTN_FF, "text_encoder": lf.TE_LINEARS}, rank=4, seed=5)
    old = {_attn_processor_key(k): v for k, v in sd.items() if _attn_processor_key(k)}
    assert any(".processor.to_out_lora." in k for k in old) and any("self_attn.to_q_lora." in k for k in old)
    _compare("sd1", lf.write(old, tmp_path / "pytorch_lora_weights.safetensors"), 0.7)


@pytest.mark.parametrize("extra", ["zz_stray.weight", "bundle_emb.myemb.string_to_param.*"])
def test_kohya_with_foreign_keys_names_them(tmp_path, extra):
    c = tiny_components("sd1")
    engine = engine_from_parts(parts_from_components(c))
    sd = lf.kohya_state_dict({"unet": c["unet"]}, {"unet": lf.ATTN_FF}, rank=2)
    sd[extra] = torch.zeros(2, 64)
    before = lf.snapshot(engine.parts.unet, engine.parts.text_encoder)
    with pytest.raises(ValueError, match=r"not kohya LoRA keys.*" + re.escape(extra)) as info:
        inject_lora(engine, lf.write(sd, tmp_path / "with_extra.safetensors"))
    listed = str(info.value).split("(lora_unet_*/lora_te*_*): ")[1].split("; ")[0]
    assert listed == extra  # only the foreign key, not the valid kohya keys
    lf.assert_untouched(before, engine.parts.unet, engine.parts.text_encoder)


@pytest.mark.parametrize("layout", ["kohya", "peft"])
def test_alpha_that_is_not_one_number_is_named(layout):
    """An ``.alpha`` holding several numbers raised torch's bare "a Tensor with 2 elements cannot be converted to
    Scalar" (RuntimeError) with no layer named; 0-d and 1-element alphas (both seen in files) are accepted."""
    from leandiffusion.lora.formats import parse_lora

    name = "lora_unet_conv_in" if layout == "kohya" else "unet.conv_in"
    down, up = (".lora_down.weight", ".lora_up.weight") if layout == "kohya" else (".lora_A.weight", ".lora_B.weight")
    sd = {name + down: torch.zeros(2, 4, 3, 3), name + up: torch.zeros(8, 2, 1, 1)}
    for alpha in (torch.tensor(1.0), torch.ones(1, dtype=torch.float16)):
        assert parse_lora({**sd, name + ".alpha": alpha}).layers[0].scale == 0.5
    with pytest.raises(ValueError, match=re.escape(name) + r".*alpha.*2 values"):
        parse_lora({**sd, name + ".alpha": torch.ones(2)})


def test_a_nan_alpha_in_the_peft_header_is_named(tmp_path):
    """A NaN ``lora_alpha`` in diffusers' metadata header (Python's JSON reads ``NaN``) would make every UNet output
    NaN; it must be refused naming the layer, the value and the header, the model untouched."""
    engine = engine_from_parts(parts_from_components(tiny_components("sd1")))
    roots = {"unet": engine.parts.unet}
    sd = lf.peft_state_dict(roots, {"unet": lf.ATTN_FF}, rank=4, seed=2)
    meta = lf.peft_metadata(roots, {"unet": lf.ATTN_FF}, rank=4, alpha=float("nan"), alpha_pattern={})
    path = lf.write(sd, tmp_path / "nan_alpha.safetensors", meta)
    before = lf.snapshot(engine.parts.unet)
    with pytest.raises(ValueError, match=r"lora nan_alpha.safetensors: layer unet\.\S+ has alpha nan \(from the "
                                         r"lora_adapter_metadata header\); expected a finite number"):
        inject_lora(engine, path)
    lf.assert_untouched(before, engine.parts.unet)


# Torch-file LoRAs and PEFT files saved from a bare (unprefixed) model.
def _unet_out(view):
    inputs = lf.unet_inputs("sd1")
    with view.session("unet"):
        return lf.run_unet(view.parts.unet, inputs)


@pytest.mark.parametrize("wrap", ["flat", "state_dict"])
def test_torch_file_lora_computes_what_the_safetensors_file_does(tmp_path, wrap):
    """Old kohya ``.pt`` files (a flat dict) and ``.ckpt``-style files (``{"state_dict": ...}``)."""
    c = tiny_components("sd1")
    engine = engine_from_parts(parts_from_components(c))
    sd = lf.kohya_state_dict({"unet": c["unet"], "text_encoder": c["text_encoder"]},
                             {"unet": lf.ATTN_FF, "text_encoder": lf.TE_LINEARS}, rank=2)
    ref = _unet_out(inject_lora(engine, lf.write(sd, tmp_path / "style.safetensors"), 0.7))
    torch.save(sd if wrap == "flat" else {"state_dict": sd, "epoch": 3}, str(tmp_path / "style.pt"))
    got = _unet_out(inject_lora(engine, tmp_path / "style.pt", 0.7))
    assert (ref - _unet_out(engine)).abs().max() > 0.05
    assert torch.equal(got, ref)


def test_torch_file_that_is_not_a_flat_dict_of_tensors_is_refused(tmp_path):
    c = tiny_components("sd1")
    engine = engine_from_parts(parts_from_components(c))
    sd = lf.kohya_state_dict({"unet": c["unet"]}, {"unet": lf.ATTN_FF}, rank=2)
    torch.save({**sd, "epoch": 3}, str(tmp_path / "mixed.pt"))
    with pytest.raises(ValueError, match=r"lora file 'mixed.pt' does not hold a flat dict of tensors"):
        inject_lora(engine, tmp_path / "mixed.pt")


@pytest.mark.parametrize("prefix", ["base_model.model.", ""])
def test_peft_unet_file_without_component_prefix_is_a_unet_lora(tmp_path, prefix):
    """PEFT's ``save_pretrained`` on a bare UNet writes ``base_model.model.<module>.lora_A.weight`` (and
    ``get_peft_model_state_dict`` plain ``<module>.lora_A.weight``): both name UNet modules."""
    c = tiny_components("sd1")
    engine = engine_from_parts(parts_from_components(c))
    sd = lf.peft_state_dict({"unet": c["unet"]}, {"unet": lf.ATTN_FF}, rank=4, seed=3)
    ref = _unet_out(inject_lora(engine, lf.write(sd, tmp_path / "unet.safetensors"), 0.6))
    renamed = {prefix + k[len("unet."):]: v for k, v in sd.items()}
    got = _unet_out(inject_lora(engine, lf.write(renamed, tmp_path / "bare.safetensors"), 0.6))
    assert (ref - _unet_out(engine)).abs().max() > 0.05
    assert torch.equal(got, ref)

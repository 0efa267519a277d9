"""The injector computes what diffusers' own LoRA loader (``pipe.load_lora_weights`` + ``set_adapters``) computes.

Guards the key mapping (kohya diffusers-style and LDM-style names, conv LoCon layers, both SDXL text encoders,
PEFT names) and the scale math (alpha / rank, PEFT metadata alphas and alpha_pattern), on tiny fp32 CPU models.
kohya files here use one alpha for every layer: diffusers 0.42 drops per-layer kohya alphas of attention layers
(it warns "alpha_pattern keys did not match"), so per-layer alphas are checked against plain math in
``test_unmerged.py`` instead.
"""
import importlib
import re

import pytest
import torch

from leandiffusion.lora import inject_lora
from leandiffusion.memory.engine import engine_from_parts, parts_from_components
from leandiffusion.tests.kit import tiny_components
from leandiffusion.tests.lora import lorafiles as lf

TOL = 1e-5
UNET_ALL = re.compile(lf.ATTN_FF.pattern + "|" + lf.LOCON.pattern)


def _patterns(family):
    pats = {"unet": UNET_ALL, "text_encoder": lf.TE_LINEARS}
    if family == "sdxl":
        pats["text_encoder_2"] = lf.TE_LINEARS
    return pats


def _compare(family, path, scale, diffusers_kwargs=None):
    ours_c = tiny_components(family)
    engine = engine_from_parts(parts_from_components(ours_c))
    view = inject_lora(engine, path, scale, scale)
    ref_c = tiny_components(family)
    pipe = lf.diffusers_pipeline(ref_c)
    pipe.load_lora_weights(str(path.parent), weight_name=path.name, adapter_name="ref", **(diffusers_kwargs or {}))
    pipe.set_adapters(["ref"], adapter_weights=[scale])
    inputs = lf.unet_inputs(family)
    ref_parts = parts_from_components(ref_c)
    with view.session("unet"):
        ours = lf.run_unet(view.parts.unet, inputs)
    ref = lf.run_unet(ref_c["unet"], inputs)
    base = lf.run_unet(ours_c["unet"], inputs)
    assert (ref - base).abs().max() > 0.05, "the LoRA must change the output for this test to mean anything"
    assert (ours - ref).abs().max().item() <= TOL
    with view.session("text"):
        ours_t = lf.run_text(view.parts)
    ref_t = lf.run_text(ref_parts)
    base_t = lf.run_text(engine.parts)
    for o, r, b in zip(ours_t, ref_t, base_t):
        assert (r - b).abs().max() > 0.05
        assert (o - r).abs().max().item() <= TOL


@pytest.mark.parametrize("family", ["sd1", "sdxl"])
def test_kohya_matches_diffusers(tmp_path, family, strategy):
    """SD1: kohya diffusers-style names; SDXL: kohya LDM-style (sgm) names, as kohya's SDXL trainer writes."""
    c = tiny_components(family)
    roots = {k: c[k] for k in ("unet", "text_encoder", "text_encoder_2") if k in c}
    ldm = lf.tiny_sdxl_ldm_names(c["unet"]) if family == "sdxl" else None
    pats = _patterns(family)
    if family == "sdxl":  # the LDM table covers the block modules; conv_in/out etc. keep diffusers names
        pats["unet"] = re.compile(r"^(down_blocks|mid_block|up_blocks)\..*(" + UNET_ALL.pattern + ")")
    sd = lf.kohya_state_dict(roots, pats, rank=4, seed=3, ldm_names=ldm)
    if family == "sdxl":
        assert any(k.startswith("lora_unet_input_blocks_") for k in sd) and any("lora_te2_" in k for k in sd)
    path = lf.write(sd, tmp_path / f"kohya_{family}.safetensors")
    _compare(family, path, 0.8)


@pytest.mark.skipif(not hasattr(importlib.import_module("diffusers.loaders.lora_base"), "LORA_ADAPTER_METADATA_KEY"),
                    reason="this diffusers ignores the lora_adapter_metadata header (it reads it from 0.34 on), so its "
                           "loader is no reference for PEFT alphas")
@pytest.mark.parametrize("family", ["sd1", "sdxl"])
def test_peft_matches_diffusers(tmp_path, family, strategy):
    """diffusers/PEFT lora_A/lora_B with the metadata header diffusers writes (lora_alpha + alpha_pattern)."""
    c = tiny_components(family)
    roots = {k: c[k] for k in ("unet", "text_encoder", "text_encoder_2") if k in c}
    pats = _patterns(family)
    sd = lf.peft_state_dict(roots, pats, rank=4, seed=5)
    special = next(n for n in lf.module_names(c["unet"], lf.ATTN_FF) if n.endswith("attn1.to_q"))
    meta = lf.peft_metadata(roots, pats, rank=4, alpha=4.0, alpha_pattern={"unet": {special: 2.0}})
    path = lf.write(sd, tmp_path / f"peft_{family}.safetensors", metadata=meta)
    _compare(family, path, 0.6)

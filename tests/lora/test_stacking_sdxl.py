"""Stacked injectors on the tiny SDXL model against an fp64 merged-weights reference (W + sum s_i * scale_i * B_i A_i).

Guards the injection semantics a ComfyUI chain relies on: three injectors (two files, one of them twice with
overlapping targets: the whole LoRA and again on ``middle_block``), ``unmerged`` and ``merged`` mixed, strengths
0, negative and > 1, UNet and text-encoder strengths independent on both SDXL encoders (``lora_te1_``/``lora_te2_``),
conv LoCon layers (3x3 down, 1x1 up, incl. the strided downsampler), per-layer alphas, a rank-1 file without alphas
(scale 1); the result does not depend on the order of the chain, and the input model stays LoRA-free.
"""
import re

import pytest
import torch

from leandiffusion.lora import inject_lora
from leandiffusion.tests.kit import tiny_engine
from leandiffusion.tests.lora import lorafiles as lf

TOL = 1e-5
UNET_ALL = re.compile(lf.ATTN_FF.pattern + "|" + lf.LOCON.pattern)
PATS = {"unet": UNET_ALL, "text_encoder": lf.TE_LINEARS, "text_encoder_2": lf.TE_LINEARS}
PREFIX = {"unet": "lora_unet_", "text_encoder": "lora_te1_", "text_encoder_2": "lora_te2_"}


def _roots(engine):
    p = engine.parts
    return {"unet": p.unet, "text_encoder": p.text_encoder, "text_encoder_2": p.text_encoder_2}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    engine = tiny_engine("sdxl")
    lf.run_text(engine.parts)
    ldm = lf.tiny_sdxl_ldm_names(engine.parts.unet)
    folder = tmp_path_factory.mktemp("stack")
    files = {}
    for tag, seed, rank, alpha in (("a", 1, 4, True), ("b", 2, 1, False)):
        sd = lf.kohya_state_dict(_roots(engine), PATS, rank=rank, seed=seed, ldm_names=ldm, with_alpha=alpha,
                                 varied_alpha=alpha)
        files[tag] = (sd, lf.write(sd, folder / f"{tag}.safetensors"))
    return engine, ldm, files


def _reference(ldm, specs):
    """A fresh tiny SDXL with every spec's delta added in fp64: specs = [(state dict, s_unet, s_text, ldm prefix)]."""
    engine = tiny_engine("sdxl")
    roots = _roots(engine)
    with torch.no_grad():
        for comp, pattern in PATS.items():
            for name in lf.module_names(roots[comp], pattern):
                w = roots[comp].get_submodule(name).weight
                acc = w.double()
                spelled = ldm[name] if comp == "unet" else lf.file_name(roots[comp], name)
                for sd, s_unet, s_text, only in specs:
                    if only and not (comp == "unet" and spelled.startswith(only + ".")):
                        continue
                    key = PREFIX[comp] + spelled.replace(".", "_")
                    down, up = sd[key + ".lora_down.weight"].double(), sd[key + ".lora_up.weight"].double()
                    scale = sd[key + ".alpha"].item() / down.shape[0] if key + ".alpha" in sd else 1.0
                    s = s_unet if comp == "unet" else s_text
                    acc = acc + s * scale * (up.flatten(1) @ down.flatten(1)).reshape(w.shape)
                w.copy_(acc.float())
    return engine


def _outputs(view):
    with view.session("unet"):
        u = lf.run_unet(view.parts.unet, lf.unet_inputs("sdxl"))
    with view.session("text"):
        t = lf.run_text(view.parts)
    return [u] + t


def _max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def test_three_injectors_any_order_match_fp64_merged_weights(setup):
    engine, ldm, files = setup
    (sd_a, path_a), (sd_b, path_b) = files["a"], files["b"]
    before = lf.snapshot(*_roots(engine).values())
    base = _outputs(engine)
    chain = [  # (path, strength, strength_text_encoder, target_blocks, mode)
        (path_a, 0.7, -0.4, "", "unmerged"),
        (path_b, -1.5, 2.0, "", "merged"),
        (path_a, 3.0, 0.0, "middle_block", "unmerged"),
        (path_b, 0.0, 1.2, "", "unmerged"),
    ]
    ref = _outputs(_reference(ldm, [(sd_a, 0.7, -0.4, ""), (sd_b, -1.5, 2.0, ""), (sd_a, 3.0, 0.0, "middle_block"),
                                    (sd_b, 0.0, 1.2, "")]))
    assert _max_diff(ref, base) > 0.05
    for order in (chain, chain[::-1], [chain[2], chain[0], chain[3], chain[1]]):
        view = engine
        for path, s, st, blocks, mode in order:
            view = inject_lora(view, path, s, st, target_blocks=blocks, mode=mode)
        assert _max_diff(_outputs(view), ref) <= TOL
        for a, b in zip(_outputs(engine), base):  # the upstream model between and after: LoRA-free
            assert torch.equal(a, b)
    lf.assert_untouched(before, *_roots(engine).values())


def test_text_strength_alone_changes_only_the_text_encoders(setup):
    engine, ldm, files = setup
    sd_a, path_a = files["a"]
    base = _outputs(engine)
    view = inject_lora(engine, path_a, 0.0, 1.3)
    ours = _outputs(view)
    assert torch.equal(ours[0], base[0])  # UNet strength 0: the base UNet bit-exactly
    ref = _outputs(_reference(ldm, [(sd_a, 0.0, 1.3, "")]))
    assert _max_diff(ours[1:], ref[1:]) <= TOL
    assert all(not torch.equal(a, b) for a, b in zip(ours[1:], base[1:]))  # both encoders changed

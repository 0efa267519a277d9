"""Malformed LoHa / LoKr / DoRA / Tucker LoCon files are refused with a message naming the file, the layer key, the bad value and
the fix, and leave the model untouched; the variants that stay unsupported are refused by name.

Guards the parser in ``lora/lycoris.py`` and ``lora/dora.py`` and the fit checks in ``lora/keymap.py``.
"""
import re

import pytest
import torch

from leandiffusion.lora import inject_lora
from leandiffusion.memory.engine import engine_from_parts, parts_from_components
from leandiffusion.tests.kit import tiny_components
from leandiffusion.tests.lora import lorafiles as lf

Q = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"  # Linear 32 -> 32
CONV = "lora_unet_down_blocks_0_resnets_0_conv1"  # 3x3 conv 32 -> 32
Q_MODULE = "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"


@pytest.fixture(scope="module")
def sd1():
    return engine_from_parts(parts_from_components(tiny_components("sd1")))


def _refused(engine, sd, match, tmp_path):
    path = lf.write(sd, tmp_path / "bad.safetensors")
    before = lf.snapshot(engine.parts.unet, engine.parts.text_encoder)
    with pytest.raises(ValueError, match=match):
        inject_lora(engine, path)
    lf.assert_untouched(before, engine.parts.unet, engine.parts.text_encoder)


def _loha(out=32, n=32, r1=2, r2=2, key=Q):
    z = torch.zeros
    return {f"{key}.hada_w1_a": z(out, r1), f"{key}.hada_w1_b": z(r1, n), f"{key}.hada_w2_a": z(out, r2),
            f"{key}.hada_w2_b": z(r2, n), f"{key}.alpha": torch.tensor(1.0)}


def _lokr(**over):
    sd = {f"{Q}.lokr_w1": torch.zeros(4, 4), f"{Q}.lokr_w2_a": torch.zeros(8, 2), f"{Q}.lokr_w2_b": torch.zeros(2, 8)}
    sd.update({f"{Q}.{k}": v for k, v in over.items() if v is not None})
    return {k: v for k, v in sd.items() if k.rpartition(".")[2] not in [k2 for k2, v2 in over.items() if v2 is None]}


FIT = r"lora bad.safetensors: 1 layers do not fit their modules; use a LoRA made for this model family: "
CASES = [
    ({k: v for k, v in _loha().items() if not k.endswith("hada_w2_b")},
     rf"lora bad.safetensors: LoHa layer {Q} lacks hada_w2_b \(a LoHa layer needs all four hada_ factors; it has "
     r"alpha, hada_w1_a, hada_w1_b, hada_w2_a\); the file is incomplete: re-export it"),
    ({**_loha(), f"{Q}.hada_w1_b": torch.zeros(3, 32)},
     rf"layer {Q} has inconsistent factors: hada_w1_a \(32, 2\) @ hada_w1_b \(3, 32\) and hada_w2_a \(32, 2\) @ "
     r"hada_w2_b \(2, 32\) must share their rank; the file is corrupt"),
    ({**_loha(), f"{Q}.hada_w2_b": torch.zeros(3, 32)},  # the second product's ranks differ (the first's agree)
     rf"layer {Q} has inconsistent factors: hada_w1_a \(32, 2\) @ hada_w1_b \(2, 32\) and hada_w2_a \(32, 2\) @ "
     r"hada_w2_b \(3, 32\) must share their rank; the file is corrupt"),
    ({**_loha(), f"{Q}.hada_w2_b": torch.zeros(2, 16)},
     rf"layer {Q} has inconsistent factors: the two Hadamard factors .* \[32, 32\] and .* \[32, 16\] must have one shape"),
    (_loha(out=64), FIT + rf"{re.escape(Q_MODULE)} \(file key {Q}, LoHa\): its LoHa factors make a \[64, 32\] delta "
                          r"but the weight is \[32, 32\]"),
    (_loha(n=32, key=CONV), FIT + r"unet.down_blocks.0.resnets.0.conv1 \(file key .*conv1, LoHa\): its LoHa factors "
                                  r"make a \[32, 32\] delta but the weight is \[32, 32, 3, 3\] \(\[32, 288\] flattened\)"),
    ({**_loha(), f"{Q}.hada_w1_a": torch.zeros(32, 2, dtype=torch.int32)},
     rf"layer {Q} has hada_w1_a of shape \(32, 2\) \(torch.int32\); expected a non-empty float tensor with 2 dimensions"),
    (_lokr(lokr_w1_a=torch.zeros(4, 2)), rf"LoKr layer {Q} has both lokr_w1 and lokr_w1_a; expected one of them"),
    (_lokr(lokr_w2_b=None), rf"LoKr layer {Q} lacks lokr_w2_b \(a LoKr layer needs lokr_w2, or lokr_w2_a with "
                            r"lokr_w2_b; it has lokr_w1, lokr_w2_a\)"),
    (_lokr(lokr_w1=None), rf"LoKr layer {Q} lacks lokr_w1_a, lokr_w1_b \(a LoKr layer needs lokr_w1, or lokr_w1_a "
                          r"with lokr_w1_b"),
    (_lokr(lokr_w1=None, lokr_w1_a=torch.zeros(4, 3), lokr_w1_b=torch.zeros(3, 4)),
     rf"layer {Q} has inconsistent factors: W1 is decomposed with rank 3 and W2 with rank 2"),
    (_lokr(lokr_w1=torch.zeros(4, 8)),
     FIT + rf"{re.escape(Q_MODULE)} \(file key {Q}, LoKr\): its LoKr factors W1 \[4, 8\] \(x\) W2 \[8, 8\] make a "
           r"\[32, 64\] delta but the weight is \[32, 32\]"),
    (_lokr(lokr_t2=torch.zeros(2, 2, 3, 3)), rf"layer {Q} has inconsistent factors: lokr_t2 \(2, 2, 3, 3\) must be "
                                             r"\[r, r, kh, kw\] for lokr_w2_a \(8, 2\) \[r, o2\]"),
    (_lokr(lokr_t2=torch.zeros(8, 3, 3, 3)),  # lokr_t2's first rank fits lokr_w2_a, its second not lokr_w2_b
     rf"layer {Q} has inconsistent factors: lokr_t2 \(8, 3, 3, 3\) must be \[r, r, kh, kw\] for lokr_w2_a \(8, 2\) "
     r"\[r, o2\] and lokr_w2_b \(2, 8\) \[r, i2\]"),
    (_lokr(lokr_w2_a=None, lokr_w2_b=None, lokr_t2=torch.zeros(2, 2, 3, 3)),
     rf"LoKr layer {Q} has lokr_t2 without lokr_w2_a/lokr_w2_b; the file is incomplete: re-export it"),
    ({f"{CONV}.lokr_w1": torch.zeros(4, 4), f"{CONV}.lokr_w2": torch.zeros(8, 8, 1, 1)},
     FIT + r"unet.down_blocks.0.resnets.0.conv1 \(file key .*, LoKr\): its LoKr lokr_w2 has kernel \(1, 1\) but the "
           r"layer's kernel is \(3, 3\)"),
    ({f"{Q}.lora_down.weight": torch.zeros(2, 32), f"{Q}.lora_up.weight": torch.zeros(32, 2), **_loha()},
     rf"layer {Q} mixes LoHa factors with lora_down.weight, lora_up.weight; one layer holds one adapter kind"),
    ({f"{Q}.lora_down.weight": torch.zeros(2, 32), f"{Q}.lora_up.weight": torch.zeros(32, 2),
      f"{Q}.dora_scale": torch.zeros(2, 32)},
     rf"layer {Q} has a dora_scale of shape \(2, 32\) \(torch.float32\); expected a float \[1, in\] / \[1, in, 1, 1\] "
     r"\(input-axis DoRA\) or \[out, 1\]"),
    ({f"{Q}.lora_down.weight": torch.zeros(2, 32), f"{Q}.lora_up.weight": torch.zeros(32, 2),
      f"{Q}.dora_scale": torch.zeros(1, 16)},
     FIT + rf"{re.escape(Q_MODULE)} \(file key {Q}, LoRA\): its DoRA dora_scale \(1, 16\) is an input-axis magnitude "
           r"of 16 channels but the layer has 32 input channels"),
    ({f"{CONV}.lora_down.weight": torch.zeros(2, 32, 1, 1), f"{CONV}.lora_mid.weight": torch.zeros(3, 2, 3, 3),
      f"{CONV}.lora_up.weight": torch.zeros(32, 3, 1, 1)},
     rf"layer {CONV} has lora_mid \(3, 2, 3, 3\) \(torch.float32\) and lora_down \(2, 32, 1, 1\) \(torch.float32\); "
     r"expected float lora_mid \[r, r, kh, kw\] after a 1x1 lora_down \[r, in\(, 1, 1\)\]; the file is corrupt"),
    ({f"{CONV}.lora_down.weight": torch.zeros(2, 32, 3, 3), f"{CONV}.lora_mid.weight": torch.zeros(2, 2, 3, 3),
      f"{CONV}.lora_up.weight": torch.zeros(32, 2, 1, 1)}, rf"layer {CONV} has lora_mid \(2, 2, 3, 3\) .* and lora_down "
                                                           r"\(2, 32, 3, 3\)"),
    ({**_loha(), f"{Q}.hada_t1": torch.zeros(2, 2, 1, 1), f"{Q}.hada_t2": torch.zeros(2, 2, 1, 1)},
     r"LoHa with Tucker decomposition weights are not supported by the LoRA injector \(keys such as .*hada_t1"),
    ({"unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.hada_w1_a": torch.zeros(32, 2),
      "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.lora_A.weight": torch.zeros(2, 32)},
     r"LoHa \(LyCORIS Hadamard product\) weights are supported in the kohya/LyCORIS layout only .* save the file with "
     r"kohya-style key names"),
    ({"unet.x.lora_A.weight": torch.zeros(2, 32), "unet.x.lora_B.weight": torch.zeros(32, 2),
      "unet.x.lora_magnitude_vector": torch.zeros(32)},
     r"PEFT DoRA \(lora_magnitude_vector\) weights are not supported"),
    # a NaN / infinite tensor would turn every image NaN (black) without a word
    (_lokr(lokr_w1=torch.zeros(4, 4).index_fill_(1, torch.tensor([1]), float("nan"))),
     rf"lora bad.safetensors: 1 tensors hold NaN or infinite values \({Q}.lokr_w1 has 4 NaN and 0 infinite of 16 "
     r"values\); they would turn every image black or into noise; the file is corrupt .*: use another checkpoint of "
     r"the LoRA or re-export it"),
    ({**_loha(), f"{Q}.alpha": torch.tensor([float("inf")], dtype=torch.bfloat16)},
     rf"1 tensors hold NaN or infinite values \({Q}.alpha = inf\)"),
    ({f"{Q}.lora_down.weight": torch.zeros(2, 32), f"{Q}.lora_up.weight": torch.zeros(32, 2),
      f"{Q}.dora_scale": torch.full((1, 32), float("-inf"), dtype=torch.float16)},
     rf"\({Q}.dora_scale has 0 NaN and 32 infinite of 32 values\)"),
    # each refusal names the variant it is: LyCORIS' norm layers, a .diff_b bias difference
    ({**_lokr(), "lora_unet_down_blocks_0_attentions_0_norm.w_norm": torch.ones(32),
      "lora_unet_down_blocks_0_attentions_0_norm.b_norm": torch.zeros(32)},
     r"norm-layer \(LyCORIS train_norm: .w_norm/.b_norm\) weights are not supported by the LoRA injector \(keys such "
     r"as lora_unet_down_blocks_0_attentions_0_norm.w_norm\); use a plain LoRA/LoCon, LoHa or LoKr file without such "
     r"layers"),
    ({**_lokr(), f"{Q}.diff_b": torch.zeros(32)},
     rf"bias difference \(LyCORIS .diff_b; ComfyUI's Extract and Save Lora writes it with bias_diff on\) weights are "
     rf"not supported by the LoRA injector \(keys such as {Q}.diff_b\)"),
    ({**_lokr(), f"{CONV}.diff": torch.zeros(32, 32, 3, 3)},
     rf"full weight difference \(LyCORIS .diff; ComfyUI's Extract and Save Lora: full_diff, or bias_diff on\) "
     rf"weights are not supported .*keys such as {CONV}.diff\)"),
]


@pytest.mark.parametrize("sd,match", CASES, ids=[str(i) for i in range(len(CASES))])
def test_malformed_lycoris_layers_are_named(sd1, tmp_path, sd, match):
    _refused(sd1, sd, match, tmp_path)


def test_one_bad_layer_among_good_ones_leaves_nothing_behind(sd1, tmp_path):
    """A valid LoKr file with one layer that does not fit: refused whole, no hook, no weight touched."""
    roots = {"unet": sd1.parts.unet}
    sd = lf.lycoris_case(roots, {"unet": lf.ATTN_FF}, "lokr_w2_lowrank")
    sd[f"{Q}.lokr_w1"] = torch.zeros(4, 8)
    _refused(sd1, sd, rf"{re.escape(Q_MODULE)} \(file key {Q}, LoKr\)", tmp_path)

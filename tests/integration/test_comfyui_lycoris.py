"""LoHa, LoKr, Tucker LoCon and DoRA: the merged weights equal what ComfyUI's own LoRA code (``comfy.lora.calculate_weight``, the
math behind its LoraLoader) computes from the same file, on the tiny SD1 UNet's attention, feed-forward and conv
layers, at strengths 1 and -0.6 (ComfyUI has separate code paths for strength 1).

The LEAN_MODEL cannot go through ComfyUI's LoraLoader, so this compares the math directly: ComfyUI's interpreter runs
``comfy_lora_math.py`` on the file and the base weights; ours are read from the model inside a ``merged`` session
(``unmerged`` equals ``merged`` in ``tests/lora/test_lycoris.py``). One documented difference: output-axis DoRA
(``dora_scale [out, 1]``), where ComfyUI 0.3.64 divides by the norm of the base weight instead of the adapted one
(open: Comfy-Org/ComfyUI PR #15458): that case checks ComfyUI really does that, so the claim in docs/lora.md holds.
And ComfyUI 0.3.64 skips Tucker LoKr layers (``lokr_t2``) with a logged error: those are checked to be skipped, and
their math is checked against peft instead.
"""
import os
import re
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file

from leandiffusion.lora import inject_lora
from leandiffusion.memory.engine import engine_from_parts, parts_from_components
from leandiffusion.runner.local import comfyui_python
from leandiffusion.tests.kit import tiny_components
from leandiffusion.tests.lora import lorafiles as lf

pytestmark = pytest.mark.comfyui
WORKER = os.path.join(os.path.dirname(__file__), "comfy_lora_math.py")
UNET_ALL = re.compile(lf.ATTN_FF.pattern + "|" + lf.LOCON.pattern)


STRENGTHS = (1.0, -0.6)


def _comfy_weights(tmp_path, sd, bases):
    """``{strength: {layer: weight}}`` and the layers ComfyUI logged as failed, from one ComfyUI process."""
    bundle = {f"lora::{k}": v.contiguous() for k, v in sd.items()}
    bundle.update({f"base::{k}": v.contiguous() for k, v in bases.items()})
    save_file(bundle, str(tmp_path / "bundle.safetensors"))
    comfy = os.environ["COMFYUI_PATH"]
    run = subprocess.run([comfyui_python(comfy), WORKER, comfy, str(tmp_path / "bundle.safetensors"),
                          str(tmp_path / "out.safetensors"), ",".join(map(str, STRENGTHS))], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "not loaded" not in run.stderr, run.stderr[-3000:]
    failed = set(re.findall(r"ERROR \w+ (\S+)\.weight ", run.stderr))  # ComfyUI logs a failing patch and skips it
    out = load_file(str(tmp_path / "out.safetensors"))
    return {s: {k.split("::", 1)[1]: v for k, v in out.items() if k.split("::", 1)[0] == str(s)} for s in STRENGTHS}, failed


@pytest.mark.parametrize("case", sorted(lf.LYCORIS_CASES))
def test_merged_weights_equal_comfyuis(tmp_path, case):
    engine = engine_from_parts(parts_from_components(tiny_components("sd1")))
    sd = lf.lycoris_case({"unet": engine.parts.unet}, {"unet": UNET_ALL}, case, seed=5)
    path = lf.write(sd, tmp_path / f"{case}.safetensors")
    targets = inject_lora(engine, path, mode="merged").adapters[0].binding.targets
    bases = {t.layer.source: t.module.weight.detach().clone() for t in targets}
    comfy, failed = _comfy_weights(tmp_path, sd, bases)
    # ComfyUI 0.3.64 cannot apply a Tucker LoKr (lokr_t2): torch.kron refuses the non-contiguous W2 its einsum
    # returns, and it logs the error and leaves the weight as it was (peft's make_kron makes W2 contiguous; the
    # Tucker math is checked against peft in tests/lora/test_lycoris.py). Every other layer must load.
    tucker = {k[:-len(".lokr_t2")] for k in sd if k.endswith(".lokr_t2")}
    assert failed == tucker
    for strength in STRENGTHS:
        view = inject_lora(engine, path, strength, mode="merged")
        with view.session("unet"):
            ours = {t.layer.source: t.module.weight.detach().clone() for t in targets if t.layer.source not in tucker}
        theirs = comfy[strength]
        assert set(theirs) == set(ours) | tucker
        assert all(torch.equal(theirs[k], bases[k]) for k in tucker)
        if not ours:
            continue
        worst = max(((ours[k] - theirs[k]).abs().max() / theirs[k].abs().max()).item() for k in ours)
        moved = min(((ours[k] - bases[k]).abs().max() / bases[k].abs().max()).item() for k in ours)
        assert moved > 1e-2, "every layer must change for the comparison to mean anything"
        if lf.LYCORIS_CASES[case][3] == "out":  # ComfyUI's output-axis DoRA norms the base weight (see docstring)
            assert worst > 1e-3
            for k in ours:
                module = next(t.module for t in targets if t.layer.source == k)
                delta = lf.reference_delta(sd, k, module)
                w, m = bases[k].double(), sd[k + ".dora_scale"].double()
                norm = w.reshape(w.shape[0], -1).norm(dim=1).reshape(m.shape) + torch.finfo(torch.float32).eps
                comfy_rule = w + strength * ((w + delta) * (m / norm) - w)
                assert torch.allclose(theirs[k].double(), comfy_rule, rtol=0, atol=1e-5 * w.abs().max().item())
        else:
            assert worst <= 1e-5, f"{case} at strength {strength}: {worst:.3g} from ComfyUI"

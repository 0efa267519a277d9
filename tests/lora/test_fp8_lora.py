"""Unmerged LoRA on an fp8-stored UNet (``weight_dtype=fp8_e4m3fn``) equals the same LoRA on the dequantized model.

Guards: LoRA terms attach to fp8 layers as to plain ones (they are still ``nn.Linear`` / ``nn.Conv2d``, and the
terms only read the layer's input and output); a DoRA's gain is computed from the dequantized weight, from the
pinned host copy of the fp8 bytes under ``stream``; the merged mode, which would round a LoRA's change into fp8
weights, is refused naming the fix; the fp8 storage is left exactly as it was.
"""
import pytest
import torch

from leandiffusion.lora import inject_lora
from leandiffusion.memory import fp8_weights as fp8
from leandiffusion.memory.engine import engine_from_parts, parts_from_components
from leandiffusion.memory.load import build_engine
from leandiffusion.memory.plan import GiB, module_bytes
from leandiffusion.memory.policies import stream_working_minimum_gb
from leandiffusion.tests.kit import tiny_components
from leandiffusion.tests.lora import lorafiles as lf
from leandiffusion.tests.lora.test_lycoris import UNET_ALL, _file

TOL = 1e-5


def _fp8_engine(policy="full"):
    parts = parts_from_components(tiny_components("sd1"))
    budget = 4.0
    if policy == "stream":
        fp8.quantize_module(parts.unet, torch.float32)
        budget = stream_working_minimum_gb(parts, "cpu") + 0.3 * module_bytes(parts.unet, torch.float32) / GiB
    engine = build_engine(parts, policy, budget, weight_dtype="fp8_e4m3fn", device="cpu")
    lf.run_text(engine.parts)  # transformers installs its output-capturing hooks at the first call
    return engine


def _dequantized_engine():
    """The same tiny model with every fp8 weight replaced by its dequantized value, in plain layers."""
    c = tiny_components("sd1")
    fp8.quantize_module(c["unet"], torch.float32)
    fp8.dequantize_module(c["unet"])
    engine = engine_from_parts(parts_from_components(c))
    lf.run_text(engine.parts)
    return engine


@pytest.mark.parametrize("case", ["plain", "dora_in", "dora_out", "loha_dense"])
@pytest.mark.parametrize("policy", ["full", "stream"])
def test_unmerged_lora_on_fp8_equals_the_lora_on_the_dequantized_model(tmp_path, case, policy, strategy):
    engine = _fp8_engine(policy)
    if policy == "stream":
        streamer = engine.placement.streamer
        assert 0 < len(streamer.schedule.streamed) < len(streamer.schedule.order)
    before = lf.snapshot(engine.parts.unet)
    if case == "plain":
        c = tiny_components("sd1")
        roots = {"unet": c["unet"], "text_encoder": c["text_encoder"]}
        sd = lf.kohya_state_dict(roots, {"unet": UNET_ALL, "text_encoder": lf.TE_LINEARS}, rank=4)
        path = lf.write(sd, tmp_path / "plain.safetensors")
    else:
        _, path = _file(tmp_path, "sd1", case)
    view = inject_lora(engine, path, 0.8, 0.5)
    if policy == "stream":
        engine.placement.streamer.arena.zero_()  # a streamed slot holds no layer's weights outside its forward
    ref = _dequantized_engine()
    got, want = lf.view_outputs(view), lf.view_outputs(inject_lora(ref, path, 0.8, 0.5))
    assert lf.max_diff(lf.view_outputs(ref), lf.view_outputs(engine)) <= TOL  # the two bases agree
    assert lf.max_diff(want, lf.view_outputs(ref)) > 0.05  # the LoRA changes the output
    assert lf.max_diff(got, want) <= TOL
    if policy == "full":  # (streamed slots hold whichever block ran last)
        lf.assert_untouched(before, engine.parts.unet)


def test_merged_mode_is_refused_on_fp8_weights(tmp_path, opened_sessions):
    engine = _fp8_engine()
    _, path = _file(tmp_path, "sd1", "dora_in")
    with pytest.raises(ValueError, match="mode='merged' cannot be used on this model.*fp8_e4m3fn.*mode='unmerged'"):
        inject_lora(engine, path, 1.0, 1.0, mode="merged")
    assert opened_sessions == []
    # a LoRA with text-encoder layers only touches no fp8 layer: merging it stays allowed
    c = tiny_components("sd1")
    sd = lf.kohya_state_dict({"text_encoder": c["text_encoder"]}, {"text_encoder": lf.TE_LINEARS}, rank=4)
    view = inject_lora(engine, lf.write(sd, tmp_path / "te.safetensors"), 1.0, 1.0, mode="merged")
    assert view.adapters[0].mode == "merged"

"""``lora/adapter.py``: a LoRA on a model whose text encoders compute in another dtype than its UNet.

Guard: under ``lowvram`` the text encoders run in fp32 (on the CPU) while the UNet runs in the weight dtype; the file is
loaded once per stage, each half in its stage's dtype, and the text half computes exactly what the same LoRA computes on
a plain fp32 model.
"""
import torch

from leandiffusion.lora import inject_lora
from leandiffusion.memory.engine import engine_from_parts
from leandiffusion.memory.load import build_engine
from leandiffusion.tests.kit import tiny_components, tiny_parts
from leandiffusion.tests.lora import lorafiles as lf


def test_text_and_unet_halves_load_in_their_stages_dtypes(tmp_path):
    c = tiny_components("sd1")
    sd = lf.kohya_state_dict({"unet": c["unet"], "text_encoder": c["text_encoder"]},
                             {"unet": lf.ATTN_FF, "text_encoder": lf.TE_LINEARS}, rank=2)
    path = lf.write(sd, tmp_path / "style.safetensors")
    split = build_engine(tiny_parts("sd1"), "lowvram", 4.0, "bf16", "auto", device="cpu")
    assert (split.dtype_for("unet"), split.dtype_for("text")) == (torch.bfloat16, torch.float32)
    view = inject_lora(split, path, 0.7, 0.6)
    binding = view.adapters[0].binding
    assert {t.dtype for t in binding._up_s["unet"]} == {torch.bfloat16}
    assert {t.dtype for t in binding._up_s["text_encoder"]} == {torch.float32}
    plain = inject_lora(engine_from_parts(tiny_parts("sd1")), path, 0.7, 0.6)
    with view.session("text"):
        got = lf.run_text(view.parts)
    with plain.session("text"):
        want = lf.run_text(plain.parts)
    with split.session("text"):
        base = lf.run_text(split.parts)
    assert max((w - b).abs().max().item() for w, b in zip(want, base)) > 0.05
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    inputs = lf.unet_inputs("sd1")
    inputs = {k: (v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v)
              for k, v in inputs.items()}
    with view.session("unet"):
        out = lf.run_unet(view.parts.unet, inputs)
    with split.session("unet"):
        out_base = lf.run_unet(split.parts.unet, inputs)
    assert out.dtype == torch.bfloat16 and (out.float() - out_base.float()).abs().max() > 0.05


def test_each_strategy_is_its_own_binding_and_graph_key(tmp_path):
    """``strategy`` is part of the binding key, hence of ``graph_key`` (a captured graph of one strategy cannot
    replay the other's forward): views asking for ``hook`` and ``geglu`` get bindings of those strategies with
    different graph keys (without it the second view would silently reuse the first one's binding and strategy)."""
    c = tiny_components("sd1")
    sd = lf.kohya_state_dict({"unet": c["unet"]}, {"unet": lf.ATTN_FF}, rank=2)
    path = lf.write(sd, tmp_path / "style.safetensors")
    engine = engine_from_parts(tiny_parts("sd1"))
    hook = inject_lora(engine, path, 0.7, strategy="hook").adapters[0]
    geglu = inject_lora(engine, path, 0.7, strategy="geglu").adapters[0]
    assert (hook.binding.strategy, geglu.binding.strategy) == ("hook", "geglu")
    assert hook.graph_key != geglu.graph_key
    assert inject_lora(engine, path, 0.3, strategy="hook").adapters[0].graph_key == hook.graph_key

"""Merged LoRA (``lora/merged.py``) failure paths: nothing is left half-merged.

Guards:
- an error (or Ctrl-C) partway through a merge restores every weight merged so far, bit for bit, and the next
  session merges the whole LoRA again;
- when the device has no room for a weight's backup, the backup goes to CPU memory; the merge and the restore
  still give the same weights as with a device backup.
"""
import pytest
import torch

from leandiffusion.lora import inject_lora
from leandiffusion.lora import merged as merged_mod
from leandiffusion.memory.engine import engine_from_parts, parts_from_components
from leandiffusion.tests.kit import tiny_components
from leandiffusion.tests.lora import lorafiles as lf


@pytest.fixture()
def setup(tmp_path):
    c = tiny_components("sd1")
    engine = engine_from_parts(parts_from_components(c))
    sd = lf.kohya_state_dict({"unet": c["unet"]}, {"unet": lf.ATTN_FF}, rank=2)
    view = inject_lora(engine, lf.write(sd, tmp_path / "style.safetensors"), 0.8, mode="merged")
    inputs = lf.unet_inputs("sd1")
    with view.session("unet"):
        merged_out = lf.run_unet(view.parts.unet, inputs)
    return engine, view, inputs, merged_out


def _weights(unet):
    return {k: v.clone() for k, v in unet.state_dict().items()}


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_a_merge_failing_midway_restores_every_weight(setup, monkeypatch, exc):
    engine, view, inputs, merged_out = setup
    base = _weights(engine.parts.unet)
    real, calls = merged_mod.lora_delta, []

    def fail_on_the_fourth(target, strength, device):
        calls.append(target.module_name)
        if len(calls) == 4:
            raise exc("injected")
        return real(target, strength, device)

    monkeypatch.setattr(merged_mod, "lora_delta", fail_on_the_fourth)
    with pytest.raises(exc, match="injected"):
        with view.session("unet"):
            pass
    assert len(calls) == 4, "the failure must come after some weights were merged"
    after = _weights(engine.parts.unet)
    assert all(torch.equal(after[k], base[k]) for k in base), "weights left half-merged"
    monkeypatch.undo()
    with view.session("unet"):
        assert torch.equal(lf.run_unet(view.parts.unet, inputs), merged_out)
    assert all(torch.equal(v, base[k]) for k, v in engine.parts.unet.state_dict().items())


def test_no_room_for_a_backup_on_the_device_keeps_it_on_the_cpu(setup, monkeypatch, caplog):
    engine, view, inputs, merged_out = setup
    base = _weights(engine.parts.unet)
    real_clone, refused = torch.Tensor.clone, []

    def clone(self, *args, **kwargs):
        if not refused:  # the first weight backup finds the device full
            refused.append(tuple(self.shape))
            raise torch.OutOfMemoryError("injected: CUDA out of memory")
        return real_clone(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "clone", clone)
    with view.session("unet"):
        monkeypatch.undo()
        got = lf.run_unet(view.parts.unet, inputs)
    assert refused and "no room for a" in caplog.text and "keeping it in CPU memory" in caplog.text
    assert torch.equal(got, merged_out)
    assert all(torch.equal(v, base[k]) for k, v in engine.parts.unet.state_dict().items())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_merge_rounds_once_and_restores_bit_exactly(dtype):
    """``round(W + s * up @ down)``: the sum in fp32, rounded once to the weight's dtype (the other merge tests run in
    fp32, where adding a delta rounded to the weight's dtype first gives the same bits). The merged weight equals the
    fp32 sum written by hand, rounded once; detach gives the base bits back."""
    from leandiffusion.lora.formats import LoraLayer
    from leandiffusion.lora.keymap import Target
    from leandiffusion.lora.merged import MergedBinding

    gen = torch.Generator().manual_seed(11)
    linear = torch.nn.Linear(64, 48).requires_grad_(False).to(dtype)
    down, up = torch.randn(8, 64, generator=gen).to(dtype), torch.randn(48, 8, generator=gen).to(dtype)
    layer = LoraLayer("unet", "l", "kohya", down, up, 1.0, "lora_unet_l")
    base = linear.weight.clone()
    want = (base.float() + 0.37 * (up.float() @ down.float())).to(dtype)
    twice = base + (0.37 * (up.float() @ down.float())).to(dtype)  # rounded twice: differs from ``want``
    assert not torch.equal(want, twice)
    binding = MergedBinding(("half", dtype), [Target("unet", "l", linear, layer)], "t")
    binding.attach({"unet": 0.37})
    try:
        assert torch.equal(linear.weight, want)
    finally:
        binding.detach({"unet": 0.37})
    assert torch.equal(linear.weight, base)

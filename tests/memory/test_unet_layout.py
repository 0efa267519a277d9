"""``memory/unet_layout.py``: the UNet runs channels-last where that is faster, with the same values, and callers
get the layout they always got.

Guards: the layout rule (CUDA, a UNet2DConditionModel, large latents, the environment override checked and
obeyed, nothing on the CPU); inside the session every continuous transformer keeps its residual's layout and with
a contiguous residual computes diffusers' own output bit for bit; a channels-last input stays channels-last
through every transformer and resnet, with the values of the contiguous run; the overrides leave on exit (also
after an error) and never replace another library's; ``LeanEngine.unet`` returns a contiguous prediction; on the
GPU the channels-last UNet takes the channels-last GroupNorm kernels and equals the contiguous UNet within fp16
rounding.
"""
from __future__ import annotations

import pytest
import torch

from leandiffusion.kernels import group_norm_nhwc as nhwc
from leandiffusion.memory import unet_layout
from leandiffusion.memory.unet_layout import (MIN_CHANNELS_LAST_CELLS, OVERRIDE, layout_following_transformers,
                                              use_channels_last)
from leandiffusion.tests.kit import tiny_engine
from leandiffusion.tests.lora import lorafiles as lf

CL = torch.channels_last


def _transformers(unet):
    return [m for m in unet.modules() if type(m).__name__ == "Transformer2DModel"]


def _as_channels_last(inputs):
    return dict(inputs, latents=inputs["latents"].contiguous(memory_format=CL))


def test_the_rule_keeps_the_cpu_and_small_latents_contiguous_and_the_override_is_obeyed(monkeypatch):
    unet = tiny_engine("sd1").parts.unet
    big = torch.empty(2, 4, 128, 128)
    assert big.shape[0] * big.shape[2] * big.shape[3] >= MIN_CHANNELS_LAST_CELLS
    assert not use_channels_last(unet, big)  # the CPU
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(unet_layout.dispatch, "triton_unusable_reason", lambda device: None)
    assert use_channels_last(unet, big)
    assert not use_channels_last(unet, torch.empty(1, 4, 64, 64))
    assert not use_channels_last(torch.nn.Conv2d(4, 4, 1), big)
    monkeypatch.setattr(unet_layout.dispatch, "triton_unusable_reason", lambda device: "no triton")
    assert not use_channels_last(unet, big)
    monkeypatch.setenv(unet_layout.ENV_LAYOUT, "channels_last")
    assert use_channels_last(unet, torch.empty(1, 4, 8, 8))
    monkeypatch.setenv(unet_layout.ENV_LAYOUT, "contiguous")
    assert not use_channels_last(unet, big)
    monkeypatch.setenv(unet_layout.ENV_LAYOUT, "nhwc")
    with pytest.raises(ValueError, match="LEANDIFFUSION_UNET_LAYOUT='nhwc'"):
        use_channels_last(unet, big)


@pytest.mark.parametrize("family", ["sd1", "sdxl"])  # SD1: 1x1-conv projections; SDXL: linear projections
def test_a_channels_last_unet_keeps_its_layout_and_its_values(family):
    engine = tiny_engine(family)
    unet = engine.parts.unet
    inputs = lf.unet_inputs(family)
    plain = lf.run_unet(unet, inputs)
    seen = []
    hooks = [m.register_forward_hook(lambda m, a, out: seen.append(out[0].is_contiguous(memory_format=CL)))
             for m in _transformers(unet)]
    try:
        with engine.session("unet"):
            same = lf.run_unet(unet, inputs)
            assert seen and not any(seen)  # contiguous in, contiguous through (diffusers' layout)
            seen.clear()
            out = lf.run_unet(unet, _as_channels_last(inputs))
    finally:
        for h in hooks:
            h.remove()
    assert torch.equal(same, plain)
    assert seen and all(seen) and out.is_contiguous(memory_format=CL)
    torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-5)  # fp32 CPU convolutions sum in another order
    assert all(OVERRIDE not in m.__dict__ for m in _transformers(unet))


def test_overrides_leave_after_an_error_nest_and_leave_someone_elses_alone():
    unet = tiny_engine("sd1").parts.unet
    first, second = _transformers(unet)[:2]
    theirs = object()
    second.__dict__[OVERRIDE] = theirs
    with pytest.raises(RuntimeError, match="boom"):
        with layout_following_transformers(unet):
            installed = first.__dict__[OVERRIDE]
            with layout_following_transformers(unet):
                assert first.__dict__[OVERRIDE] is installed
            assert first.__dict__[OVERRIDE] is installed
            raise RuntimeError("boom")
    assert OVERRIDE not in first.__dict__ and second.__dict__[OVERRIDE] is theirs


def test_the_engine_returns_a_contiguous_prediction_whatever_the_layout(monkeypatch):
    engine = tiny_engine("sd1")
    inputs = lf.unet_inputs("sd1")
    monkeypatch.setattr(unet_layout, "use_channels_last", lambda unet, x: True)
    with engine.session("unet"), torch.no_grad():
        out = engine.unet(inputs["latents"], inputs["timestep"], inputs["context"])
        plain = engine.unet(inputs["latents"].contiguous(), inputs["timestep"], inputs["context"])
    assert out.is_contiguous()
    torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["sd1", "sdxl"])
def test_gpu_channels_last_unet_takes_the_nhwc_kernels_and_stays_within_rounding(family, monkeypatch):
    taken = []
    real = nhwc.launch_channels_last
    monkeypatch.setattr(nhwc, "launch_channels_last", lambda *a: taken.append(1) or real(*a))
    monkeypatch.setenv(unet_layout.ENV_LAYOUT, "channels_last")
    engine = tiny_engine(family, device="cuda", dtype=torch.float16)
    unet = engine.parts.unet
    inputs = lf.unet_inputs(family, device="cuda", dtype=torch.float16)
    plain = lf.run_unet(unet, inputs).float()
    with engine.session("unet"), torch.no_grad():
        out = engine.unet(inputs["latents"], inputs["timestep"], inputs["context"], inputs.get("added_cond_kwargs"))
    assert taken and out.is_contiguous()
    assert float((out.float() - plain).norm() / plain.norm()) < 5e-3

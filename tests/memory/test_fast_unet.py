"""``memory/fast_unet.py``: inside ``engine.session("unet")`` the UNet's diffusers GEGLUs run the one-pass GEGLU,
and outside it every module is as it was.

Guards: each eligible GEGLU gets the override inside the session and loses it on exit, also when the session
raises; the UNet's output inside equals diffusers' own forward bit for bit (CPU: the reference path is diffusers'
ops); the override object is the same in every session (a compiled UNet keeps its guards); a GEGLU with someone
else's ``forward`` keeps it; an unmerged LoRA on a GEGLU ``proj`` takes the override's place and puts it back;
autograd inputs take diffusers' ops; the other stages install nothing.
"""
from __future__ import annotations

import re

import pytest
import torch
from diffusers.models.activations import GEGLU

from leandiffusion.lora.adapter import inject_lora
from leandiffusion.memory.fast_unet import FusedGegluForward, fast_unet, is_fused_geglu
from leandiffusion.tests.kit import tiny_engine
from leandiffusion.tests.lora import lorafiles as lf


def _geglus(unet):
    return [m for m in unet.modules() if type(m) is GEGLU]


@pytest.mark.parametrize("family", ["sd1", "sdxl"])
def test_inside_the_unet_session_every_geglu_runs_one_pass_and_outside_none(family):
    engine = tiny_engine(family)
    unet = engine.parts.unet
    geglus = _geglus(unet)
    assert geglus
    before = lf.snapshot(unet)
    inputs = lf.unet_inputs(family)
    plain = lf.run_unet(unet, inputs)
    with engine.session("unet"):
        assert all(is_fused_geglu(m.__dict__.get("forward")) for m in geglus)
        fused = lf.run_unet(unet, inputs)
    assert all("forward" not in m.__dict__ for m in geglus)
    assert torch.equal(fused, plain)
    lf.assert_untouched(before, unet)


def test_the_same_override_in_every_session_and_none_for_other_stages():
    engine = tiny_engine("sd1")
    m = _geglus(engine.parts.unet)[0]
    with engine.session("unet"):
        first = m.__dict__["forward"]
    with engine.session("vae"), engine.session("text"):
        assert "forward" not in m.__dict__
    with engine.session("unet"):
        assert m.__dict__["forward"] is first


def test_a_failed_session_still_removes_the_overrides():
    engine = tiny_engine("sd1")
    geglus = _geglus(engine.parts.unet)
    with pytest.raises(RuntimeError, match="boom"):
        with engine.session("unet"):
            raise RuntimeError("boom")
    assert all("forward" not in m.__dict__ for m in geglus)


def test_a_forward_of_someone_elses_is_left_alone():
    engine = tiny_engine("sd1")
    m = _geglus(engine.parts.unet)[0]
    theirs = lambda x, *a, **k: x  # noqa: E731
    m.__dict__["forward"] = theirs
    with fast_unet(engine.parts.unet):
        assert m.__dict__["forward"] is theirs
    assert m.__dict__["forward"] is theirs


@pytest.mark.parametrize("strategy", ["geglu", "hook"])
def test_an_unmerged_lora_takes_the_overrides_place_and_puts_it_back(tmp_path, monkeypatch, strategy):
    monkeypatch.setenv("LEANDIFFUSION_LORA_STRATEGY", strategy)
    engine = tiny_engine("sd1")
    unet = engine.parts.unet
    roots = {"unet": unet}
    sd = lf.kohya_state_dict(roots, {"unet": re.compile(r"ff\.net\.0\.proj$")})
    path = lf.write(sd, tmp_path / "l.safetensors")
    view = inject_lora(engine, path, 0.8, 0.0, mode="unmerged")
    m = _geglus(unet)[0]
    with engine.session("unet"):
        fused = m.__dict__["forward"]
        with view.session("unet"):
            inside = m.__dict__["forward"]
            if strategy == "geglu":
                assert not is_fused_geglu(inside) and inside.replaced is fused and inside.terms
            else:  # the hook path hooks the proj and leaves the GEGLU's forward as it is
                assert inside is fused
        assert m.__dict__["forward"] is fused
    assert "forward" not in m.__dict__
    with view.session("unet"):  # not nested: the view's own session installs, the LoRA stands in, both go
        assert (m.__dict__["forward"].replaced is fused) if strategy == "geglu" else m.__dict__["forward"] is fused
    assert "forward" not in m.__dict__


def test_gradients_take_diffusers_ops():
    module = GEGLU(8, 6)
    x = torch.randn(3, 8, requires_grad=True)
    out = FusedGegluForward(module)(x)
    out.sum().backward()
    assert x.grad is not None and torch.equal(out.detach(), module(x).detach())

"""``memory/unet_norms.py``: inside ``engine.session("unet")`` the UNet's GroupNorms run ``kernels.group_norm`` and
each fusable ResnetBlock2D its one override; outside, every module is as it was.

Guards: the swap and the overrides inside the session, undone on exit, also when the session raises, and by the
outermost of nested sessions only; the UNet's output inside equals diffusers' own forward bit for bit on the CPU
(there every op is diffusers' own: a reordered or dropped op, a missed time-embedding add, a lost shortcut or
output scale would show); the override object is the same in every session; a resnet with someone else's
``forward`` keeps it; blocks the override does not compute (up/down sampling, scale-shift time embedding) keep
diffusers' forward; autograd and training take diffusers' ops; on the GPU the fused kernels are taken and the
fp16 UNet stays within rounding of the plain one.
"""
from __future__ import annotations

import pytest
import torch
from diffusers.models.resnet import ResnetBlock2D

from leandiffusion.kernels import group_norm as gn
from leandiffusion.memory import unet_norms
from leandiffusion.memory.unet_norms import FusedGroupNorm, ResnetOverride, fused_norms
from leandiffusion.tests.kit import tiny_engine
from leandiffusion.tests.lora import lorafiles as lf


def _resnets(unet):
    return [m for m in unet.modules() if type(m) is ResnetBlock2D]


def _norms(unet):
    return [m for m in unet.modules() if isinstance(m, torch.nn.GroupNorm)]


@pytest.mark.parametrize("family", ["sd1", "sdxl"])
def test_inside_the_unet_session_norms_and_resnets_run_fused_and_outside_none(family):
    engine = tiny_engine(family)
    unet = engine.parts.unet
    resnets, norms = _resnets(unet), _norms(unet)
    assert resnets and norms
    before = lf.snapshot(unet)
    inputs = lf.unet_inputs(family)
    plain = lf.run_unet(unet, inputs)
    with engine.session("unet"):
        assert all(type(m) is FusedGroupNorm for m in norms)
        assert all(isinstance(m.__dict__.get("forward"), ResnetOverride) for m in resnets)
        fused = lf.run_unet(unet, inputs)
    assert all(type(m) is torch.nn.GroupNorm for m in norms)
    assert all("forward" not in m.__dict__ for m in resnets)
    assert torch.equal(fused, plain)
    lf.assert_untouched(before, unet)


def test_the_same_override_in_every_session_and_only_the_outermost_undoes():
    engine = tiny_engine("sd1")
    unet = engine.parts.unet
    resnet, norm = _resnets(unet)[0], _norms(unet)[0]
    with fused_norms(unet):
        first = resnet.__dict__["forward"]
        with fused_norms(unet):
            assert resnet.__dict__["forward"] is first
        assert resnet.__dict__["forward"] is first and type(norm) is FusedGroupNorm
    assert "forward" not in resnet.__dict__ and type(norm) is torch.nn.GroupNorm
    with engine.session("vae"), engine.session("text"):
        assert "forward" not in resnet.__dict__
    with fused_norms(unet):
        assert resnet.__dict__["forward"] is first


def test_a_failed_session_still_undoes_everything():
    engine = tiny_engine("sd1")
    unet = engine.parts.unet
    with pytest.raises(RuntimeError, match="boom"):
        with engine.session("unet"):
            raise RuntimeError("boom")
    assert all("forward" not in m.__dict__ for m in _resnets(unet))
    assert all(type(m) is torch.nn.GroupNorm for m in _norms(unet))


def test_a_forward_of_someone_elses_is_left_alone():
    engine = tiny_engine("sd1")
    resnet = _resnets(engine.parts.unet)[0]
    theirs = lambda x, temb=None: x  # noqa: E731
    resnet.__dict__["forward"] = theirs
    with fused_norms(engine.parts.unet):
        assert resnet.__dict__["forward"] is theirs
    assert resnet.__dict__["forward"] is theirs


def _block(**kw):
    torch.manual_seed(0)
    return ResnetBlock2D(in_channels=8, out_channels=16, temb_channels=12, groups=4, **kw).eval()


@pytest.mark.parametrize("kw", [dict(), dict(output_scale_factor=2.0), dict(skip_time_act=True),
                                dict(up=True), dict(time_embedding_norm="scale_shift")])
def test_each_block_equals_diffusers_forward_and_only_plain_blocks_take_the_override(kw):
    block = _block(**kw)
    x, temb = torch.randn(2, 8, 6, 6), torch.randn(2, 12)
    with torch.no_grad():
        want = block(x, temb)
        with fused_norms(block):
            taken = isinstance(block.__dict__.get("forward"), ResnetOverride)
            got = block(x, temb)
    assert taken == ("up" not in kw and "time_embedding_norm" not in kw)
    assert torch.equal(got, want)


def test_autograd_and_training_take_diffusers_ops(monkeypatch):
    block = _block()
    x, temb = torch.randn(2, 8, 6, 6, requires_grad=True), torch.randn(2, 12)
    monkeypatch.setattr(unet_norms, "_norm_silu", lambda *a, **k: pytest.fail("the override ran"))
    with fused_norms(block):
        y = block(x, temb)
        y.sum().backward()
        block.train()
        with torch.no_grad():
            block(x, temb)
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["sd1", "sdxl"])
def test_gpu_fused_unet_takes_the_kernels_and_stays_within_rounding(family, monkeypatch):
    taken = []
    real = gn.group_norm_triton
    monkeypatch.setattr(gn, "group_norm_triton", lambda *a, **k: taken.append(k.get("silu", False)) or real(*a, **k))
    engine = tiny_engine(family)
    unet = engine.parts.unet.to("cuda", torch.float16)
    inputs = lf.unet_inputs(family, device="cuda", dtype=torch.float16)
    plain = lf.run_unet(unet, inputs).float()
    with fused_norms(unet):
        fused = lf.run_unet(unet, inputs).float()
    assert True in taken and False in taken  # resnets' norm -> SiLU pairs and the other GroupNorms
    assert float((fused - plain).norm() / plain.norm()) < 5e-3

"""``memory/unet_patches.py``: one override object per diffusers GEGLU; inside ``engine.session("unet")`` the UNet's
GEGLUs run the one-pass GEGLU, LoRA terms join the same object, and outside both every module is as it was.

Guards: each eligible GEGLU gets the override inside the session and loses it on exit, also when the session
raises; the UNet's output inside equals diffusers' own forward bit for bit (CPU: the reference path is diffusers'
ops); the override object is the same in every session and with or without LoRA terms (a compiled UNet keeps its
guards); a GEGLU with someone else's ``forward`` keeps it and refuses terms; an unmerged LoRA on a GEGLU ``proj``
adds its term to that object and takes it away; the override stays while a session or a term holds it, whatever
the order; autograd inputs take diffusers' ops; the other stages install nothing.
"""
from __future__ import annotations

import contextlib
import re

import pytest
import torch
from diffusers.models.activations import GEGLU

from leandiffusion.lora.adapter import inject_lora
from leandiffusion.memory.unet_patches import GegluOverride, fused_geglus, geglu_override, host_copy
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
        assert all(m.__dict__.get("forward") is geglu_override(m).forward for m in geglus)
        assert all(not geglu_override(m).terms for m in geglus)
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


def test_a_forward_of_someone_elses_is_left_alone_and_refuses_terms():
    engine = tiny_engine("sd1")
    m = _geglus(engine.parts.unet)[0]
    theirs = lambda x, *a, **k: x  # noqa: E731
    m.__dict__["forward"] = theirs
    with fused_geglus(engine.parts.unet):
        assert m.__dict__["forward"] is theirs
        assert geglu_override(m).add(object()) is False and not geglu_override(m).terms
    assert m.__dict__["forward"] is theirs


def test_only_a_plain_exact_gelu_geglu_has_an_override():
    plain, tanh = GEGLU(8, 6), GEGLU(8, 6)
    tanh.approximate = "tanh"

    class Sub(GEGLU):
        pass

    assert isinstance(geglu_override(plain), GegluOverride) and geglu_override(plain) is geglu_override(plain)
    assert geglu_override(tanh) is None and geglu_override(Sub(8, 6)) is None
    assert geglu_override(torch.nn.Linear(2, 2)) is None


@pytest.mark.parametrize("strategy", ["geglu", "hook"])
def test_an_unmerged_lora_adds_its_term_to_the_same_override(tmp_path, monkeypatch, strategy):
    monkeypatch.setenv("LEANDIFFUSION_LORA_STRATEGY", strategy)
    engine = tiny_engine("sd1")
    unet = engine.parts.unet
    roots = {"unet": unet}
    sd = lf.kohya_state_dict(roots, {"unet": re.compile(r"ff\.net\.0\.proj$")})
    path = lf.write(sd, tmp_path / "l.safetensors")
    view = inject_lora(engine, path, 0.8, 0.0, mode="unmerged")
    m = _geglus(unet)[0]
    override = geglu_override(m)
    with engine.session("unet"):
        assert m.__dict__["forward"] is override.forward and not override.terms
        with view.session("unet"):
            assert m.__dict__["forward"] is override.forward
            # the hook path hooks the proj and leaves the GEGLU's forward without terms
            assert len(override.terms) == (1 if strategy == "geglu" else 0)
        assert m.__dict__["forward"] is override.forward and not override.terms
    assert "forward" not in m.__dict__
    with view.session("unet"):  # not nested: the view's own session installs, the LoRA adds its term, both go
        assert m.__dict__["forward"] is override.forward
        assert len(override.terms) == (1 if strategy == "geglu" else 0)
    assert "forward" not in m.__dict__ and not override.terms


def test_the_override_stays_while_a_session_or_a_term_holds_it():
    """Whatever the order of a session and a term, the override is in place while either holds it."""
    unet = torch.nn.Sequential(GEGLU(8, 6))
    m = unet[0]
    override, term = geglu_override(m), object()
    assert override.add(term) and m.__dict__["forward"] is override.forward  # a term alone installs it
    with fused_geglus(unet):
        override.remove(term)
        assert m.__dict__["forward"] is override.forward  # the session still holds it
        assert override.add(term)
    assert m.__dict__["forward"] is override.forward  # the term still holds it
    override.remove(term)
    assert "forward" not in m.__dict__
    with fused_geglus(unet), fused_geglus(unet):  # sessions nest
        pass
    assert "forward" not in m.__dict__


@torch.no_grad()
def test_torch_compile_follows_the_session_and_the_terms_through_one_forward_object():
    """A compiled block inside sessions, with a LoRA term attached and detached again, equals the eager block in
    every state, without a graph break; the GEGLU's ``forward`` is one object throughout."""
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 5):
        pytest.skip("PyTorch 2.4's dynamo breaks the graph at the GEGLU override (result still correct)")
    from diffusers.models.attention import BasicTransformerBlock

    from leandiffusion.lora.formats import LoraLayer
    from leandiffusion.lora.keymap import Target
    from leandiffusion.lora.unmerged import UnmergedBinding

    torch._dynamo.reset()
    torch.manual_seed(0)
    block = BasicTransformerBlock(32, 2, 16, cross_attention_dim=24).eval().requires_grad_(False)
    proj = block.ff.net[0].proj
    down, up = 0.2 * torch.randn(4, 32), 0.2 * torch.randn(proj.out_features, 4)
    layer = LoraLayer("unet", "ff.net.0.proj", "dotted", down, up, 1.0, "ff.net.0.proj")
    binding = UnmergedBinding(("k",), [Target("unet", "ff.net.0.proj", proj, layer)], "t", strategy="geglu",
                              roots={"unet": block})
    x, ctx = torch.randn(2, 7, 32), torch.randn(2, 5, 24)
    compiled = torch.compile(block, backend="eager", fullgraph=True)
    override = geglu_override(block.ff.net[0])
    outs = []
    with fused_geglus(block):
        for attach in (False, True, False):
            if attach:
                binding.attach({"unet": 0.8})
            try:
                assert block.ff.net[0].__dict__["forward"] is override.forward
                eager = block(x, encoder_hidden_states=ctx)
                assert torch.allclose(compiled(x, encoder_hidden_states=ctx), eager, atol=1e-5)
                outs.append(eager)
            finally:
                if attach:
                    binding.detach({"unet": 0.8})
    assert (outs[1] - outs[0]).abs().max() > 1e-2 and torch.equal(outs[2], outs[0])
    torch._dynamo.reset()


@torch.no_grad()
def test_regional_compile_reuses_one_graph_per_block_shape_with_the_patches_in_place():
    """Every GEGLU shares one bound ``forward`` function (and every resnet one override class), so dynamo compiles
    no more graphs for the patched UNet than for the plain one: one per distinct block shape, whatever the number of
    blocks (a per-module callable made each transformer block a graph of its own)."""
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 5):
        pytest.skip("PyTorch 2.4's dynamo breaks the graph at the GEGLU override (result still correct)")
    from torch._dynamo.utils import counters

    from leandiffusion.memory.unet_norms import fused_norms
    from leandiffusion.sampling.compile import compiled_regions, regions_installed

    engine = tiny_engine("sdxl")
    unet = engine.parts.unet
    inputs = lf.unet_inputs("sdxl")
    graphs, outs = [], []
    for patched in (False, True):
        torch._dynamo.reset()
        counters.clear()
        regions = compiled_regions(unet, ("BasicTransformerBlock", "ResnetBlock2D"), backend="eager")
        with contextlib.ExitStack() as stack:
            if patched:
                stack.enter_context(fused_geglus(unet))
                stack.enter_context(fused_norms(unet))
            with regions_installed(regions):
                outs.append(lf.run_unet(unet, inputs))
        graphs.append(counters["stats"]["unique_graphs"])
    torch._dynamo.reset()
    assert len(_geglus(unet)) > 2 and graphs[1] <= graphs[0]
    assert torch.equal(outs[1], outs[0])


def test_gradients_take_diffusers_ops():
    module = GEGLU(8, 6)
    x = torch.randn(3, 8, requires_grad=True)
    out = GegluOverride(module)(x)
    out.sum().backward()
    assert x.grad is not None and torch.equal(out.detach(), module(x).detach())


def test_host_copy_is_none_for_a_weight_that_does_not_stream():
    assert host_copy(torch.nn.Linear(2, 2).weight) is None

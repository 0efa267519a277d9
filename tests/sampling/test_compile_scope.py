"""Compile scope (``sampling/compile.py``): the whole UNet or its repeated blocks (regional compilation).

CPU checks use dynamo with its ``eager`` backend (tracing and guards as on the GPU, no code generation), so they
run in seconds: the regional wrapper must compute exactly the eager UNet, compile only outermost regions, leave
the modules' own call path untouched outside a compiled call (also after an error), and ``auto`` must pick the
whole graph for small UNets and regions for large ones. The GPU test compiles with inductor and compares the
regional sampler with the eager one in fp32.
"""
import pytest
import torch

from leandiffusion.sampling import compile as comp
from leandiffusion.sampling.graph_runner import GraphRunner
from leandiffusion.sampling.loop import sample
from leandiffusion.sampling.settings import SamplerSettings
from leandiffusion.tests.kit import tiny_engine


def _inputs(unet, batch=2, hw=16):
    g = torch.Generator().manual_seed(0)
    cfg = unet.config
    x = torch.randn(batch, cfg.in_channels, hw, hw, generator=g)
    ctx = torch.randn(batch, 77, cfg.cross_attention_dim, generator=g)
    kwargs = {"encoder_hidden_states": ctx, "return_dict": False}
    if cfg.addition_embed_type == "text_time":
        pooled = cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim
        kwargs["added_cond_kwargs"] = {"text_embeds": torch.randn(batch, pooled, generator=g),
                                       "time_ids": torch.randn(batch, 6, generator=g)}
    return (x, torch.tensor(500)), kwargs


@pytest.mark.parametrize("family,scope", [("sd1", "blocks"), ("sdxl", "transformers+resnets"),
                                          ("sdxl", "blocks+resnets")])
def test_regional_compile_computes_the_eager_unet(family, scope):
    torch._dynamo.reset()
    unet = tiny_engine(family).parts.unet
    args, kwargs = _inputs(unet)
    with torch.no_grad():
        ref = unet(*args, **kwargs)[0]
        wrapped = comp.RegionallyCompiledUNet(unet, comp._SCOPES[scope], backend="eager")
        out = wrapped(*args, **kwargs)[0]
        again = wrapped(*args, **kwargs)[0]
    assert torch.equal(out, ref) and torch.equal(again, ref)
    names = {type(m).__name__ for m, _ in wrapped.regions}
    assert names <= set(comp._SCOPES[scope]) and wrapped.regions
    # outermost only: no region lies inside another
    region_ids = {id(m) for m, _ in wrapped.regions}
    for m, _ in wrapped.regions:
        assert not any(id(sub) in region_ids for sub in m.modules() if sub is not m)
    # outside a compiled call, the modules run their own (eager) call path
    assert all(m._compiled_call_impl is None for m, _ in wrapped.regions)


def test_regional_compile_restores_the_modules_after_an_error():
    unet = tiny_engine("sd1").parts.unet
    wrapped = comp.RegionallyCompiledUNet(unet, comp._SCOPES["blocks"], backend="eager")
    args, kwargs = _inputs(unet)
    kwargs["encoder_hidden_states"] = kwargs["encoder_hidden_states"][..., :3]  # wrong width: the call fails
    with pytest.raises(RuntimeError), torch.no_grad():
        wrapped(*args, **kwargs)
    assert all(m._compiled_call_impl is None for m, _ in wrapped.regions)



def test_recompile_limit_is_raised_for_the_call_on_every_supported_torch():
    """The option is ``recompile_limit`` from PyTorch 2.7 and ``cache_size_limit`` before: patching the new name on
    2.3-2.6 raised KeyError from every regional compiled call (seen under torch 2.3.1 and 2.4.1). ``cache_size_limit``
    reads the same setting on every version (an alias from 2.7 on)."""
    config = torch._dynamo.config
    before = config.cache_size_limit
    with comp.recompile_limit_raised(before + 17):
        assert config.cache_size_limit == before + 17
    assert config.cache_size_limit == before

def test_regional_compile_names_a_unet_without_the_blocks():
    with pytest.raises(ValueError, match="LEANDIFFUSION_COMPILE_SCOPE=full"):
        comp.RegionallyCompiledUNet(torch.nn.Sequential(torch.nn.Linear(2, 2)), ("BasicTransformerBlock",))


def test_auto_scope_is_full_for_small_unets_and_regional_for_large_ones():
    from diffusers.models.attention import BasicTransformerBlock

    small = tiny_engine("sdxl").parts.unet
    assert comp.resolved_scope(small, "auto") == "full"
    large = torch.nn.ModuleList(BasicTransformerBlock(8, 1, 8) for _ in range(comp.REGIONAL_ABOVE_BLOCKS + 1))
    assert comp.resolved_scope(large, "auto") == comp.AUTO_REGIONAL_SCOPE
    assert comp.resolved_scope(large, "full") == "full"


def test_scope_setting_is_validated(monkeypatch):
    monkeypatch.setenv(comp.ENV_COMPILE_SCOPE, "everything")
    with pytest.raises(ValueError, match="LEANDIFFUSION_COMPILE_SCOPE='everything'"):
        comp.compile_scope()
    monkeypatch.setenv(comp.ENV_COMPILE_SCOPE, "blocks")
    assert comp.compile_scope() == "blocks"
    monkeypatch.delenv(comp.ENV_COMPILE_SCOPE)
    assert comp.compile_scope() == "auto"


@pytest.mark.gpu
@pytest.mark.parametrize("scope", ["transformers+resnets", "blocks+resnets"])
def test_gpu_regional_compile_matches_eager_fp32(monkeypatch, strict_fp32, scope):
    """fp32, TF32 off: the regionally compiled sampler computes the eager one (rel <= 1e-4 after 6 steps)."""
    monkeypatch.setenv(comp.ENV_COMPILE_SCOPE, scope)
    eng = tiny_engine("sdxl", device="cuda", dtype=torch.float32)
    base = dict(seed=3, steps=6, cfg=5.0, width=64, height=64, batch_size=2, positive="a", negative="b")
    eager = sample(eng, SamplerSettings(acceleration="none", **base), quiet=True)["samples"]
    fast = sample(eng, SamplerSettings(acceleration="compile+cuda_graph", **base), runner=GraphRunner(),
                  quiet=True)["samples"]
    assert isinstance(comp._COMPILED[eng.parts], comp.RegionallyCompiledUNet)
    rel = ((fast.double() - eager.double()).norm() / eager.double().norm()).item()
    assert rel <= 1e-4, rel

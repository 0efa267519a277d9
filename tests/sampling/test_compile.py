"""``sampling/compile.py`` beside ``test_compile_scope.py``: settings, the per-model cache, what is handed to
``torch.compile`` and what the compiled calls receive. ``torch.compile`` is replaced by a recorder that returns the
eager callable, so the checks take no compile time.

Guards: an empty setting means the default; a region inside another is not compiled again; regions whose names share
a prefix (``blocks.1``, ``blocks.10``) are all compiled; a call restores a block's own earlier compiled call and raises
the recompile limit for its duration; ``auto`` compiles the whole UNet up to ``REGIONAL_ABOVE_BLOCKS`` blocks inclusive
and an explicit scope is kept; one compiled module per model; the preset's inductor settings and ``dynamic=False``
reach ``torch.compile``; SDXL's added conditioning reaches the UNet through both calls.
"""
from __future__ import annotations

import pytest
import torch

from leandiffusion.sampling import compile as comp
from leandiffusion.tests.kit import assert_unet_call_passes_sdxl_conditioning, tiny_engine


class CompileRecorder:
    """Stands in for ``torch.compile``: records each call's keyword arguments and the recompile limit in effect
    when the compiled callable runs; returns a callable that runs the original eagerly."""

    def __init__(self):
        self.calls, self.limits = [], []

    def __call__(self, fn, **kwargs):
        self.calls.append(kwargs)

        def compiled(*args, **kw):
            self.limits.append(torch._dynamo.config.cache_size_limit)
            return fn(*args, **kw)

        return compiled


@pytest.fixture
def recorder(monkeypatch):
    rec = CompileRecorder()
    monkeypatch.setattr(torch, "compile", rec)
    for name in (comp.ENV_COMPILE_MODE, comp.ENV_COMPILE_SCOPE):
        monkeypatch.delenv(name, raising=False)
    return rec


def _blocks(n):
    from diffusers.models.attention import BasicTransformerBlock

    return torch.nn.ModuleList(BasicTransformerBlock(8, 1, 8) for _ in range(n))


def test_an_empty_setting_means_the_default(monkeypatch):
    monkeypatch.setenv(comp.ENV_COMPILE_MODE, " ")
    monkeypatch.setenv(comp.ENV_COMPILE_SCOPE, "")
    assert comp.compile_mode() == "default" and comp.compile_scope() == comp.DEFAULT_SCOPE


def test_every_region_is_compiled_when_names_share_a_prefix(recorder):
    blocks = _blocks(11)  # "1" is a prefix of "10" but "10" is not inside "1"
    wrapped = comp.RegionallyCompiledUNet(blocks, ("BasicTransformerBlock",), mode="default")
    assert [m for m, _ in wrapped.regions] == list(blocks)
    assert recorder.calls == [{"dynamic": False, "mode": "default"}] * 11


def test_a_region_inside_another_region_is_not_compiled_again(recorder):
    """No scope of ``_SCOPES`` names two classes that nest in the diffusers UNets, so the class's own contract is
    checked directly: with both ``Transformer2DModel`` and the ``BasicTransformerBlock`` inside it, only the outer."""
    unet = tiny_engine("sd1").parts.unet
    wrapped = comp.RegionallyCompiledUNet(unet, ("Transformer2DModel", "BasicTransformerBlock"))
    outer = [m for m in unet.modules() if type(m).__name__ == "Transformer2DModel"]
    assert outer and [m for m, _ in wrapped.regions] == outer and len(recorder.calls) == len(outer)


def test_a_call_raises_the_recompile_limit_and_restores_each_blocks_own_compiled_call(recorder):
    unet = tiny_engine("sd1").parts.unet
    wrapped = comp.RegionallyCompiledUNet(unet, comp._SCOPES["blocks"])
    own = [object() for _ in wrapped.regions]  # e.g. diffusers' compile_repeated_blocks compiled them earlier
    for (module, _), mark in zip(wrapped.regions, own):
        module._compiled_call_impl = mark
    cfg = unet.config
    g = torch.Generator().manual_seed(0)
    x, ctx = torch.randn(1, cfg.in_channels, 8, 8, generator=g), torch.randn(1, 77, cfg.cross_attention_dim)
    before = torch._dynamo.config.cache_size_limit
    with torch.no_grad():
        wrapped(x, torch.tensor(10), encoder_hidden_states=ctx, return_dict=False)
    assert recorder.limits and set(recorder.limits) == {comp.REGIONAL_RECOMPILE_LIMIT}
    assert [m._compiled_call_impl for m, _ in wrapped.regions] == own
    assert torch._dynamo.config.cache_size_limit == before


def test_auto_is_full_up_to_the_threshold_and_an_explicit_scope_is_kept():
    assert comp.resolved_scope(_blocks(comp.REGIONAL_ABOVE_BLOCKS), "auto") == "full"
    large = _blocks(comp.REGIONAL_ABOVE_BLOCKS + 1)
    small = tiny_engine("sd1").parts.unet
    for scope in ("blocks", "blocks+resnets", "transformers+resnets"):
        assert comp.resolved_scope(small, scope) == scope and comp.resolved_scope(large, scope) == scope


@pytest.mark.parametrize("mode,scope", [("default", "full"), ("tuned", "full"), ("tuned", "blocks+resnets"),
                                        ("max-autotune-no-cudagraphs", "blocks")])
def test_one_compiled_unet_per_model_with_the_presets_settings(recorder, monkeypatch, mode, scope):
    monkeypatch.setenv(comp.ENV_COMPILE_MODE, mode)
    monkeypatch.setenv(comp.ENV_COMPILE_SCOPE, scope)
    engine = tiny_engine("sd1")
    first = comp.compiled_unet(engine)
    assert comp.compiled_unet(engine.with_changes(plan="another view")) is first
    assert comp.compiled_unet(tiny_engine("sd1")) is not first  # another model, its own
    preset = comp._PRESETS[mode]
    if scope == "full":
        assert recorder.calls[0] == {"dynamic": False, "fullgraph": False, **preset}
    else:
        assert isinstance(first, comp.RegionallyCompiledUNet)
        assert recorder.calls[0] == {"dynamic": False, **preset}


@pytest.mark.parametrize("fn", ["eager", "compiled"])
def test_both_calls_pass_sdxls_added_conditioning(recorder, monkeypatch, fn):
    monkeypatch.setenv(comp.ENV_COMPILE_SCOPE, "full")
    engine = tiny_engine("sdxl")
    call = comp.eager_unet_fn(engine) if fn == "eager" else comp.compiled_unet_fn(engine)
    assert_unet_call_passes_sdxl_conditioning(engine, call)

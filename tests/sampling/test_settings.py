"""``SamplerSettings.validated()``: every range the Fused DDIM Sampler node declares to ComfyUI is the range it takes.

The node's ``INPUT_TYPES`` (what ComfyUI's widgets let a user enter) is the reference: each declared end is
accepted, the value one widget step beyond it is refused by name. Guards: an
end off by one (steps 1000, batch 64, width 8192, cfg 0 refused although the widget offers them), the
``steps * denoise`` check refusing a product of exactly 1, and a cfg below 1 read as "unguided".
"""
import pytest
import torch

from leandiffusion.nodes.sampler import LeanFusedDDIMSampler
from leandiffusion.sampling.loop import sample
from leandiffusion.sampling.settings import SamplerSettings
from leandiffusion.tests.kit import tiny_engine

DECLARED = {**LeanFusedDDIMSampler.INPUT_TYPES()["required"], **LeanFusedDDIMSampler.INPUT_TYPES()["optional"]}
NUMERIC = [name for name, (kind, _) in DECLARED.items() if kind in ("INT", "FLOAT") and name != "seed"]


def _settings(**kw):
    return SamplerSettings(positive="a boat", **kw)


def test_every_numeric_input_is_declared():
    assert sorted(NUMERIC) == sorted(["steps", "cfg", "eta", "width", "height", "batch_size", "denoise"])


@pytest.mark.parametrize("name", NUMERIC)
def test_the_declared_ends_are_accepted_and_one_step_beyond_refused(name):
    kind, spec = DECLARED[name]
    step = spec.get("step", 1 if kind == "INT" else 0.01)
    for end in (spec["min"], spec["max"]):
        kw = {name: end}
        if name == "denoise" and end == 0.0:
            continue  # int(steps * 0) runs no step: refused on purpose (test_a_product_of_exactly_one_step_runs)
        assert getattr(_settings(**kw).validated(), name) == end
    for beyond in (spec["min"] - step, spec["max"] + step):
        with pytest.raises(ValueError, match=rf"^{name}={beyond:g}"):
            _settings(**{name: beyond}).validated()


def test_a_product_of_exactly_one_step_runs():
    assert _settings(steps=2, denoise=0.5).validated().denoise == 0.5
    assert _settings(steps=10, denoise=0.1).validated().denoise == 0.1  # int(10 * 0.1) = 1
    with pytest.raises(ValueError, match=r"steps \* denoise = 1 \* 0\.99"):
        _settings(steps=1, denoise=0.99).validated()


@pytest.mark.parametrize("cfg,guided", [(0.0, True), (0.5, True), (1.0, False), (1.5, True)])
def test_only_a_scale_of_exactly_one_skips_guidance(cfg, guided):
    """u + s (c - u) equals c only at s = 1 (ComfyUI runs the uncond pass for every other scale)."""
    assert _settings(cfg=cfg).guided is guided


def test_a_scale_of_zero_samples_the_negative_prompt():
    """At cfg 0 the guided prediction is u + 0 (c - u) = u: the run equals an unguided run of the negative prompt.
    Sequential CFG, so the uncond call has the unguided call's shapes (same kernels, same rounding)."""
    engine = tiny_engine("sd1")
    base = dict(seed=5, steps=3, width=64, height=64, acceleration="none", cfg_mode="sequential")
    at_zero = sample(engine, SamplerSettings(positive="a red boat", negative="fog", cfg=0.0, **base), quiet=True)
    of_negative = sample(engine, SamplerSettings(positive="fog", negative="", cfg=1.0, **base), quiet=True)
    of_positive = sample(engine, SamplerSettings(positive="a red boat", negative="", cfg=1.0, **base), quiet=True)
    torch.testing.assert_close(at_zero["samples"], of_negative["samples"], atol=1e-6, rtol=1e-6)
    assert (at_zero["samples"] - of_positive["samples"]).abs().max() > 1e-3  # the prompts do differ

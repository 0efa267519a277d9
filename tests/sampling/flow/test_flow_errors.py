"""Bad input to the Fused Flow Sampler is refused by name with the fix, before any model runs: a model of another
family, an SD latent, a size that is not a multiple of 16, unusable CONDITIONING; and a Z-Image model refused by
the Fused DDIM Sampler."""
import pytest
import torch

from leandiffusion.nodes.flow import LeanFlowSampler
from leandiffusion.sampling.flow.loop import sample_flow
from leandiffusion.sampling.flow.settings import FlowSettings
from leandiffusion.sampling.loop import sample
from leandiffusion.sampling.settings import SamplerSettings
from leandiffusion.tests.kit import tiny_engine


def _node(engine, **over):
    args = dict(lean_model=engine, positive="a cat", negative="", seed=0, steps=1, cfg=1.0, width=32, height=32,
                batch_size=1, acceleration="none")
    args.update(over)
    return LeanFlowSampler().run(**args)


def test_an_sd_model_is_refused_with_the_right_sampler():
    with pytest.raises(ValueError, match=r"lean_model is a sd1 model.*Fused DDIM Sampler"):
        _node(tiny_engine("sd1"))


def test_a_zimage_model_is_refused_by_the_ddim_sampler(zimage_engine):
    with pytest.raises(ValueError, match=r"lean_model is a zimage model.*Fused Flow Sampler"):
        sample(zimage_engine, SamplerSettings("a cat", steps=1, width=64, height=64, acceleration="none"))


def test_an_sd_latent_is_refused(zimage_engine):
    with pytest.raises(ValueError, match=r"latent_image has 4 channels but this model's VAE uses 16"):
        _node(zimage_engine, latent_image={"samples": torch.zeros(1, 4, 4, 4)})


@pytest.mark.parametrize("name", ["width", "height"])
def test_size_not_a_multiple_of_16(zimage_engine, name):
    with pytest.raises(ValueError, match=rf"{name}=40 is not a multiple of 16.*use 32 or 48"):
        _node(zimage_engine, **{name: 40})


def test_a_latent_of_odd_size_is_refused(zimage_engine):
    with pytest.raises(ValueError, match="not a multiple of the patch size"):
        _node(zimage_engine, latent_image={"samples": torch.zeros(1, 16, 5, 4)})


@pytest.mark.parametrize("cond,match", [
    ([[torch.zeros(1, 5, 768), {}]], r"positive_cond has shape \(1, 5, 768\).*Qwen3 hidden states \[b, L, 32\]"),
    ([], "expected a CONDITIONING with one entry"),
    ([[torch.zeros(1, 5, 32), {}], [torch.zeros(1, 5, 32), {}]], "combined or empty"),
    ([[torch.full((1, 5, 32), float("nan")), {}]], "positive_cond"),
    ([[torch.zeros(1, 5, 32), {"attention_mask": torch.zeros(1, 5)}]], "no unmasked token"),
    ([[torch.zeros(3, 5, 32), {}]], "holds 3 rows; expected 1 or batch_size=1"),
])
def test_unusable_conditioning(zimage_engine, cond, match):
    with pytest.raises(ValueError, match=match):
        _node(zimage_engine, positive_cond=cond)


def test_settings_refusals():
    with pytest.raises(ValueError, match="steps=0"):
        FlowSettings("a", steps=0).validated()
    with pytest.raises(ValueError, match="denoise"):
        FlowSettings("a", denoise=0.0).validated()
    with pytest.raises(ValueError, match="acceleration"):
        FlowSettings("a", acceleration="fast").validated()
    with pytest.raises(TypeError, match="negative"):
        FlowSettings("a", negative=None).validated()


def test_nothing_changes_the_engine_after_a_refusal(zimage_engine):
    before = {k: v.clone() for k, v in zimage_engine.parts.unet.state_dict().items()}
    with pytest.raises(ValueError):
        _node(zimage_engine, width=40)
    after = zimage_engine.parts.unet.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert sample_flow(zimage_engine, FlowSettings("a", steps=1, width=32, height=32, acceleration="none"))

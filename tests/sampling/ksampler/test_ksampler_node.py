"""The Fused KSampler node (``nodes.ksampler`` over ``sampling.ksampler.loop``): core KSampler's inputs, the same
result eager and replayed from a captured graph (stand-in capture backend on the CPU), under every VRAM policy,
ComfyUI's LATENT conventions, interruption between model calls, and bad input refused by name."""
import pytest
import torch

from leandiffusion import bridge
from leandiffusion.memory.load import TINY_ZIMAGE_CHOICE, load_engine
from leandiffusion.nodes.ksampler import LeanKSampler
from leandiffusion.sampling.graph_runner import GraphRunner
from leandiffusion.sampling.ksampler.loop import sample_k
from leandiffusion.sampling.ksampler.settings import KSamplerSettings
from leandiffusion.tests.kit import tiny_engine, tiny_parts
from leandiffusion.tests.kit.graph_backend import StandInBackend

CORE_KSAMPLER_INPUTS = ["seed", "steps", "cfg", "sampler_name", "scheduler", "positive", "negative", "latent_image",
                        "denoise"]


@pytest.fixture(scope="module")
def sd1():
    return tiny_engine("sd1")


@pytest.fixture(scope="module")
def zimage():
    return load_engine(TINY_ZIMAGE_CHOICE, device="cpu")


def _settings(**kw):
    base = dict(seed=3, steps=3, cfg=5.0, sampler_name="dpmpp_2m_sde", scheduler="karras", acceleration="none",
                positive_prompt="a red cat", negative_prompt="blurry")
    return KSamplerSettings(**{**base, **kw})


def test_inputs_are_core_ksamplers_plus_the_packs():
    spec = LeanKSampler.INPUT_TYPES()
    names = list(spec["required"]) + list(spec["optional"])
    assert set(CORE_KSAMPLER_INPUTS) <= set(names)
    for section in spec.values():
        for name, (kind, options) in section.items():
            assert options.get("tooltip"), name
    assert spec["required"]["sampler_name"][1]["default"] == "euler"
    assert spec["required"]["scheduler"][1]["default"] == "simple"


@pytest.mark.parametrize("family", ["sd1", "zimage"])
@pytest.mark.parametrize("sampler", ["euler_ancestral", "dpmpp_sde", "uni_pc"])
def test_a_captured_denoiser_replays_the_eager_result(family, sampler, sd1, zimage):
    engine = sd1 if family == "sd1" else zimage
    latent = {"samples": torch.zeros(2, engine.parts.latent_channels, 8, 8)}
    runner = GraphRunner(backend=StandInBackend(), max_graphs=4)
    eager = sample_k(engine, _settings(sampler_name=sampler), latent, quiet=True)["samples"]
    first = sample_k(engine, _settings(sampler_name=sampler, acceleration="cuda_graph"), latent, runner=runner,
                     quiet=True)["samples"]
    other_cfg = sample_k(engine, _settings(sampler_name=sampler, acceleration="cuda_graph", cfg=2.0), latent,
                         runner=runner, quiet=True)["samples"]
    assert torch.equal(first, eager)
    assert runner.captures(engine) == 1  # cfg lives in a buffer: no recapture
    assert not torch.allclose(other_cfg, first)


@pytest.mark.parametrize("policy", ["balanced", "lowvram", "stream"])
def test_every_vram_policy_gives_the_full_result(policy):
    from leandiffusion.memory.load import build_engine

    latent = {"samples": torch.zeros(1, 4, 8, 8)}
    full = sample_k(tiny_engine("sd1"), _settings(), latent, quiet=True)["samples"]
    engine = build_engine(tiny_parts("sd1"), policy, vram_budget_gb=1.0, weight_dtype="fp32", vae_dtype="fp32",
                          device="cpu")
    assert torch.equal(sample_k(engine, _settings(), latent, quiet=True)["samples"], full)


def test_denoise_zero_returns_the_latent_and_other_keys_are_kept(sd1):
    latent = {"samples": torch.randn(1, 4, 8, 8), "batch_index": [2]}
    out = sample_k(sd1, _settings(), latent, quiet=True)
    assert out["batch_index"] == [2] and not torch.equal(out["samples"], latent["samples"])
    same = sample_k(sd1, _settings(denoise=0.0), latent, quiet=True)
    assert torch.equal(same["samples"], latent["samples"])


def test_batch_index_draws_the_starting_noise_as_comfyui(sd1):
    """A deterministic sampler: the per-step noise of the SDE samplers is drawn for the whole batch, as ComfyUI's."""
    settings = _settings(cfg=1.0, sampler_name="euler")
    alone = sample_k(sd1, settings, {"samples": torch.zeros(1, 4, 8, 8), "batch_index": [1]}, quiet=True)["samples"]
    pair = sample_k(sd1, settings, {"samples": torch.zeros(2, 4, 8, 8)}, quiet=True)["samples"]
    assert torch.allclose(alone[0], pair[1], atol=1e-4)  # row 1 of a batch regenerates alone


def test_an_empty_latent_of_another_family_is_resized_like_comfyui(zimage):
    out = sample_k(zimage, _settings(steps=2), {"samples": torch.zeros(1, 4, 8, 8)}, quiet=True)["samples"]
    assert out.shape == (1, 16, 8, 8)
    with pytest.raises(ValueError, match="latent_image has 4 channels"):
        sample_k(zimage, _settings(steps=2), {"samples": torch.ones(1, 4, 8, 8)}, quiet=True)


def test_interruption_stops_between_model_calls(sd1):
    calls = []

    def hook():
        calls.append(1)
        if len(calls) == 4:
            raise bridge.Interrupted("stop")

    bridge.set_interrupt_hook(hook)
    try:
        with pytest.raises(bridge.Interrupted):
            sample_k(sd1, _settings(steps=8), {"samples": torch.zeros(1, 4, 8, 8)}, quiet=True)
    finally:
        bridge.set_interrupt_hook(None)
    assert len(calls) == 4
    assert sample_k(sd1, _settings(steps=2), {"samples": torch.zeros(1, 4, 8, 8)}, quiet=True)["samples"].shape \
        == (1, 4, 8, 8)  # the engine stays usable


@pytest.mark.parametrize("kw, match", [
    ({"sampler_name": "dpm_fast"}, "sampler_name='dpm_fast'"),
    ({"scheduler": "kl_optimal"}, "scheduler='kl_optimal'"),
    ({"steps": 0}, "steps=0"), ({"cfg": float("nan")}, "cfg=nan"), ({"denoise": 2.0}, "denoise=2.0"),
    ({"acceleration": "turbo"}, "acceleration='turbo'")])
def test_bad_settings_are_refused_by_name(sd1, kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        sample_k(sd1, _settings(**kw), {"samples": torch.zeros(1, 4, 8, 8)}, quiet=True)


def test_a_non_engine_or_a_bad_latent_is_refused(sd1):
    with pytest.raises(TypeError, match="lean_model"):
        sample_k("model", _settings(), {"samples": torch.zeros(1, 4, 8, 8)})
    with pytest.raises(TypeError, match="latent_image"):
        sample_k(sd1, _settings(), torch.zeros(1, 4, 8, 8))
    with pytest.raises(ValueError, match="latent_image"):
        sample_k(sd1, _settings(), {"samples": torch.full((1, 4, 8, 8), float("nan"))})
    with pytest.raises(ValueError, match="noise_mask.*do not inpaint.*KSampler"):
        sample_k(sd1, _settings(), {"samples": torch.zeros(1, 4, 8, 8), "noise_mask": torch.ones(1, 8, 8)})

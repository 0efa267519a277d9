"""``blend`` mode is a usable approximation of the untiled VAE and costs clearly less than ``exact`` (issue 41, item 8).

The issue's setting: a 37 x 45 latent (296 x 360 px) at 128 px tiles with a 32 px overlap, fp32 on the CPU, the
test kit's tiny 4-level VAEs with mid-block attention: the SD-like 4-channel one and Z-Image's 16-channel one (no
quant convolutions, a shift factor). ``blend`` used to run each overlapping tile through the whole VAE with its own
GroupNorm statistics and cross-fade the tiles: a decode 0.059-0.063 (SD) / 0.043 (Z-Image) off the untiled one on
average over the 0..1 range, an encode 19-67% of the latents' magnitude, for more convolution work than ``exact`` at
these tiles (1.62x the untiled decode's against exact's 1.54x). Now it runs exact's seamless bands with estimated
statistics for the GroupNorm inside each ResNet block (``vae/estimated_stats.py``).

Targets (usable: a small diffuse error, no seams): decode mean abs error <= 0.005 of the 0..1 range and max <= 0.1;
encode mean abs error <= 0.02 of the latents' mean magnitude. Measured here: decode 0.0010 / 0.0007 mean, encode
0.4-0.6%; at 96 x 96 latents with 512 px tiles 0.0014 and 0.6-0.9%. Cost: torch's FLOP count of the convolutions
and attention, at most 0.9x exact's at the issue's setting (measured 0.88 decode / 0.86 encode; 0.79 at 96 x 96,
where exact is 1.40x the untiled decode and blend 1.10x).
"""
import copy

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from leandiffusion.memory.engine import parts_from_components
from leandiffusion.memory.load import build_engine
from leandiffusion.memory.tiny_zimage import build_tiny_zimage
from leandiffusion.nodes.vae import LeanTiledVAEDecode, LeanTiledVAEEncode
from leandiffusion.tests.kit import tiny_engine
from leandiffusion.vae import exact as exact_mod

DECODE_MEAN, DECODE_MAX, ENCODE_MEAN = 0.005, 0.1, 0.02
COST = 0.9


@pytest.fixture(scope="module", params=["sd1", "zimage"])
def engine(request):
    if request.param == "sd1":
        return tiny_engine("sd1")
    return build_engine(parts_from_components(build_tiny_zimage(), name="tiny-zimage"), "full", device="cpu")


def _latent(engine, h=37, w=45, seed=0):
    channels = engine.parts.vae.config.latent_channels
    return torch.randn(1, channels, h, w, generator=torch.Generator().manual_seed(seed))


def _pictures(h=296, w=360, seed=0):
    """Noise, and a smooth picture (bicubic colour fields with a little grain): the encoder's GroupNorms see low
    spreads and strong borders there."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.rand(1, h, w, 3, generator=g)
    fields = torch.nn.functional.interpolate(torch.rand(1, 3, h // 32, w // 32, generator=g), size=(h, w),
                                             mode="bicubic").clamp(0, 1).permute(0, 2, 3, 1)
    return {"noise": noise, "smooth": (0.85 * fields + 0.15 * noise).clamp(0, 1)}


def _untiled_decode(engine, z):
    with torch.no_grad():
        return ((engine.parts.vae.decode(z).sample + 1) / 2).clamp(0, 1).permute(0, 2, 3, 1)


def _untiled_encode(engine, pixels):
    with torch.no_grad():
        return engine.parts.vae.encode(pixels.permute(0, 3, 1, 2).contiguous() * 2 - 1).latent_dist.mean


def _decode(engine, z, mode, tile=128):
    return LeanTiledVAEDecode().decode({"samples": z}, tile, 32, mode, lean_model=engine)[0]


def _encode(engine, pixels, mode, tile=128):
    return LeanTiledVAEEncode().encode(pixels, tile, 32, mode, lean_model=engine)[0]["samples"]


def test_blend_decode_is_within_the_target_at_the_issues_setting(engine, record_property):
    z = _latent(engine)
    ref = _untiled_decode(engine, z)
    blend = _decode(engine, z, "blend")
    error = (blend - ref).abs()
    record_property("blend_decode_mean_abs", error.mean().item())
    record_property("blend_decode_max_abs", error.max().item())
    assert blend.shape == ref.shape == (1, 296, 360, 3)
    assert error.mean().item() <= DECODE_MEAN, error.mean().item()
    assert error.max().item() <= DECODE_MAX, error.max().item()
    assert error.max().item() > 1e-4  # it is the estimate that ran, not exact


@pytest.mark.parametrize("picture", ["noise", "smooth"])
def test_blend_encode_is_within_the_target_at_the_issues_setting(engine, picture, record_property):
    pixels = _pictures()[picture]
    ref = _untiled_encode(engine, pixels)
    blend = _encode(engine, pixels, "blend")
    relative = (blend - ref).abs().mean().item() / ref.abs().mean().item()
    record_property("blend_encode_mean_rel", relative)
    assert blend.shape == ref.shape
    assert relative <= ENCODE_MEAN, relative


def test_blend_decode_within_the_target_at_a_larger_size(engine):
    z = _latent(engine, 40, 56, seed=1)  # 320 x 448 px at 256 px tiles: the strides of larger images sample more
    error = (_decode(engine, z, "blend", tile=256) - _untiled_decode(engine, z)).abs()
    assert error.mean().item() <= DECODE_MEAN and error.max().item() <= DECODE_MAX, (error.mean(), error.max())


def _flops(run) -> int:
    with FlopCounterMode(display=False) as counter:
        run()
    return counter.get_total_flops()


def test_blend_costs_clearly_less_than_exact(engine, record_property):
    """FLOPs of the convolutions and attention (deterministic for given shapes), decode and encode."""
    z, pixels = _latent(engine), _pictures()["noise"]
    with torch.no_grad():
        untiled = _flops(lambda: engine.parts.vae.decode(z))
    exact, blend = (_flops(lambda m=m: _decode(engine, z, m)) for m in ("exact", "blend"))
    record_property("decode_flops_vs_untiled", {"exact": exact / untiled, "blend": blend / untiled})
    assert blend <= COST * exact, (blend / untiled, exact / untiled)
    exact, blend = (_flops(lambda m=m: _encode(engine, pixels, m)) for m in ("exact", "blend"))
    assert blend <= COST * exact, blend / exact


def test_sampling_is_the_only_approximation(engine, monkeypatch):
    """With every column sampled, blend's statistics are exact (the means by linearity, the variances over all
    samples): the decode equals the untiled one like exact's does. Guards the means and the estimate's plumbing."""
    monkeypatch.setattr(exact_mod, "column_stride", lambda *a: 1)
    z = _latent(engine, 19, 23)
    assert (_decode(engine, z, "blend") - _untiled_decode(engine, z)).abs().max().item() <= 1e-4
    pixels = _pictures(152, 184)["smooth"]
    assert (_encode(engine, pixels, "blend") - _untiled_encode(engine, pixels)).abs().max().item() <= 1e-4


def test_blend_leaves_the_module_unchanged(engine):
    vae = engine.parts.vae
    before = copy.deepcopy(vae.state_dict())
    _decode(engine, _latent(engine, 9, 7), "blend")
    assert all(torch.equal(before[k], v) for k, v in vae.state_dict().items())


def test_blend_on_comfyuis_module_tree():
    """The ComfyUI (LDM) module tree takes the same estimate (its convolutions' weights read directly)."""
    from leandiffusion.tests.kit import tiny_components
    from leandiffusion.tests.vae.ldm_tree import FakeComfyVAE, ldm_from_diffusers

    ldm = ldm_from_diffusers(tiny_components("sd1")["vae"])
    z = _latent(tiny_engine("sd1"))
    with torch.no_grad():
        ref = ((ldm.decode(z) + 1) / 2).clamp(0, 1).permute(0, 2, 3, 1)
    (img,) = LeanTiledVAEDecode().decode({"samples": z}, 128, 32, "blend", vae=FakeComfyVAE(ldm))
    error = (img - ref).abs()
    assert error.mean().item() <= DECODE_MEAN and error.max().item() <= DECODE_MAX
    assert error.max().item() > 1e-4

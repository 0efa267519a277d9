"""Tiled VAE Decode / Encode on Z-Image's VAE (issue 42, item 3): a 16-channel ``AutoencoderKL`` with a shift
factor and no quant / post-quant convolutions, built by ``memory.tiny_zimage`` and loaded through the engine.

Guards: nothing in ``vae/`` assumes 4 latent channels or quant convolutions (the programs read the VAE's own
modules); LATENTs are raw VAE latents (ComfyUI's convention: what the encoder emits; no scaling or shift inside the
node), so an ``exact`` decode / encode equals the untiled 16-channel VAE within 1e-4 (fp32, CPU) at non-square sizes
over several tiles, batches included; ``blend`` runs (its accuracy: ``test_blend.py``); a LATENT of the other
family is refused naming the input, both channel counts and the fix.
"""
import pytest
import torch

from leandiffusion.memory.engine import parts_from_components
from leandiffusion.memory.load import build_engine
from leandiffusion.memory.tiny_zimage import FLUX_VAE_SHIFT, build_tiny_zimage
from leandiffusion.nodes.vae import LeanTiledVAEDecode, LeanTiledVAEEncode
from leandiffusion.tests.kit import tiny_engine
from leandiffusion.vae.adapters import decoder_program, encoder_program
from leandiffusion.vae.untiled import vae_decode, vae_encode

TOL = 1e-4


@pytest.fixture(scope="module")
def engine():
    return build_engine(parts_from_components(build_tiny_zimage(), name="tiny-zimage"), "full", device="cpu")


def test_the_vae_is_zimages_and_its_programs_have_no_quant_convolutions(engine):
    vae = engine.parts.vae
    assert vae.config.latent_channels == 16 and vae.config.shift_factor == pytest.approx(FLUX_VAE_SHIFT)
    assert vae.quant_conv is None and vae.post_quant_conv is None
    dec, enc = decoder_program(vae), encoder_program(vae)
    assert dec.latent_channels == dec.in_channels == 16 and dec.factor == 8
    assert [op.module for op in dec.stages[0].ops] == [vae.decoder.conv_in]  # no post_quant_conv before it
    assert enc.latent_channels == 16 and enc.out_channels == 32  # mean and log-variance
    assert enc.stages[-1].ops[-1].module is vae.encoder.conv_out  # no quant_conv after it


def test_exact_decode_equals_the_untiled_vae(engine):
    z = torch.randn(2, 16, 29, 43, generator=torch.Generator().manual_seed(0))  # 232 x 344 px: 2 x 3 tiles of 128
    with engine.session("vae"):
        ref = vae_decode(engine, z)
    with torch.no_grad():
        plain = ((engine.parts.vae.decode(z).sample + 1) / 2).clamp(0, 1).permute(0, 2, 3, 1)
    (img,) = LeanTiledVAEDecode().decode({"samples": z}, 128, 32, "exact", lean_model=engine)
    assert img.shape == ref.shape == (2, 232, 344, 3) and img.dtype == torch.float32
    assert (img - ref).abs().max().item() <= TOL
    assert (img - plain).abs().max().item() <= TOL  # raw latents: no shift or scaling inside the node


def test_exact_encode_equals_the_untiled_vae(engine):
    pixels = torch.rand(2, 236, 350, 3, generator=torch.Generator().manual_seed(1))  # cropped to 232 x 344
    cropped = pixels[:, 2:234, 3:347]
    with engine.session("vae"):
        ref = vae_encode(engine, cropped)
    (lat,) = LeanTiledVAEEncode().encode(pixels, 128, 32, "exact", lean_model=engine)
    assert lat["samples"].shape == ref.shape == (2, 16, 29, 43)
    assert (lat["samples"] - ref).abs().max().item() <= TOL


def test_blend_decode_and_encode_run(engine):
    z = torch.randn(1, 16, 21, 17, generator=torch.Generator().manual_seed(2))
    with engine.session("vae"):
        ref = vae_decode(engine, z)
    (img,) = LeanTiledVAEDecode().decode({"samples": z}, 128, 32, "blend", lean_model=engine)
    assert img.shape == ref.shape and (img - ref).abs().mean().item() <= 0.005
    (lat,) = LeanTiledVAEEncode().encode(img, 128, 32, "blend", lean_model=engine)
    assert lat["samples"].shape == (1, 16, 21, 17) and torch.isfinite(lat["samples"]).all()


def test_an_sd_latent_into_the_zimage_vae_is_refused_by_name(engine):
    with pytest.raises(ValueError, match=r"samples has 4 channels but this VAE takes 16-channel latents \(a "
                                         r"4-channel LATENT comes from SD1\.x / SD2\.x / SDXL models\); decode it "
                                         r"with the VAE of the model that made it, or connect a LATENT made for "
                                         r"this VAE"):
        LeanTiledVAEDecode().decode({"samples": torch.randn(1, 4, 8, 8)}, 0, 64, "exact", lean_model=engine)


def test_a_zimage_latent_into_an_sd_vae_is_refused_by_name():
    with pytest.raises(ValueError, match=r"samples has 16 channels but this VAE takes 4-channel latents \(a "
                                         r"16-channel LATENT comes from Z-Image models"):
        LeanTiledVAEDecode().decode({"samples": torch.randn(1, 16, 8, 8)}, 0, 64, "blend",
                                    lean_model=tiny_engine("sd1"))

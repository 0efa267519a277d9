"""The Tiled VAE nodes on Z-Image's 16-channel VAE (shift factor, no quant convolutions): ``exact`` tiled decode and
encode equal the untiled VAE within 1e-4 (issue contract, fp32 CPU, several tiles at a non-square size), and a
latent of another family is refused by name."""
import pytest
import torch

from leandiffusion.memory.load import TINY_ZIMAGE_CHOICE, load_engine
from leandiffusion.nodes.vae import LeanTiledVAEDecode, LeanTiledVAEEncode


@pytest.fixture(scope="module")
def engine():
    return load_engine(TINY_ZIMAGE_CHOICE, device="cpu")


def test_exact_decode_equals_the_untiled_vae(engine):
    latents = torch.randn(1, 16, 37, 45, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = ((engine.parts.vae.decode(latents).sample.clamp(-1, 1) + 1) / 2).permute(0, 2, 3, 1)
    out = LeanTiledVAEDecode().decode({"samples": latents}, tile_size=128, overlap=32, seam_mode="exact",
                                      lean_model=engine)[0]
    assert out.shape == (1, 296, 360, 3)
    assert (out - ref).abs().max().item() <= 1e-4


def test_exact_encode_equals_the_untiled_vae(engine):
    image = torch.rand(1, 296, 360, 3, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = engine.parts.vae.encode(image.permute(0, 3, 1, 2) * 2 - 1).latent_dist.mean
    out = LeanTiledVAEEncode().encode(image, tile_size=128, overlap=32, seam_mode="exact", lean_model=engine)[0]
    assert out["samples"].shape == (1, 16, 37, 45)
    assert (out["samples"] - ref).abs().max().item() <= 1e-4


def test_an_sd_latent_is_refused(engine):
    with pytest.raises(ValueError, match="samples has 4 channels but this VAE takes 16-channel latents"):
        LeanTiledVAEDecode().decode({"samples": torch.zeros(1, 4, 8, 8)}, lean_model=engine)

"""Our nodes take what ComfyUI's core nodes hand them, as the core nodes would.

ComfyUI 0.3.64 ``VAEEncode.encode`` encodes ``pixels[:, :, :, :3]``: an RGBA IMAGE (e.g. from core "Join Image
with Alpha") encodes as its RGB part. Bug guarded: Tiled VAE Encode refused a 4-channel IMAGE that core VAE Encode
accepts, so swapping the core node for ours broke the graph. The reference is the diffusers VAE's own untiled
encode (``latent_dist.mean``) of the RGB channels, independent of the tiled code.
"""
import pytest
import torch

from leandiffusion.nodes.vae import LeanTiledVAEEncode
from leandiffusion.tests.kit import tiny_engine


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("sd1")


def _reference_mean(engine, rgb: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return engine.parts.vae.encode(rgb.permute(0, 3, 1, 2) * 2 - 1).latent_dist.mean


@pytest.mark.parametrize("seam_mode", ["exact", "blend"])
def test_rgba_image_encodes_as_its_rgb_like_core_vae_encode(engine, seam_mode, strict_fp32):
    g = torch.Generator().manual_seed(3)
    rgba = torch.rand(2, 48, 40, 4, generator=g)
    rgba[..., 3] = torch.rand(2, 48, 40, generator=g)  # an alpha that would change the latent if it leaked in
    before = rgba.clone()
    latent = LeanTiledVAEEncode().encode(rgba, 0, 64, seam_mode, lean_model=engine)[0]["samples"]
    ref = _reference_mean(engine, rgba[..., :3])
    assert latent.shape == ref.shape == (2, 4, 6, 5)
    assert (latent - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())
    assert torch.equal(rgba, before)  # ComfyUI caches the upstream IMAGE: never modified


def test_one_channel_image_is_refused_naming_the_input(engine):
    with pytest.raises(ValueError, match="pixels"):
        LeanTiledVAEEncode().encode(torch.rand(1, 32, 32, 1), 0, 64, "exact", lean_model=engine)

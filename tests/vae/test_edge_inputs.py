"""Valid-but-unusual inputs for the tiled VAE: autoencoders whose compression factor is not 8, RGBA images.

Guards: an ``AutoencoderKL`` with 3 levels (4x, the layout of SD's x4-upscaler VAE) or 5 levels (16x) used to
crash deep inside torch ("The expanded size of the tensor (40) must match ...") because ``tiled.py`` assumed 8x
everywhere, although the exact executor itself is generic. The reference is diffusers' own untiled
``decode``/``encode`` of the same module in float64 (independent of the code under test); tolerances are the fp32
rounding of the tiny VAE (the package's own exact-mode bound, 1e-4, on outputs of order 1).
An RGBA IMAGE used to be refused by Tiled VAE Encode although ComfyUI's VAE Encode takes it (it drops alpha).
"""
import copy

import pytest
import torch

from leandiffusion.vae.targets import from_module
from leandiffusion.vae.tiled import tiled_decode, tiled_encode

TOL = 1e-4


def _vae(levels: int):
    from diffusers import AutoencoderKL

    gen_state = torch.random.get_rng_state()
    torch.manual_seed(levels)
    try:
        vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(32,) * levels,
                            layers_per_block=1, norm_num_groups=32,
                            down_block_types=("DownEncoderBlock2D",) * levels,
                            up_block_types=("UpDecoderBlock2D",) * levels)
    finally:
        torch.random.set_rng_state(gen_state)
    return vae.eval().requires_grad_(False)


def _ref_decode(vae, z):
    v = copy.deepcopy(vae).double()
    with torch.no_grad():
        return ((v.decode(z.double()).sample + 1) / 2).clamp(0, 1).permute(0, 2, 3, 1).float()


def _ref_encode(vae, pixels):
    v = copy.deepcopy(vae).double()
    with torch.no_grad():
        return v.encode(pixels.permute(0, 3, 1, 2).double() * 2 - 1).latent_dist.mean.float()


@pytest.mark.parametrize("levels,factor", [(3, 4), (5, 16)])
def test_decode_vae_with_other_compression_factor(levels, factor):
    vae = _vae(levels)
    z = torch.randn(2, 4, 11, 7, generator=torch.Generator().manual_seed(1))
    ref = _ref_decode(vae, z)
    assert ref.shape == (2, 11 * factor, 7 * factor, 3)
    exact = tiled_decode(from_module(vae), z, tile_size=128, overlap=32, seam_mode="exact", quiet=True)
    assert exact.shape == ref.shape
    assert (exact - ref).abs().max().item() <= TOL
    # blend with one tile covering the image is the untiled decode; with several it must at least be the same size
    whole = tiled_decode(from_module(vae), z, tile_size=4096, overlap=32, seam_mode="blend", quiet=True)
    assert (whole - ref).abs().max().item() <= TOL
    tiles = tiled_decode(from_module(vae), z, tile_size=128, overlap=32, seam_mode="blend", quiet=True)
    assert tiles.shape == ref.shape


@pytest.mark.parametrize("levels,factor", [(3, 4), (5, 16)])
def test_encode_vae_with_other_compression_factor(levels, factor):
    vae = _vae(levels)
    pixels = torch.rand(1, 150, 101, 3, generator=torch.Generator().manual_seed(2))
    h, w = 150 // factor * factor, 101 // factor * factor  # centre crop to the VAE's own factor
    oy, ox = (150 - h) // 2, (101 - w) // 2
    ref = _ref_encode(vae, pixels[:, oy:oy + h, ox:ox + w])
    exact = tiled_encode(from_module(vae), pixels, tile_size=128, overlap=32, seam_mode="exact", quiet=True)
    assert exact.shape == ref.shape == (1, 4, h // factor, w // factor)
    assert (exact - ref).abs().max().item() <= TOL
    whole = tiled_encode(from_module(vae), pixels, tile_size=4096, overlap=32, seam_mode="blend", quiet=True)
    assert (whole - ref).abs().max().item() <= TOL
    tiles = tiled_encode(from_module(vae), pixels, tile_size=128, overlap=32, seam_mode="blend", quiet=True)
    assert tiles.shape == ref.shape


def test_encode_image_smaller_than_the_factor_is_a_clear_error():
    with pytest.raises(ValueError, match=r"pixels: image 20x12 is smaller than 16x16 px"):
        tiled_encode(from_module(_vae(5)), torch.rand(1, 12, 20, 3), 128, 32, "exact", quiet=True)


def test_encode_rgba_image_drops_alpha_as_comfyui_does():
    """ComfyUI's VAE Encode encodes ``pixels[:, :, :, :3]``; an RGBA IMAGE used to be refused here."""
    vae = _vae(3)
    rgba = torch.rand(1, 40, 24, 4, generator=torch.Generator().manual_seed(4))
    ref = _ref_encode(vae, rgba[..., :3])
    for mode in ("exact", "blend"):
        lat = tiled_encode(from_module(vae), rgba, 128, 32, mode, quiet=True)
        assert (lat - ref).abs().max().item() <= TOL


def test_encode_grayscale_is_a_clear_error():
    with pytest.raises(ValueError, match=r"pixels: expected an IMAGE \[B, H, W, 3\].*1 channel"):
        tiled_encode(from_module(_vae(3)), torch.rand(1, 40, 24, 1), 128, 32, "exact", quiet=True)


@pytest.mark.parametrize("pixels,error,match", [
    # 8-bit values would have been encoded as if they were 0..255 floats: a silently wrong latent
    (torch.zeros(1, 40, 24, 3, dtype=torch.uint8), TypeError, r"pixels: .*float tensor.*torch.uint8"),
    ([[0.5]], TypeError, r"pixels: .*got list"),
    # channels-first [B, 3, H, W] used to be read as a 3-pixel-high image ("image 24x3 is smaller than ...")
    (torch.rand(1, 3, 40, 24), ValueError, r"pixels: .*shape \(1, 3, 40, 24\) \(24 channel\(s\); channels first\?\)"),
    # 16 channels used to be cut to the first 3 and encoded
    (torch.rand(1, 40, 24, 16), ValueError, r"pixels: .*16 channel\(s\)\)"),
    (torch.rand(40, 24, 3), ValueError, r"pixels: .*shape \(40, 24, 3\)"),
])
def test_encode_refuses_what_is_not_an_image(pixels, error, match):
    with pytest.raises(error, match=match):
        tiled_encode(from_module(_vae(3)), pixels, 128, 32, "exact", quiet=True)

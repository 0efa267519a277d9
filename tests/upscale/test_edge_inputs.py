"""Valid-but-unusual inputs for the ESRGAN runner.

Guards: an architecture that needs its input sides to be multiples of ``multiple_of`` (spandrel's DRCT: 16,
SAFMN: 8, FFTformer: 32, ...) must not crash inside torch ("Padding size should be less than the corresponding
input dimension") on an image whose side is shorter than the padding it needs, as reflection padding alone does.
spandrel itself (what ComfyUI's own upscale node runs) reflects up to ``side - 1`` rows and replicates the rest;
the reference below is written from that rule in plain torch, and the network forward is the independent
functional reference of ``helpers``. Also: an image with a side under the model's smallest accepted side (1 px
wide) is padded as spandrel pads it, not refused; an RGBA image keeps its alpha (resized alongside) instead of
being refused.
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


def test_ema_weights_are_preferred_over_the_raw_ones(tmp_path):
    """BasicSR / Real-ESRGAN checkpoints carry both ``params`` (raw) and ``params_ema`` (the averaged weights the
    release is meant to run with, what spandrel picks too): the EMA set must be the one loaded."""
    path = tmp_path / "model.pth"
    torch.save({"params": H.random_rrdb(num_block=1, n_up=1, seed=9), "params_ema": _SD}, path)
    img = torch.rand(1, 13, 11, 3, generator=torch.Generator().manual_seed(3))
    out = upscale_images(load_upscaler(path), img, device="cpu", quiet=True)
    ref = H.ref_rrdb(_SD, img.permute(0, 3, 1, 2)).clamp(0, 1).permute(0, 2, 3, 1)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_a_prefix_only_some_keys_carry_is_kept(tmp_path):
    """``module.`` / ``netG.`` are removed only when every key carries them; a file where only some do keeps its
    key names as they are (cutting the first 7 characters off every key would invent names)."""
    from leandiffusion.upscale.loader import read_state_dict

    path = tmp_path / "model.pth"
    t = torch.zeros(2)
    torch.save({"module.conv_first.weight": t, "conv_last.weight": t, "netG.x": t}, path)
    sd, _ = read_state_dict(path)
    assert sorted(sd) == ["conv_last.weight", "module.conv_first.weight", "netG.x"]


def test_an_empty_ema_container_falls_through_to_the_raw_weights(tmp_path):
    """A trainer run without EMA can leave ``params_ema`` empty beside real ``params``: the empty container is
    skipped, not taken (which refused the file as holding no tensors)."""
    path = tmp_path / "model.pth"
    torch.save({"params_ema": {}, "params": _SD}, path)
    img = torch.rand(1, 13, 11, 3, generator=torch.Generator().manual_seed(3))
    out = upscale_images(load_upscaler(path), img, device="cpu", quiet=True)
    ref = H.ref_rrdb(_SD, img.permute(0, 3, 1, 2)).clamp(0, 1).permute(0, 2, 3, 1)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def _fake_spandrel(monkeypatch, minimum=1, multiple_of=1, square=False):
    """A stand-in for spandrel (not installed in the CPU test environment) whose loader returns an image-model
    descriptor with the given ``SizeRequirements`` (spandrel 0.4's attribute names)."""
    import sys
    import types

    fake = types.ModuleType("spandrel")
    fake.UnsupportedModelError = type("UnsupportedModelError", (Exception,), {})

    class ImageModelDescriptor:
        def __init__(self):
            self.model = nn.Conv2d(3, 3, 1)
            self.architecture = types.SimpleNamespace(name="FakeNet")
            self.scale, self.input_channels, self.output_channels, self.tags = 1, 3, 3, ["fake"]
            self.supports_half = self.supports_bfloat16 = True
            self.size_requirements = types.SimpleNamespace(minimum=minimum, multiple_of=multiple_of, square=square)

    class ModelLoader:
        def load_from_state_dict(self, sd):
            return ImageModelDescriptor()

    fake.ImageModelDescriptor, fake.ModelLoader = ImageModelDescriptor, ModelLoader
    monkeypatch.setitem(sys.modules, "spandrel", fake)


def test_spandrels_size_requirements_reach_the_runner(monkeypatch):
    """An architecture spandrel loads keeps its smallest side and alignment (RealCUGAN / SCUNet minimums, DRCT's
    multiple of 16): the runner pads and tiles by them."""
    from leandiffusion.upscale.loader import build_upscaler

    _fake_spandrel(monkeypatch, minimum=40, multiple_of=16)
    up = build_upscaler({"head.weight": torch.zeros(3, 3, 1, 1)}, source="x.pth")
    assert (up.arch, up.min_size, up.multiple_of) == ("spandrel:FakeNet", 40, 16)


def test_a_spandrel_model_that_needs_square_inputs_is_refused_by_name(monkeypatch):
    from leandiffusion.upscale.loader import build_upscaler

    _fake_spandrel(monkeypatch, square=True)
    with pytest.raises(ValueError, match=r"x.pth: FakeNet needs square inputs, which tiling cannot promise"):
        build_upscaler({"head.weight": torch.zeros(3, 3, 1, 1)}, source="x.pth")


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


def _spandrel_pad_min(x: torch.Tensor, minimum: int, m: int) -> torch.Tensor:
    """spandrel's ``pad_tensor`` for ``SizeRequirements(minimum, multiple_of=m)`` (what ComfyUI's own upscale node
    runs): each side grows to ``max(side, minimum)`` rounded up to a multiple of ``m``, by reflection up to
    ``side - 1`` rows, then by replication."""
    h, w = x.shape[-2:]
    ph, pw = -(-max(h, minimum) // m) * m - h, -(-max(w, minimum) // m) * m - w
    rh, rw = min(ph, h - 1), min(pw, w - 1)
    x = F.pad(x, (0, rw, 0, rh), mode="reflect")
    return F.pad(x, (0, pw - rw, 0, ph - rh), mode="replicate")


_RRDB = H.random_rrdb(num_block=1, n_up=1)
_RRDB_X1 = H.random_rrdb(num_block=1, n_up=2, unshuffle=4)
_COMPACT = H.random_compact(num_conv=2, scale=2)


@pytest.mark.parametrize("kind,h,w", [("rrdb", 1, 40), ("rrdb", 40, 1), ("rrdb", 1, 1), ("rrdb_x1", 3, 9),
                                      ("rrdb_x1", 1, 6), ("minimum16", 5, 23), ("minimum16", 1, 1)])
def test_image_under_the_models_smallest_side_is_padded_as_comfyui_does(kind, h, w):
    """A 1 px wide image (or any side under the model's minimum: ESRGAN 2, Real-ESRGAN x1 4, SwinIR/HAT/DAT 16 in
    spandrel) was refused ("smaller than the 2x2 px ESRGAN accepts; enlarge it first"), while ComfyUI's own
    ImageUpscaleWithModel upscales it: spandrel pads to the minimum and crops the output. Now padded the same way."""
    if kind == "minimum16":  # a spandrel-style architecture with SizeRequirements(minimum=16)
        up = Upscaler(build_upscaler(_COMPACT).module, "spandrel:minimum", 2, min_size=16)
        ref_net, scale, minimum, m = (lambda x: H.ref_compact(_COMPACT, x)), 2, 16, 1
    elif kind == "rrdb":
        up = build_upscaler(_RRDB)
        ref_net, scale, minimum, m = (lambda x: H.ref_rrdb(_RRDB, x)), 2, 2, 1  # spandrel: ESRGAN minimum 2
    else:
        up = build_upscaler(_RRDB_X1)
        ref_net, scale, minimum, m = (lambda x: H.ref_rrdb(_RRDB_X1, x, 4)), 1, 4, 4
    assert (up.min_size, up.multiple_of) == (minimum, m)
    img = torch.rand(2, h, w, 3, generator=torch.Generator().manual_seed(h * 31 + w))
    out = upscale_images(up, img, device="cpu", quiet=True)
    assert out.shape == (2, h * scale, w * scale, 3)
    ref = ref_net(_spandrel_pad_min(img.permute(0, 3, 1, 2), minimum, m))[..., : h * scale, : w * scale]
    # fp32 rounding of small nets is ~1e-7; another padding (zeros, or none) moves these pixels by O(0.1)
    torch.testing.assert_close(out, ref.clamp(0, 1).permute(0, 2, 3, 1), atol=1e-5, rtol=0)


def _alpha_ref(alpha: torch.Tensor, size) -> torch.Tensor:
    """The alpha channel [B, H, W, 1] resized as realesrgan-ncnn-vulkan does (bicubic), antialiased like the
    node's output_scale; plain torch, not the runner's helper."""
    a = alpha.permute(0, 3, 1, 2)
    if tuple(a.shape[-2:]) != tuple(size):
        a = F.interpolate(a, size=size, mode="bicubic", align_corners=False, antialias=True).clamp(0, 1)
    return a.permute(0, 2, 3, 1)


@pytest.mark.parametrize("sd,output_scale,tile", [(_COMPACT, 0.0, 0), (_COMPACT, 0.0, 32), (_COMPACT, 1.5, 0),
                                                   (_RRDB_X1, 0.0, 0)], ids=["x2", "x2-tiled", "x2-to-1.5", "x1"])
def test_rgba_image_keeps_its_alpha(sd, output_scale, tile):
    """An RGBA IMAGE (core JoinImageWithAlpha) was refused ("image has 4 channels, ... drop the alpha channel"),
    and ComfyUI's own upscale node fails on it inside a convolution. Now the colour runs through the model exactly
    as the RGB image does, and the alpha is resized alongside (bicubic, as realesrgan-ncnn-vulkan does)."""
    up = build_upscaler(sd)
    rgba = torch.rand(2, 37, 45, 4, generator=torch.Generator().manual_seed(5))
    before = rgba.clone()
    out = upscale_images(up, rgba, output_scale=output_scale, device="cpu", tile_size=tile, tile_overlap=8,
                         quiet=True)
    rgb = upscale_images(up, rgba[..., :3].contiguous(), output_scale=output_scale, device="cpu", tile_size=tile,
                         tile_overlap=8, quiet=True)
    assert out.shape == rgb.shape[:3] + (4,)
    assert torch.equal(out[..., :3], rgb)
    torch.testing.assert_close(out[..., 3:], _alpha_ref(rgba[..., 3:], rgb.shape[1:3]), atol=1e-6, rtol=0)
    assert torch.equal(rgba, before)


def test_four_channel_model_takes_rgba_as_is():
    """A model trained on 4 channels (spandrel loads such ESRGAN files) gets all four; nothing is split off."""
    sd = H.random_compact(num_conv=1, scale=2, in_ch=4)
    up = build_upscaler(sd)
    assert (up.in_channels, up.out_channels) == (4, 4)
    img = torch.rand(1, 11, 13, 4, generator=torch.Generator().manual_seed(2))
    out = upscale_images(up, img, device="cpu", quiet=True)
    ref = H.ref_compact(sd, img.permute(0, 3, 1, 2)).clamp(0, 1).permute(0, 2, 3, 1)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)

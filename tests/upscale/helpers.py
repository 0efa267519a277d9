"""Independent plain references for the upscale tests, written from the published equations (not from the
package's modules): random state dicts in each key naming, and functional forwards with explicit concatenation.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...bench.upscale_weights import random_compact, random_rrdb  # noqa: F401  (random state dicts, canonical keys)


def to_original_keys(sd: dict, n_up: int) -> dict:
    """ESRGAN's original flat-Sequential naming, written from the original layout."""
    num_block = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("body."))
    out = {}
    for k, v in sd.items():
        p = k.rsplit(".", 1)[1]
        if k.startswith("conv_first."):
            out[f"model.0.{p}"] = v
        elif k.startswith("body."):
            _, b, r, c, p = k.split(".")
            out[f"model.1.sub.{b}.RDB{r[3:]}.conv{c[4:]}.0.{p}"] = v
        elif k.startswith("conv_body."):
            out[f"model.1.sub.{num_block}.{p}"] = v
        elif k.startswith("conv_up"):
            out[f"model.{3 * int(k.split('.')[0][7:])}.{p}"] = v
        elif k.startswith("conv_hr."):
            out[f"model.{3 * n_up + 2}.{p}"] = v
        elif k.startswith("conv_last."):
            out[f"model.{3 * n_up + 4}.{p}"] = v
    return out


def to_bsrgan_keys(sd: dict) -> dict:
    out = {}
    for k, v in sd.items():
        if k.startswith("body."):
            _, b, r, rest = k.split(".", 3)
            out[f"RRDB_trunk.{b}.RDB{r[3:]}.{rest}"] = v
        elif k.startswith("conv_body."):
            out[k.replace("conv_body.", "trunk_conv.")] = v
        elif k.startswith("conv_up"):
            out[k.replace("conv_up", "upconv")] = v
        elif k.startswith("conv_hr."):
            out[k.replace("conv_hr.", "HRconv.")] = v
        else:
            out[k] = v
    return out


def _c(sd, key, x):
    return F.conv2d(x, sd[f"{key}.weight"].float(), sd[f"{key}.bias"].float(), padding=1)


def ref_rrdb(sd: dict, x: torch.Tensor, unshuffle: int = 1) -> torch.Tensor:
    """RRDBNet forward with torch.cat, from Wang et al. (ESRGAN) / Real-ESRGAN; canonical keys."""
    lrelu = lambda t: F.leaky_relu(t, 0.2)
    h, w = x.shape[-2:]
    if unshuffle > 1:
        x = F.pad(x, (0, (-w) % unshuffle, 0, (-h) % unshuffle), mode="reflect")
        x = F.pixel_unshuffle(x, unshuffle)
    fea = _c(sd, "conv_first", x)
    num_block = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("body."))
    t = fea
    for b in range(num_block):
        z = t
        for r in (1, 2, 3):
            pre = f"body.{b}.rdb{r}"
            feats = [z]
            for c in range(1, 5):
                feats.append(lrelu(_c(sd, f"{pre}.conv{c}", torch.cat(feats, 1))))
            z = _c(sd, f"{pre}.conv5", torch.cat(feats, 1)) * 0.2 + z
        t = z * 0.2 + t
    t = fea + _c(sd, "conv_body", t)
    n_up = sum(1 for k in sd if k.startswith("conv_up") and k.endswith(".weight"))
    for i in range(1, n_up + 1):
        t = lrelu(_c(sd, f"conv_up{i}", F.interpolate(t, scale_factor=2, mode="nearest")))
    out = _c(sd, "conv_last", lrelu(_c(sd, "conv_hr", t)))
    s = 2 ** n_up // unshuffle
    return out[..., : h * s, : w * s]


def ref_compact(sd: dict, x: torch.Tensor) -> torch.Tensor:
    """SRVGGNetCompact forward: PReLU convs, pixel shuffle, plus the nearest-upsampled input."""
    last = max(int(k.split(".")[1]) for k in sd)
    t = x
    for i in range(0, last, 2):
        t = F.prelu(_c(sd, f"body.{i}", t), sd[f"body.{i + 1}.weight"].float())
    t = _c(sd, f"body.{last}", t)
    s = int(round((t.shape[1] / x.shape[1]) ** 0.5))
    return F.pixel_shuffle(t, s) + F.interpolate(x, scale_factor=s, mode="nearest")


def import_spandrel():
    """(spandrel module or None, reason it is missing)."""
    try:
        import spandrel
    except (ImportError, RuntimeError, OSError) as exc:
        return None, (f"spandrel does not import here ({type(exc).__name__}: {exc}); this runs inside ComfyUI's "
                      f"environment, where spandrel and torchvision work")
    return spandrel, ""


class NearestX4(torch.nn.Module):
    """A pointwise x4 model (receptive field 0): every tile of it computes exactly what the whole image does, so any
    difference between a tiled and an untiled run is the blend's own rounding."""

    def forward(self, x):
        return F.interpolate(x, scale_factor=4, mode="nearest")


def nearest_x4_reference(img: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, H, W, C] -> the nearest x4 upsampling of ``img`` rounded to ``dtype``, as one piece, back in fp32."""
    return F.interpolate(img.permute(0, 3, 1, 2).to(dtype), scale_factor=4, mode="nearest").float().permute(0, 2, 3, 1)


def random_image(b: int, h: int, w: int, seed: int = 0) -> torch.Tensor:
    """A [b, h, w, 3] ComfyUI IMAGE of uniform random values in 0..1."""
    return torch.rand(b, h, w, 3, generator=torch.Generator().manual_seed(seed))

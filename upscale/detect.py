"""Declarative architecture detection: a state dict's keys pick an entry, its tensor shapes give the hyperparameters.

Invariant: detection never looks at file names or class names. Each ``ArchEntry`` holds a key rule (the
``memory.keyrules`` language: all-of / none-of over key names) and a builder that renames the keys to the canonical
naming of ``arch_rrdb`` / ``arch_compact``, reads every hyperparameter from tensor shapes and loads the weights
strictly (a key too many or too few is an error, never a silently random layer). Modules are built on the meta
device, so building one never touches torch's global random generator. The first matching entry wins, so entries
are ordered from most to least specific.

Key namings handled for RRDBNet:
- Real-ESRGAN / BasicSR: ``conv_first``, ``body.{i}.rdb{j}.conv{k}``, ``conv_body``, ``conv_up{n}``, ``conv_hr``,
  ``conv_last`` (canonical);
- BSRGAN / RealSR: ``RRDB_trunk.{i}.RDB{j}.conv{k}``, ``trunk_conv``, ``upconv{n}``, ``HRconv``;
- original ESRGAN (a flat ``nn.Sequential`` called ``model``): ``model.0`` conv_first,
  ``model.1.sub.{i}.RDB{j}.conv{k}.0`` the blocks, ``model.1.sub.{B}`` conv_body, then per upsampling level n
  ``model.{3n}`` (after an Upsample at 3n-1 and followed by a LeakyReLU at 3n+1), ``model.{3N+2}`` conv_hr and
  ``model.{3N+4}`` conv_last.
Pixel-unshuffle variants (Real-ESRGAN x2 / x1) are recognised by ``in_channels == out_channels * u**2``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from ..memory.keyrules import AllOf, all_of, first_match, none_of, shapes_of
from .arch_compact import SRVGGNetCompact
from .arch_rrdb import TAIL_HALO, RRDBNet
from .descriptor import Upscaler

StateDict = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class ArchEntry:
    name: str
    rule: AllOf
    build: Callable[[StateDict], Upscaler]


# --------------------------------------------------------------------------------------------- RRDB renames
def _rename_bsrgan(sd: StateDict) -> dict:
    out = {}
    for key, value in sd.items():
        new = re.sub(r"^RRDB_trunk\.(\d+)\.RDB(\d)\.", r"body.\1.rdb\2.", key)
        new = re.sub(r"^trunk_conv\.", "conv_body.", new)
        new = re.sub(r"^upconv(\d+)\.", r"conv_up\1.", new)
        new = re.sub(r"^HRconv\.", "conv_hr.", new)
        out[new] = value
    return out


def _rename_original(sd: StateDict) -> dict:
    blocks = {int(m.group(1)) for k in sd if (m := re.match(r"^model\.1\.sub\.(\d+)\.RDB", k))}
    num_block = max(blocks) + 1
    top = sorted({int(m.group(1)) for k in sd if (m := re.match(r"^model\.(\d+)\.(weight|bias)$", k))} - {0})
    n_up = (top[-1] - 4) // 3 if top else -1
    expected = [3 * i for i in range(1, n_up + 1)] + [3 * n_up + 2, 3 * n_up + 4]
    if n_up < 0 or top != expected:
        raise ValueError(f"original-ESRGAN state dict: top-level layers model.{top} do not follow the ESRGAN "
                         f"layout model.[3, 6, ..., 3N, 3N+2, 3N+4]; the file is not a plain ESRGAN model")
    names = {3 * i: f"conv_up{i}" for i in range(1, n_up + 1)}
    names[3 * n_up + 2] = "conv_hr"
    names[3 * n_up + 4] = "conv_last"
    names[0] = "conv_first"
    out = {}
    for key, value in sd.items():
        if m := re.match(r"^model\.1\.sub\.(\d+)\.RDB(\d)\.conv(\d)\.0\.(weight|bias)$", key):
            out[f"body.{m.group(1)}.rdb{m.group(2)}.conv{m.group(3)}.{m.group(4)}"] = value
        elif m := re.match(rf"^model\.1\.sub\.{num_block}\.(weight|bias)$", key):
            out[f"conv_body.{m.group(1)}"] = value
        elif (m := re.match(r"^model\.(\d+)\.(weight|bias)$", key)) and int(m.group(1)) in names:
            out[f"{names[int(m.group(1))]}.{m.group(2)}"] = value
        else:
            out[key] = value  # left as is: the strict load below reports it
    return out


def _construct(cls: type, *args) -> torch.nn.Module:
    """``cls(*args)`` built on the meta device and given empty CPU storage: no random initialisation, so building
    an upscaler neither draws from nor advances torch's global generator (ComfyUI users rely on seeds that the
    next node draws) and costs no init time; every tensor is then written by ``_load_strict``."""
    with torch.device("meta"):
        module = cls(*args)
    return module.to_empty(device="cpu")


def _load_strict(module: torch.nn.Module, sd: StateDict, arch: str) -> None:
    try:
        result = module.load_state_dict(dict(sd), strict=False)
    except RuntimeError as exc:  # PyTorch reports tensor shape mismatches as RuntimeError
        raise ValueError(f"{arch}: tensor shapes do not fit the detected architecture ({exc}); the file is "
                         f"damaged or holds a variant this loader does not know") from exc
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(f"{arch}: the state dict does not fit the detected architecture; missing keys "
                         f"{result.missing_keys[:5]}, unexpected keys {result.unexpected_keys[:5]}")


def _shape(sd: StateDict, key: str, ndim: int) -> tuple:
    t = sd.get(key)
    if not isinstance(t, torch.Tensor) or t.ndim != ndim:
        raise ValueError(f"key {key!r}: expected a {ndim}-D tensor, got "
                         f"{None if t is None else tuple(getattr(t, 'shape', ()))}")
    return tuple(t.shape)


def _rrdb_call(module: torch.nn.Module, x: torch.Tensor, work_bytes: int) -> torch.Tensor:
    """Run the tail in row strips whose two live 4x-resolution maps take at most half of the body's peak.

    Body peak per low-resolution pixel (channels, concatenation path): ``4F + 8G`` (see ``arch_rrdb``); one tail
    row costs ``2 * F * up**2`` channels per low-resolution column. Keeping the tail at <= half the body peak
    (and <= ``work_bytes``) makes the body the peak of the whole window; the strip halos cost
    ``2 * TAIL_HALO / rows`` extra tail work (under 3% of the tail, itself under 10% of the FLOPs).
    """
    u, up = module.unshuffle, 2 ** module.num_upsample
    feat = module.conv_first.out_channels
    grow = module.body[0].rdb1.num_grow_ch if len(module.body) else 0
    height_lr, width_lr = -(-x.shape[-2] // u), -(-x.shape[-1] // u)
    b = x.element_size()
    per_row = 2 * feat * up * up * width_lr * b
    body_peak = (4 * feat + 8 * grow) * height_lr * width_lr * b
    budget = min(work_bytes, body_peak // 2)
    rows = max(8, budget // max(per_row, 1) - 2 * TAIL_HALO)
    return module(x, tail_rows=int(rows))


def build_rrdb(sd: StateDict) -> Upscaler:
    """RRDBNet from a canonical-key state dict (Real-ESRGAN naming)."""
    feat, cin = _shape(sd, "conv_first.weight", 4)[:2]
    cout = _shape(sd, "conv_last.weight", 4)[0]
    grow = _shape(sd, "body.0.rdb1.conv1.weight", 4)[0]
    num_block = 1 + max(int(m.group(1)) for k in sd if (m := re.match(r"^body\.(\d+)\.rdb1\.conv1\.weight$", k)))
    n_up = sum(1 for k in sd if re.match(r"^conv_up\d+\.weight$", k))
    unshuffle = 1
    for u in (2, 4):
        if cin == cout * u * u:
            unshuffle = u
    if 2 ** n_up < unshuffle:
        raise ValueError(f"RRDBNet with {n_up} upsampling layers and pixel-unshuffle {unshuffle} would downscale")
    model = _construct(RRDBNet, cin // unshuffle ** 2, cout, feat, num_block, grow, n_up, unshuffle)
    _load_strict(model, sd, "RRDBNet")
    scale = model.scale
    tags = (f"{feat}nf", f"{num_block}nb", f"x{scale}") + (("unshuffle",) if unshuffle > 1 else ())
    return Upscaler(model.eval(), "ESRGAN", scale, cin // unshuffle ** 2, cout, min_size=max(2, unshuffle),
                    multiple_of=unshuffle, context=None, bytes_per_px=(4 * feat + 8 * grow) / unshuffle ** 2,
                    call=_rrdb_call, tags=tags, channels_last=True)


def build_compact(sd: StateDict) -> Upscaler:
    """SRVGGNetCompact from ``body.{i}`` keys; PReLU weights sit at the odd indices."""
    indices = sorted({int(m.group(1)) for k in sd if (m := re.match(r"^body\.(\d+)\.weight$", k))})
    last = indices[-1]
    if last < 2 or last % 2:
        raise ValueError(f"SRVGGNetCompact: last body index {last} should be even (conv, prelu, ..., conv)")
    feat, cin = _shape(sd, "body.0.weight", 4)[:2]
    _shape(sd, "body.1.weight", 1)
    last_out = _shape(sd, f"body.{last}.weight", 4)[0]
    scale = int(round((last_out / cin) ** 0.5))
    if scale * scale * cin != last_out:
        raise ValueError(f"SRVGGNetCompact: last conv has {last_out} outputs, not {cin} x a square scale")
    num_conv = (last - 2) // 2
    model = _construct(SRVGGNetCompact, cin, cin, feat, num_conv, scale)
    _load_strict(model, sd, "SRVGGNetCompact")
    return Upscaler(model.eval(), "SRVGGNetCompact", scale, cin, cin, min_size=1, multiple_of=1,
                    context=num_conv + 2, bytes_per_px=2 * feat + 3 * cin * scale * scale,
                    tags=(f"{feat}nf", f"{num_conv}nc", f"x{scale}"), channels_last=True)


REGISTRY: tuple[ArchEntry, ...] = (
    ArchEntry("ESRGAN (Real-ESRGAN keys)",
              all_of("conv_first.weight", "body.0.rdb1.conv1.weight", "conv_body.weight", "conv_hr.weight",
                     "conv_last.weight"),
              build_rrdb),
    ArchEntry("ESRGAN (BSRGAN/RealSR keys)",
              all_of("conv_first.weight", "RRDB_trunk.0.RDB1.conv1.weight", "trunk_conv.weight", "HRconv.weight",
                     "conv_last.weight"),
              lambda sd: build_rrdb(_rename_bsrgan(sd))),
    ArchEntry("ESRGAN (original keys)",
              all_of("model.0.weight", "model.1.sub.0.RDB1.conv1.0.weight",
                     none_of("model.1.sub.0.RDB1.conv1x1.weight")),  # ESRGAN+ has extra 1x1 convs
              lambda sd: build_rrdb(_rename_original(sd))),
    ArchEntry("SRVGGNetCompact",
              all_of("body.0.weight", "body.1.weight", none_of("body.0.rdb1.conv1.weight")),
              build_compact),
)


def detect(sd: StateDict) -> ArchEntry | None:
    """The first registry entry whose rule the keys of ``sd`` satisfy, else ``None``."""
    return first_match(REGISTRY, shapes_of(sd))

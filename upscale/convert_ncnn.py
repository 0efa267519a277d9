"""Convert an ncnn ``.param`` / ``.bin`` upscaler (RRDBNet or SRVGGNetCompact) into a ``.safetensors`` state dict.

Usage: ``python -m leandiffusion.upscale.convert_ncnn SRC.param OUT.safetensors [--bin SRC.bin] [--dtype keep]``

Hand-written because no maintained Python library reads ncnn weights into torch tensors without building ncnn
itself (pnnx converts the other way). The formats, from ncnn's ``src/net.cpp`` / ``src/modelbin.cpp``:

``.param`` (text): magic ``7767517``; ``layer_count blob_count``; then one line per layer:
``Type Name n_in n_out in_blob... out_blob... k=v ...`` where ``k < -23300`` marks an array ``-23300-k=n,v1..vn``.

``.bin``: the layers' weights concatenated in layer order, no header. ``Convolution`` stores its weight
(``6=weight_data_size`` values, laid out [out, in, kh, kw] as in torch) through ``ModelBin::load(w, 0)``, which
starts with a 4-byte little-endian tag: ``0x01306B47`` fp16 follows (``w*2`` bytes padded to 4), ``0`` raw fp32
follows; then (when ``5=1``) its bias as raw fp32 (``load(w, 1)``, no tag). ``PReLU`` stores ``0=num_slope``
raw fp32 slopes. Every other layer these networks use (Input, Split, Concat, Eltwise, BinaryOp, Interp,
PixelShuffle) holds no weights.

Mapping invariant: weighted layers appear in the ``.param`` in the network's forward order (onnx2ncnn keeps the
traced order), so they are assigned to canonical keys in order, and the result is validated by the strict,
shape-checked load of ``detect.build_*`` plus structural checks (activation kinds, residual coefficients);
a graph that fits neither network is refused, never half-converted. The output file is written atomically.
"""
from __future__ import annotations

import argparse
import logging
import os
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from .detect import build_compact, build_rrdb
from .loader import OUTPUT_SCALE_KEY

logger = logging.getLogger(__name__)

MAGIC = 7767517
TAG_FP16 = 0x01306B47
TAG_INT8 = 0x000D4B38
TAG_FP32_SCALED = 0x0002C056
WEIGHTLESS = {"Input", "Split", "Concat", "Eltwise", "BinaryOp", "Interp", "PixelShuffle", "ReLU", "Noop"}
WEIGHTED = {"Convolution", "PReLU"}


@dataclass
class Layer:
    type: str
    name: str
    bottoms: list
    tops: list
    params: dict = field(default_factory=dict)
    blobs: dict = field(default_factory=dict)  # "weight" / "bias" / "slope" -> np.ndarray


def _parse_value(text: str):
    return float(text) if any(ch in text for ch in ".eE") else int(text)


def parse_param(text: str, source: str = "<param>") -> list[Layer]:
    """Layers of an ncnn text ``.param`` file; ``ValueError`` on a malformed file."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines or lines[0] != str(MAGIC):
        raise ValueError(f"{source}: not an ncnn text .param file (first line must be the magic {MAGIC})")
    try:
        layer_count = int(lines[1].split()[0])
    except (IndexError, ValueError) as exc:
        raise ValueError(f"{source}: second line must be 'layer_count blob_count'") from exc
    layers = []
    for number, line in enumerate(lines[2:], start=3):
        tok = line.split()
        try:
            n_in, n_out = int(tok[2]), int(tok[3])
            bottoms, tops = tok[4:4 + n_in], tok[4 + n_in:4 + n_in + n_out]
            params = {}
            for item in tok[4 + n_in + n_out:]:
                key, value = item.split("=", 1)
                k = int(key)
                if k <= -23300:
                    parts = value.split(",")
                    params[-23300 - k] = [_parse_value(p) for p in parts[1:1 + int(parts[0])]]
                else:
                    params[k] = _parse_value(value)
        except (IndexError, ValueError) as exc:
            raise ValueError(f"{source}: line {number} is not a valid ncnn layer line ({exc}): {line[:80]!r}") from exc
        layers.append(Layer(tok[0], tok[1], bottoms, tops, params))
    if len(layers) != layer_count:
        raise ValueError(f"{source}: header says {layer_count} layers, file has {len(layers)} (truncated?)")
    return layers


class _Reader:
    def __init__(self, data: bytes, source: str):
        self.data, self.pos, self.source = data, 0, source

    def take(self, n: int, what: str) -> bytes:
        if self.pos + n > len(self.data):
            raise ValueError(f"{self.source}: ends at byte {len(self.data)} while reading {what} "
                             f"({n} bytes at {self.pos}); the .bin is truncated or does not belong to this .param")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def raw_fp32(self, count: int, what: str) -> np.ndarray:
        return np.frombuffer(self.take(4 * count, what), dtype="<f4").copy()

    def tagged(self, count: int, what: str) -> np.ndarray:
        (tag,) = struct.unpack("<I", self.take(4, f"{what} tag"))
        if tag == TAG_FP16:
            raw = self.take((2 * count + 3) // 4 * 4, what)
            return np.frombuffer(raw[:2 * count], dtype="<f2").copy()
        if tag == 0:
            return self.raw_fp32(count, what)
        kind = {TAG_INT8: "int8", TAG_FP32_SCALED: "fp32 with int8 scales"}.get(tag)
        if kind is None:
            raise ValueError(f"{self.source}: {what} starts with tag 0x{tag:08X}, which is neither fp16 nor fp32: "
                             f"the .bin does not belong to this .param (or holds a quantised table, unsupported)")
        raise ValueError(f"{self.source}: {what} is stored as {kind} (tag 0x{tag:08X}); only fp16 and fp32 "
                         f"ncnn weights are supported, re-export the model without int8 quantisation")


def read_weights(layers: list[Layer], data: bytes, source: str = "<bin>") -> None:
    """Fill ``layer.blobs`` from the ``.bin`` bytes; ``ValueError`` on an unknown layer or a size mismatch."""
    reader = _Reader(data, source)
    for layer in layers:
        if layer.type == "Convolution":
            if layer.params.get(8, 0):
                raise ValueError(f"{source}: layer {layer.name} is int8-quantised (8=1), which is not supported")
            out, k = layer.params.get(0, 0), layer.params.get(1, 0)
            kh = layer.params.get(11, k)
            size = layer.params.get(6, 0)
            if out <= 0 or k <= 0 or size % (out * k * kh):
                raise ValueError(f"{source}: layer {layer.name} has inconsistent sizes 0={out} 1={k} 6={size}")
            w = reader.tagged(size, f"{layer.name} weight")
            layer.blobs["weight"] = w.reshape(out, size // (out * k * kh), kh, k)
            if layer.params.get(5, 0):
                layer.blobs["bias"] = reader.raw_fp32(out, f"{layer.name} bias")
        elif layer.type == "PReLU":
            layer.blobs["slope"] = reader.raw_fp32(int(layer.params.get(0, 1)), f"{layer.name} slope")
        elif layer.type not in WEIGHTLESS:
            raise ValueError(f"{source}: layer type {layer.type!r} ({layer.name}) is not part of RRDBNet or "
                             f"SRVGGNetCompact graphs; only {sorted(WEIGHTED | WEIGHTLESS)} are understood")
    if reader.pos != len(data):
        raise ValueError(f"{source}: {len(data) - reader.pos} bytes left after the last weight; the .bin does not "
                         f"belong to this .param")


def _conv_dict(layer: Layer, prefix: str) -> dict:
    out = {f"{prefix}.weight": torch.from_numpy(layer.blobs["weight"])}
    if "bias" not in layer.blobs:
        raise ValueError(f"layer {layer.name} ({prefix}) has no bias; the networks converted here always have one")
    out[f"{prefix}.bias"] = torch.from_numpy(layer.blobs["bias"])
    return out


def _leaky(layer: Layer) -> bool:
    return layer.params.get(9, 0) == 2 and abs(layer.params.get(10, [0.0])[0] - 0.2) < 1e-6


def _map_rrdb(layers: list[Layer]) -> tuple[dict, dict]:
    convs = [l for l in layers if l.type == "Convolution"]
    n_up = sum(1 for l in layers if l.type == "Interp")
    num_block, rem = divmod(len(convs) - 4 - n_up, 15)
    if rem or num_block < 1:
        raise ValueError(f"{len(convs)} convolutions and {n_up} upsamplers do not make an RRDBNet "
                         f"(expected 15 per block + 4 + one per upsampler)")
    for l in layers:
        if l.type == "Eltwise" and [round(c, 6) for c in l.params.get(1, [])] not in ([0.2, 1.0], [1.0, 0.2]):
            raise ValueError(f"residual {l.name} has coefficients {l.params.get(1)}; RRDBNet uses 0.2 and 1.0")
        if l.type == "Interp" and (l.params.get(0) != 1 or l.params.get(1) != 2.0 or l.params.get(2) != 2.0):
            raise ValueError(f"upsampler {l.name} is not a nearest 2x resize (RRDBNet's upsampling)")
    names = ["conv_first"]
    names += [f"body.{b}.rdb{r}.conv{c}" for b in range(num_block) for r in (1, 2, 3) for c in range(1, 6)]
    names += ["conv_body"] + [f"conv_up{i}" for i in range(1, n_up + 1)] + ["conv_hr", "conv_last"]
    sd = {}
    for layer, name in zip(convs, names):
        wants_leaky = name.startswith(("conv_up", "conv_hr")) or (name.startswith("body.") and not name.endswith("5"))
        if _leaky(layer) != wants_leaky:
            raise ValueError(f"layer {layer.name} mapped to {name} {'lacks' if wants_leaky else 'has'} the "
                             f"LeakyReLU(0.2) RRDBNet puts there; the graph is not an RRDBNet")
        sd.update(_conv_dict(layer, name))
    return sd, {}


def _map_compact(layers: list[Layer]) -> tuple[dict, dict]:
    weighted = [l for l in layers if l.type in WEIGHTED]
    kinds = [l.type for l in weighted]
    expect = ["Convolution", "PReLU"] * ((len(kinds) - 1) // 2) + ["Convolution"]
    if kinds != expect or len(kinds) < 3:
        raise ValueError("weighted layers do not alternate Convolution, PReLU, ..., Convolution as in "
                         "SRVGGNetCompact")
    shuffle = [l for l in layers if l.type == "PixelShuffle"]
    if len(shuffle) != 1:
        raise ValueError("SRVGGNetCompact has exactly one PixelShuffle")
    scale = int(shuffle[0].params.get(0, 1))
    sd = {}
    for i, layer in enumerate(weighted):
        if layer.type == "PReLU":
            sd[f"body.{i}.weight"] = torch.from_numpy(layer.blobs["slope"])
        else:
            sd.update(_conv_dict(layer, f"body.{i}"))
    meta = {}
    out_blob = shuffle[0].tops[0]
    after = layers[layers.index(shuffle[0]) + 1:]
    add = [l for l in after if l.type == "BinaryOp" and out_blob in l.bottoms]
    if len(add) != 1:
        raise ValueError("SRVGGNetCompact adds the nearest-upsampled input to the shuffled output; no such add")
    post = [l for l in after if l.type == "Interp" and add[0].tops[0] in l.bottoms]
    if post:
        factor = float(post[0].params.get(1, 1.0))
        meta[OUTPUT_SCALE_KEY] = repr(scale * factor)
        logger.info("graph ends with a %s resize by %g: recorded as output_scale %g in the metadata",
                    {1: "nearest", 2: "bilinear", 3: "bicubic"}.get(post[0].params.get(0), "?"), factor,
                    scale * factor)
    return sd, meta


def convert(param_path: Path, bin_path: Optional[Path] = None, dtype: str = "keep") -> tuple[dict, dict]:
    """``(state_dict, metadata)`` in canonical keys for an ncnn RRDBNet / SRVGGNetCompact; validated by loading."""
    param_path = Path(param_path)
    bin_path = Path(bin_path) if bin_path is not None else param_path.with_suffix(".bin")
    if dtype not in ("keep", "fp16", "fp32"):
        raise ValueError(f"dtype={dtype!r}: expected 'keep' (as stored: fp16 weights, fp32 biases), 'fp16' or 'fp32'")
    if param_path.suffix.lower() != ".param":
        raise ValueError(f"{param_path}: not an ncnn .param file; the converter reads ncnn .param/.bin pairs (a .pth "
                         f"or .safetensors upscaler needs no conversion: put it in models/upscale_models)")
    for p in (param_path, bin_path):
        if not p.is_file():
            raise ValueError(f"ncnn file {p} does not exist")
    layers = parse_param(param_path.read_text(encoding="utf-8", errors="replace"), str(param_path))
    read_weights(layers, bin_path.read_bytes(), str(bin_path))
    types = {l.type for l in layers}
    if "Concat" in types and "Eltwise" in types:
        arch, (sd, meta) = "RRDBNet", _map_rrdb(layers)
    elif "PixelShuffle" in types and "PReLU" in types:
        arch, (sd, meta) = "SRVGGNetCompact", _map_compact(layers)
    else:
        raise ValueError(f"{param_path}: graph with layer types {sorted(types)} is neither an RRDBNet nor an "
                         f"SRVGGNetCompact")
    (build_rrdb if arch == "RRDBNet" else build_compact)(sd)  # strict, shape-checked load: raises on mismatch
    if dtype != "keep":
        target = torch.float16 if dtype == "fp16" else torch.float32
        sd = {k: v.to(target) for k, v in sd.items()}
    meta.update({"format": "pt", "leandiffusion.arch": arch, "leandiffusion.source": f"ncnn:{param_path.name}"})
    return sd, meta


def save_atomic(sd: dict, meta: dict, out_path: Path) -> None:
    """Write ``sd`` as safetensors to ``out_path`` via a temporary file in the same folder (no partial files)."""
    from safetensors.torch import save_file

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.{os.getpid()}.tmp")
    try:
        save_file({k: v.contiguous() for k, v in sd.items()}, tmp, metadata=meta)
        os.replace(tmp, out_path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("param", type=Path, help="ncnn .param file")
    parser.add_argument("out", type=Path, help="output .safetensors file")
    parser.add_argument("--bin", type=Path, default=None, help="ncnn .bin file (default: next to the .param)")
    parser.add_argument("--dtype", default="keep", choices=("keep", "fp16", "fp32"),
                        help="tensor dtype in the output (keep = as stored in the .bin)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.out.suffix.lower() != ".safetensors":  # the upscale node lists and reads files by their extension
        print(f"error: output {args.out}: the converter writes safetensors; name the output file *.safetensors "
              f"(saved as {args.out.suffix or 'a file without extension'} it would not load)", file=sys.stderr)
        return 2
    try:
        sd, meta = convert(args.param, args.bin, args.dtype)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        save_atomic(sd, meta, args.out)
    except OSError as exc:  # a folder in the way, no permission, a full disk: nothing partial is left behind
        print(f"error: cannot write {args.out}: {exc.strerror or exc}; choose another output path", file=sys.stderr)
        return 2
    count = sum(v.numel() for v in sd.values())
    print(f"{meta['leandiffusion.arch']}: {len(sd)} tensors, {count:,} parameters -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

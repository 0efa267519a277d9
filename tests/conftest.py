"""Shared pytest set-up: GPU and ComfyUI markers skip with a reason when their requirement is missing."""
import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    no_gpu = pytest.mark.skip(reason="needs a CUDA device")
    no_comfy = pytest.mark.skip(reason="needs COMFYUI_PATH pointing at a ComfyUI checkout")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        if "comfyui" in item.keywords and not os.environ.get("COMFYUI_PATH"):
            item.add_marker(no_comfy)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _gpu_memory_isolation(request):
    """GPU tests start from a collected heap and an empty cache, so memory deltas measure only the test itself."""
    if "gpu" in request.keywords and torch.cuda.is_available():
        import gc

        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    yield

"""Shared pytest set-up: GPU and ComfyUI markers skip with a reason when their requirement is missing; every test
must leave torch's process-wide numeric settings as it found them (the pack promises to set no backend flag
outside its own scopes, and a leaked flag makes later tests' results depend on the order they run in)."""
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


@pytest.fixture
def strict_fp32():
    """IEEE fp32 matmuls and convolutions (no TF32) for the test; settings restored exactly after it."""
    from leandiffusion.tests.kit.precision import strict_fp32 as strict

    with strict():
        yield


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _gpu_memory_isolation(request):
    """GPU tests start from a collected heap, no cuBLAS workspaces and an empty cache, so memory deltas (and what a
    budget leaves for kernel workspaces) depend only on the test itself."""
    if "gpu" in request.keywords and torch.cuda.is_available():
        import gc

        gc.collect()
        torch.cuda.synchronize()
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:  # cuBLAS keeps a workspace per stream ever used; earlier tests' streams
            clear_workspaces()  # would otherwise hold memory that a budgeted test counts as its own
        torch.cuda.empty_cache()
    yield


def _numeric_settings() -> dict:
    """The process-wide switches that change which kernels run or how they round."""
    b = torch.backends
    settings = {
        "grad_enabled": torch.is_grad_enabled(),
        "default_dtype": torch.get_default_dtype(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn.enabled": b.cudnn.enabled,
        "cudnn.benchmark": b.cudnn.benchmark,
        "cudnn.deterministic": b.cudnn.deterministic,
        "matmul.fp16_reduced": b.cuda.matmul.allow_fp16_reduced_precision_reduction,
        "matmul.bf16_reduced": b.cuda.matmul.allow_bf16_reduced_precision_reduction,
        "sdp.flash": b.cuda.flash_sdp_enabled(),
        "sdp.mem_efficient": b.cuda.mem_efficient_sdp_enabled(),
        "sdp.math": b.cuda.math_sdp_enabled(),
        "sdp.cudnn": b.cuda.cudnn_sdp_enabled(),
    }
    if hasattr(b.cuda.matmul, "fp32_precision"):  # read TF32 through the API the pack writes (mixing the legacy
        # allow_tf32 reads with fp32_precision writes is refused by PyTorch)
        for key, owner in (("fp32_precision", b), ("matmul.fp32_precision", b.cuda.matmul),
                           ("cudnn.fp32_precision", b.cudnn), ("cudnn.conv.fp32_precision", b.cudnn.conv)):
            settings[key] = owner.fp32_precision
    else:
        settings["float32_matmul_precision"] = torch.get_float32_matmul_precision()
        settings["cudnn.allow_tf32"] = b.cudnn.allow_tf32
        settings["matmul.allow_tf32"] = b.cuda.matmul.allow_tf32
    for name in ("fp16_accumulation", "allow_fp16_accumulation"):
        if hasattr(b.cuda.matmul, name):
            settings[f"matmul.{name}"] = getattr(b.cuda.matmul, name)
    if torch.cuda.is_available():
        settings["current_stream"] = torch.cuda.current_stream().cuda_stream
    return settings


@pytest.fixture(autouse=True)
def _numeric_settings_unchanged(request):
    before = _numeric_settings()
    yield
    after = _numeric_settings()
    changed = {k: (before[k], after.get(k)) for k in before if after.get(k) != before[k]}
    if changed:
        for key, (old, _) in changed.items():  # restore, so one leak fails one test, not every later one
            _restore(key, old)
        pytest.fail(f"{request.node.nodeid} left torch settings changed (before, after): {changed}", pytrace=False)


def _restore(key, value):
    b = torch.backends
    setters = {
        "grad_enabled": torch.set_grad_enabled,
        "default_dtype": torch.set_default_dtype,
        "deterministic_algorithms": torch.use_deterministic_algorithms,
        "float32_matmul_precision": torch.set_float32_matmul_precision,
        "sdp.flash": b.cuda.enable_flash_sdp,
        "sdp.mem_efficient": b.cuda.enable_mem_efficient_sdp,
        "sdp.math": b.cuda.enable_math_sdp,
        "sdp.cudnn": b.cuda.enable_cudnn_sdp,
    }
    if key in setters:
        setters[key](value)
    elif key.endswith("fp32_precision"):
        owner = {"fp32_precision": b, "matmul.fp32_precision": b.cuda.matmul, "cudnn.fp32_precision": b.cudnn,
                 "cudnn.conv.fp32_precision": b.cudnn.conv}[key]
        owner.fp32_precision = value
    elif key.startswith("cudnn."):
        setattr(b.cudnn, key.split(".", 1)[1], value)
    elif key.startswith("matmul."):
        name = {"fp16_reduced": "allow_fp16_reduced_precision_reduction",
                "bf16_reduced": "allow_bf16_reduced_precision_reduction"}.get(key[7:], key[7:])
        setattr(b.cuda.matmul, name, value)

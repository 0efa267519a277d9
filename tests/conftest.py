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

        from leandiffusion.memory.cap import forget_library_workspaces

        gc.collect()
        # cuBLAS keeps a workspace per stream ever used: earlier tests' would hold memory a budgeted test counts
        forget_library_workspaces(torch.device("cuda", torch.cuda.current_device()))  # synchronises first
        torch.cuda.empty_cache()
    yield


def _numeric_switches() -> dict:
    """name -> (read, restore) for each process-wide switch that changes which kernels run or how they round
    (``restore`` None: only reported)."""
    b = torch.backends
    attributes = [("cudnn.enabled", b.cudnn, "enabled"), ("cudnn.benchmark", b.cudnn, "benchmark"),
                  ("cudnn.deterministic", b.cudnn, "deterministic"),
                  ("matmul.fp16_reduced", b.cuda.matmul, "allow_fp16_reduced_precision_reduction"),
                  ("matmul.bf16_reduced", b.cuda.matmul, "allow_bf16_reduced_precision_reduction")]
    attributes += [(f"matmul.{name}", b.cuda.matmul, name) for name in ("fp16_accumulation", "allow_fp16_accumulation")
                   if hasattr(b.cuda.matmul, name)]
    switches = {
        "grad_enabled": (torch.is_grad_enabled, torch.set_grad_enabled),
        "default_dtype": (torch.get_default_dtype, torch.set_default_dtype),
        "deterministic_algorithms": (torch.are_deterministic_algorithms_enabled, torch.use_deterministic_algorithms),
        "sdp.flash": (b.cuda.flash_sdp_enabled, b.cuda.enable_flash_sdp),
        "sdp.mem_efficient": (b.cuda.mem_efficient_sdp_enabled, b.cuda.enable_mem_efficient_sdp),
        "sdp.math": (b.cuda.math_sdp_enabled, b.cuda.enable_math_sdp),
        "sdp.cudnn": (b.cuda.cudnn_sdp_enabled, b.cuda.enable_cudnn_sdp),
    }
    if hasattr(b.cuda.matmul, "fp32_precision"):  # read TF32 through the API the pack writes (PyTorch refuses legacy
        # allow_tf32 reads once fp32_precision has been written)
        attributes += [("fp32_precision", b, "fp32_precision"), ("matmul.fp32_precision", b.cuda.matmul,
                        "fp32_precision"), ("cudnn.fp32_precision", b.cudnn, "fp32_precision"),
                       ("cudnn.conv.fp32_precision", b.cudnn.conv, "fp32_precision")]
    else:
        attributes += [("cudnn.allow_tf32", b.cudnn, "allow_tf32"), ("matmul.allow_tf32", b.cuda.matmul, "allow_tf32")]
        switches["float32_matmul_precision"] = (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision)
    for name, owner, attr in attributes:
        switches[name] = (lambda o=owner, a=attr: getattr(o, a), lambda v, o=owner, a=attr: setattr(o, a, v))
    if torch.cuda.is_available():
        switches["current_stream"] = (lambda: torch.cuda.current_stream().cuda_stream, None)
    return switches


@pytest.fixture(autouse=True)
def _numeric_settings_unchanged(request):
    switches = _numeric_switches()
    before = {name: read() for name, (read, _) in switches.items()}
    yield
    changed = {name: (old, switches[name][0]()) for name, old in before.items() if switches[name][0]() != old}
    if changed:
        for name, (old, _) in changed.items():  # restore, so one leak fails one test, not every later one
            restore = switches[name][1]
            if restore is not None:
                restore(old)
        pytest.fail(f"{request.node.nodeid} left torch settings changed (before, after): {changed}", pytrace=False)

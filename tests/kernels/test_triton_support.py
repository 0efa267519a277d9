"""Triton is used only where it can run: installed, on a CUDA device of compute capability 7.0 or newer.

Guards: ComfyUI on Windows has no Triton (PyTorch's wheels bring it only on Linux) and Pascal GPUs (GTX 10xx,
compute capability 6.x) are below what Triton and inductor support; there the ``auto`` dispatch of both fused
kernels used to pick the Triton kernel anyway. Device properties are stubbed, so this runs on the CPU.
"""
from types import SimpleNamespace

import pytest
import torch

from leandiffusion.kernels import cfg_ddim, dispatch, geglu_lora


@pytest.fixture
def gpu(monkeypatch):
    """Pretend: Triton installed, and CUDA device 0 has the compute capability the test sets."""
    state = {"capability": (8, 0), "triton": True}
    monkeypatch.setattr(dispatch, "triton_importable", lambda: state["triton"])
    monkeypatch.setattr(dispatch, "_capability", lambda index: state["capability"])
    return state


def test_reason_names_what_is_missing(gpu):
    cuda = torch.device("cuda", 0)
    assert dispatch.triton_unusable_reason(cuda) is None
    gpu["capability"] = (7, 5)
    assert dispatch.triton_unusable_reason(cuda) is None
    gpu["capability"] = (6, 1)
    reason = dispatch.triton_unusable_reason(cuda)
    assert reason is not None and "6.1" in reason and "7.0" in reason
    gpu["capability"], gpu["triton"] = (8, 0), False
    assert "not installed" in dispatch.triton_unusable_reason(cuda)
    assert "CUDA" in dispatch.triton_unusable_reason(torch.device("cpu"))


def _cuda_stub():
    return SimpleNamespace(is_cuda=True, is_contiguous=lambda: True, device=torch.device("cuda", 0))


@pytest.mark.skipif(cfg_ddim.triton is None, reason="the dispatcher only considers the kernel when triton imports")
def test_cfg_ddim_auto_dispatch_skips_gpus_triton_does_not_support(gpu):
    tensors = [_cuda_stub() for _ in range(3)]
    assert cfg_ddim._triton_usable(tensors)
    gpu["capability"] = (6, 1)
    assert not cfg_ddim._triton_usable(tensors)


@pytest.mark.skipif(geglu_lora.triton is None, reason="the dispatcher only considers the kernel when triton imports")
@pytest.mark.parametrize("capability, expected", [((8, 6), "triton"), ((6, 1), "reference")])
def test_geglu_lora_auto_dispatch_skips_gpus_triton_does_not_support(gpu, monkeypatch, capability, expected):
    gpu["capability"] = capability
    monkeypatch.delenv(geglu_lora.IMPL.env_name, raising=False)
    monkeypatch.setattr(geglu_lora, "geglu_lora_triton", lambda *a: "triton")
    monkeypatch.setattr(geglu_lora, "geglu_lora_reference", lambda *a: "reference")
    assert geglu_lora.geglu_lora(_cuda_stub(), None, None) == expected


@pytest.mark.parametrize("env, expected", [("Reference", "reference"), (" TRITON\n", "triton"), ("", "auto"),
                                           ("  ", "auto"), (None, "auto")])
def test_the_environment_choice_is_read_like_a_user_writes_it(monkeypatch, env, expected):
    """``$env_name`` is read case-insensitively and without surrounding blanks, and empty means unset ("auto")."""
    if env is None:
        monkeypatch.delenv("LEANDIFFUSION_TEST_IMPL", raising=False)
    else:
        monkeypatch.setenv("LEANDIFFUSION_TEST_IMPL", env)
    choice = dispatch.KernelChoice("LEANDIFFUSION_TEST_IMPL")
    assert choice.resolve("auto") == expected
    assert choice.resolve("reference") == "reference"  # the argument wins


@pytest.mark.parametrize("capability, usable", [((7, 0), True), ((6, 2), False)])
def test_compute_capability_7_0_is_the_first_supported(gpu, capability, usable):
    """Volta (7.0, V100) is the oldest architecture Triton supports: it is accepted, Jetson TX2's 6.2 is not."""
    gpu["capability"] = capability
    assert (dispatch.triton_unusable_reason(torch.device("cuda", 0)) is None) == usable


def test_each_device_is_judged_by_its_own_capability(monkeypatch):
    """A machine with a supported GPU and an old one (an RTX card as cuda:0, a GTX 1080 as cuda:1): the reason is
    read from the device asked about, and a device without an index means the current one."""
    caps = {0: (8, 6), 1: (6, 1)}
    monkeypatch.setattr(dispatch, "triton_importable", lambda: True)
    monkeypatch.setattr(dispatch, "_capability", lambda index: caps[index])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert dispatch.triton_unusable_reason(torch.device("cuda", 0)) is None
    assert "6.1" in dispatch.triton_unusable_reason(torch.device("cuda", 1))
    assert "6.1" in dispatch.triton_unusable_reason(torch.device("cuda"))

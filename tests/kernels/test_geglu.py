"""The one-pass GEGLU (``kernels/geglu.py``) equals diffusers' GEGLU after its projection, and its Triton kernel
equals the plain-torch reference: within one ulp of the rounded gelu on the GPU (the two ``erf`` builds differ),
within the interpreter's own ``erf`` and bf16 rounding on the CPU.

Runs the Triton kernel on CPU tensors under ``TRITON_INTERPRET=1``; the ``gpu`` tests repeat it on the device.
Guards: the [a | g] split (value first, gate second: swapped is O(1) off), the tail mask (sizes not multiples of
the block), rows of the projection (``row * 2N``), the rounding points (gelu rounded to the activation dtype before
the product, as PyTorch's separate ops do), the dispatcher (kernel only for CUDA, reference under
``torch.compile`` and on the CPU, the environment override).
"""
import math
import os

import pytest
import torch
from diffusers.models.activations import GEGLU

from leandiffusion.kernels import geglu as gk
from leandiffusion.kernels.geglu import geglu, geglu_reference, geglu_triton

interpret = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or gk.triton is None,
                               reason="runs the Triton kernel on the CPU only under TRITON_INTERPRET=1")
gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SHAPES = [(1, 1), (3, 37, 50), (2, 70, 65), (5, 2049)]  # leading dims..., N (the half width); block = 2048
# The interpreter's erf (NumPy's) and its fp32 -> bf16 truncation (see tests/kernels/test_geglu_lora.py) differ
# from PyTorch's by an ulp at a rounding point: kernel vs reference bounds under the interpreter.
INTERPRETER_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (6e-2, 3e-2)}


def _p(shape, dtype, device="cpu", seed=0):
    *lead, n = shape
    return (3 * torch.randn(*lead, 2 * n, generator=torch.Generator().manual_seed(seed))).to(device, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reference_is_diffusers_geglu_after_its_projection(dtype):
    module = GEGLU(16, 24).to(dtype)
    x = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        assert torch.equal(geglu_reference(module.proj(x)), module(x))


def test_reference_matches_float64_formula():
    p = _p((4, 33), torch.float32)
    a, g = p.double().chunk(2, dim=-1)
    want = a * 0.5 * g * (1 + torch.erf(g / math.sqrt(2)))
    torch.testing.assert_close(geglu_reference(p).double(), want, atol=1e-5, rtol=1e-5)


@interpret
@pytest.mark.parametrize("dtype", list(INTERPRETER_TOL))
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_matches_reference(shape, dtype):
    p = _p(shape, dtype)
    got, want = geglu_triton(p), geglu_reference(p)
    assert got.shape == want.shape == p.shape[:-1] + (shape[-1],) and got.dtype == dtype
    atol, rtol = INTERPRETER_TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


@interpret
def test_triton_value_first_gate_second_and_writes_into_out():
    n = 40
    p = torch.cat([torch.full((3, n), 2.0), torch.full((3, n), -1.0)], dim=-1)  # a = 2, g = -1
    out = torch.empty(3, n)
    assert geglu_triton(p, out=out) is out
    torch.testing.assert_close(out, torch.full((3, n), 2.0 * torch.nn.functional.gelu(torch.tensor(-1.0)).item()),
                               atol=1e-6, rtol=0)


def test_validation_errors():
    with pytest.raises(ValueError, match="must be even"):
        geglu_reference(torch.zeros(2, 5))
    with pytest.raises(ValueError, match="expected"):
        geglu_reference(torch.zeros(2, 6), out=torch.zeros(2, 4))
    if gk.triton is not None:
        with pytest.raises(ValueError, match="contiguous"):
            geglu_triton(torch.zeros(6, 4).t())
        with pytest.raises(ValueError, match="float64"):
            geglu_triton(torch.zeros(2, 6, dtype=torch.float64))


def test_dispatcher_takes_the_reference_on_the_cpu_and_follows_the_environment(monkeypatch):
    calls = []
    monkeypatch.setattr(gk, "geglu_triton", lambda p, out=None: calls.append("triton") or geglu_reference(p, out))
    p = _p((2, 8), torch.float32)
    geglu(p)
    assert calls == []
    monkeypatch.setenv("LEANDIFFUSION_GEGLU", "triton")
    geglu(p)
    assert calls == ["triton"] and gk.IMPL.resolve() == "triton"
    monkeypatch.setenv("LEANDIFFUSION_GEGLU", "bogus")
    with pytest.raises(ValueError, match="LEANDIFFUSION_GEGLU"):
        geglu(p)


def test_dispatcher_under_torch_compile_takes_the_reference(monkeypatch):
    calls = []
    monkeypatch.setattr(gk, "geglu_triton", lambda p, out=None: calls.append("triton"))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setenv("LEANDIFFUSION_GEGLU", "triton")  # not read while tracing
    p = _p((2, 8), torch.float32)
    assert torch.equal(geglu(p), geglu_reference(p)) and calls == []


# dtype -> (atol, rtol): Triton's erf (libdevice, compiled by Triton's LLVM) and PyTorch's (nvcc) can round the
# gelu differently: a few percent of SDXL-sized fp16 elements differ by one ulp of the rounded gelu, so the
# product by about one ulp of the output. A wrong split, row stride or rounding point is O(1) or ~100 ulps off.
GPU_TOL = {torch.float16: (1e-4, 2 ** -10), torch.bfloat16: (1e-3, 2 ** -7), torch.float32: (1e-5, 1e-5)}


@pytest.mark.parametrize("dtype", list(GPU_TOL))
@pytest.mark.parametrize("shape", [(2, 4096, 2560), (3, 37, 50)], ids=["sdxl-ff", "odd"])
@pytest.mark.parametrize("marks", [pytest.param(None, marks=gpu)])
def test_gpu_kernel_is_pytorchs_geglu_within_an_ulp(shape, dtype, marks):
    p = _p(shape, dtype, device="cuda")
    got = geglu(p)
    want = geglu_reference(p)
    assert got.is_cuda and got.dtype == dtype and got.shape == want.shape
    atol, rtol = GPU_TOL[dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    if dtype != torch.float32:  # in fp32 nearly every erf difference shows; in half most round away
        assert (got != want).float().mean().item() <= 0.05

"""The fused CFG+DDIM kernel equals its plain-torch reference over odd shapes, dtypes and every optional input.

Runs the Triton kernel itself on CPU tensors under ``TRITON_INTERPRET=1`` (the CI setting); on a CUDA machine the
``gpu`` test repeats the check on the device. Guards: a wrong mask on the tail block (odd numel), a wrong copy
offset for the doubled UNet input, fp16/bf16 stores, the guidance formula u + s (c - u), and the dispatcher's choice.
"""
import os

import pytest
import torch

from leandiffusion.kernels import cfg_ddim
from leandiffusion.kernels.cfg_ddim import cfg_ddim_reference, cfg_ddim_step, cfg_ddim_triton, pack_coefficients

interpret = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or cfg_ddim.triton is None,
                               reason="runs the Triton kernel on the CPU only under TRITON_INTERPRET=1")

# dtype -> (atol, rtol) of kernel vs reference: both compute in float32, so they differ by at most a rounding of
# the final store (fused multiply-add in the kernel).
TOLERANCE = {torch.float32: (2e-6, 2e-6), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
SHAPES = [(1, 4, 7, 9), (3, 4, 13, 5), (2, 4, 33, 31), (1, 1, 1, 1), (1, 4, 16, 16)]


def _inputs(shape, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda: torch.randn(shape, generator=g).to(device, dtype)  # noqa: E731
    return mk(), mk(), mk(), mk()


PREDS = ("epsilon", "v_prediction", "sample")


def _ref64(x, c, u, n, coeffs, pred):
    """The DDIM step in float64, written independently in its linear form x' = A x + B m + sigma z."""
    s, sa, sb, sap, d, sigma = coeffs.double().tolist()
    m = c.double() if u is None else u.double() + s * (c.double() - u.double())
    A, B = {"epsilon": (sap / sa, d - sap * sb / sa), "v_prediction": (sap * sa + d * sb, d * sa - sap * sb),
            "sample": (d / sb, sap - d * sa / sb)}[pred]
    y = A * x.double() + B * m
    return y if n is None else y + sigma * n.double()


def _coeffs(device="cpu"):
    a, ap, sigma = 0.3, 0.6, 0.2
    return pack_coefficients(7.5, a ** 0.5, (1 - a) ** 0.5, ap ** 0.5, (1 - ap - sigma ** 2) ** 0.5, sigma,
                             device=device)


@pytest.mark.parametrize("pred", PREDS)
@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("shape", SHAPES)
def test_reference_matches_float64_formula(shape, dtype, pred):
    x, c, u, n = _inputs(shape, dtype)
    coeffs = _coeffs()
    out = cfg_ddim_reference(x, c, u, coeffs, n, prediction=pred)
    atol, rtol = TOLERANCE[dtype]
    want = _ref64(x, c, u, n, coeffs, pred)
    torch.testing.assert_close(out.double(), want, atol=atol * 50 if dtype == torch.float32 else atol * 30,
                               rtol=rtol * 4)
    assert out.dtype == dtype


@interpret
@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("uncond,noise,copies,pred", [(True, False, 2, "epsilon"), (True, True, 1, "v_prediction"),
                                                     (False, True, 0, "sample"), (False, False, 1, "epsilon")])
def test_triton_matches_reference(shape, dtype, uncond, noise, copies, pred):
    x, c, u, n = _inputs(shape, dtype)
    u = u if uncond else None
    n = n if noise else None
    coeffs = _coeffs()
    mi_ref = torch.full((max(copies, 1) * shape[0],) + shape[1:], float("nan"), dtype=torch.float16)
    mi_tri = mi_ref.clone()
    ref = cfg_ddim_reference(x, c, u, coeffs, n, model_input=mi_ref if copies else None, prediction=pred)
    tri = cfg_ddim_triton(x, c, u, coeffs, n, model_input=mi_tri if copies else None, prediction=pred)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(tri, ref, atol=atol, rtol=rtol)
    if copies:
        torch.testing.assert_close(mi_tri, mi_ref, atol=2e-3, rtol=2e-3)
        assert not torch.isnan(mi_tri).any()  # every element of every copy was written
        for k in range(1, copies):
            assert torch.equal(mi_tri[k * shape[0]:(k + 1) * shape[0]], mi_tri[:shape[0]])


@interpret
def test_triton_in_place_update():
    """The sampler updates its state in place (out is sample): each element is read before it is written."""
    x, c, u, n = _inputs((2, 4, 11, 13), torch.float32)
    coeffs = _coeffs()
    expected = cfg_ddim_reference(x.clone(), c, u, coeffs, n)
    state = x.clone()
    got = cfg_ddim_triton(state, c, u, coeffs, n, out=state)
    assert got.data_ptr() == state.data_ptr()
    torch.testing.assert_close(state, expected, atol=2e-6, rtol=2e-6)


@interpret
def test_guidance_scale_read_from_device_tensor():
    """Changing the coefficient tensor's contents (what a graph replay sees) changes the result; no recompile.

    With prediction="sample", sqrt a' = 1 and d = 0 the step returns the guided model output m itself."""
    x, c, u, _ = _inputs((1, 4, 5, 5), torch.float32)
    coeffs = pack_coefficients(1.0, 0.5, 0.5, 1.0, 0.0)
    torch.testing.assert_close(cfg_ddim_triton(x, c, u, coeffs, prediction="sample"), c)  # s=1: pure cond
    coeffs.copy_(pack_coefficients(0.0, 0.5, 0.5, 1.0, 0.0))
    torch.testing.assert_close(cfg_ddim_triton(x, c, u, coeffs, prediction="sample"), u)  # s=0: pure uncond


def test_validation_errors():
    x, c, u, n = _inputs((1, 4, 4, 4), torch.float32)
    coeffs = _coeffs()
    with pytest.raises(ValueError, match="pred_cond"):
        cfg_ddim_reference(x, c[:, :2], u, coeffs)
    with pytest.raises(ValueError, match="coeffs"):
        cfg_ddim_reference(x, c, u, coeffs.double())
    with pytest.raises(ValueError, match="model_input"):
        cfg_ddim_reference(x, c, u, coeffs, model_input=torch.zeros(3, 4, 4, 4))
    with pytest.raises(ValueError, match="prediction"):
        cfg_ddim_reference(x, c, u, coeffs, prediction="flow")
    with pytest.raises(ValueError, match="impl"):
        cfg_ddim_step(x, c, u, coeffs, impl="cuda")


def test_dispatcher_uses_reference_on_cpu_and_env_override(monkeypatch):
    monkeypatch.setenv("LEANDIFFUSION_CFG_DDIM", "reference")
    assert cfg_ddim.IMPL.resolve() == "reference"
    monkeypatch.setenv("LEANDIFFUSION_CFG_DDIM", "auto")
    calls = []
    monkeypatch.setattr(cfg_ddim, "cfg_ddim_triton", lambda *a, **k: calls.append("triton"))
    x, c, u, n = _inputs((1, 4, 4, 4), torch.float32)
    out = cfg_ddim_step(x, c, u, _coeffs())
    assert calls == [] and out.shape == x.shape  # CPU tensors -> reference
    monkeypatch.setenv("LEANDIFFUSION_CFG_DDIM", "bogus")
    with pytest.raises(ValueError, match="LEANDIFFUSION_CFG_DDIM"):
        cfg_ddim.IMPL.resolve()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("shape", SHAPES + [(2, 4, 128, 128)])
def test_gpu_kernel_matches_reference(shape, dtype):
    x, c, u, n = _inputs(shape, dtype, device="cuda")
    coeffs = _coeffs("cuda")
    mi = torch.empty((2 * shape[0],) + shape[1:], device="cuda", dtype=torch.float16)
    ref = cfg_ddim_reference(x, c, u, coeffs, n)
    got = cfg_ddim_step(x, c, u, coeffs, n, model_input=mi)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(got, ref, atol=atol, rtol=rtol)
    mi_ref = torch.empty_like(mi)
    cfg_ddim_reference(x, c, u, coeffs, n, model_input=mi_ref)
    torch.testing.assert_close(mi, mi_ref, atol=2e-3, rtol=2e-3)


@pytest.mark.gpu
def test_gpu_dispatcher_sends_only_contiguous_tensors_to_the_kernel(monkeypatch):
    """A dispatcher that ignores contiguity hands strided views to the kernel, which refuses them; strided CUDA
    tensors must take the reference (the same numbers as its own call)."""
    monkeypatch.setenv("LEANDIFFUSION_CFG_DDIM", "auto")
    x, c, u, n = _inputs((2, 4, 6, 10), torch.float32, device="cuda")
    coeffs = _coeffs("cuda")
    calls, kernel = [], cfg_ddim.cfg_ddim_triton
    monkeypatch.setattr(cfg_ddim, "cfg_ddim_triton", lambda *a: calls.append(a[0].shape) or kernel(*a))
    cfg_ddim_step(x, c, u, coeffs, n)
    assert calls == [x.shape]
    strided = [t.transpose(2, 3) for t in (x, c, u, n)]
    got = cfg_ddim_step(strided[0], strided[1], strided[2], coeffs, strided[3])
    assert calls == [x.shape]
    want = cfg_ddim_reference(strided[0], strided[1], strided[2], coeffs, strided[3])
    torch.testing.assert_close(got, want, atol=0, rtol=0)


# The explicit reference choice and the device check.
def test_explicit_reference_choice_and_a_tensor_on_another_device():
    x, c, u, n = _inputs((1, 4, 5, 3), torch.float32)
    coeffs = _coeffs()
    torch.testing.assert_close(cfg_ddim_step(x, c, u, coeffs, impl="reference"), cfg_ddim_reference(x, c, u, coeffs),
                               atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"noise is on meta but sample is on cpu; move it to one device"):
        cfg_ddim_reference(x, c, u, coeffs, noise=torch.empty(x.shape, device="meta"))


def test_triton_entry_refuses_what_it_cannot_run(monkeypatch):
    x, c, u, n = _inputs((1, 4, 6, 6), torch.float32)
    with pytest.raises(ValueError, match=r"cfg_ddim_triton needs contiguous tensors; call .contiguous\(\) or use "
                                         r"cfg_ddim_reference"):
        cfg_ddim_triton(x.transpose(2, 3), c, u, _coeffs())
    monkeypatch.setattr(cfg_ddim, "triton", None)
    with pytest.raises(RuntimeError, match=r"cfg_ddim_triton needs the 'triton' package; install triton or use "
                                           r"cfg_ddim_reference"):
        cfg_ddim_triton(x, c, u, _coeffs())


@interpret
def test_triton_on_an_empty_batch_returns_the_empty_output():
    x, c, u, n = _inputs((0, 4, 6, 6), torch.float32)
    out = torch.empty_like(x)
    assert cfg_ddim_triton(x, c, u, _coeffs(), out=out) is out

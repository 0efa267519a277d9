"""The fused CFG + flow Euler kernel equals its plain-torch reference over odd shapes, dtypes and every optional
input, and the reference equals diffusers' Z-Image step.

Runs the Triton kernel itself on CPU tensors under ``TRITON_INTERPRET=1`` (the CI setting); on a CUDA machine the
``gpu`` tests repeat the check on the device and capture the step in a CUDA graph. Guards: a wrong mask on the tail
block (odd numel), a wrong copy offset for the doubled model input, bf16/fp16 loads and stores, the guidance formula
u + s (c - u), the step's sign against ``FlowMatchEulerDiscreteScheduler.step``, the in-place state update, new
coefficients read from the device tensor, every validation error and the dispatcher's choice.
"""
import os
from types import SimpleNamespace

import pytest
import torch

from leandiffusion.kernels import dispatch, flow_euler_cfg
from leandiffusion.kernels.flow_euler_cfg import (flow_euler_reference, flow_euler_step, flow_euler_triton,
                                                  pack_flow_coefficients)

interpret = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or flow_euler_cfg.triton is None,
                               reason="runs the Triton kernel on the CPU only under TRITON_INTERPRET=1")

# pred dtype -> (atol, rtol) of kernel vs reference on ``out``. Both upcast the predictions and compute in float32 and
# the state is float32, so the pred dtype changes the inputs, not the arithmetic: they differ by at most the roundings
# a fused multiply-add (compiled kernel) saves, for every pred dtype.
TOLERANCE = {torch.float32: (2e-6, 2e-6), torch.float16: (2e-6, 2e-6), torch.bfloat16: (2e-6, 2e-6)}
# model_input dtype -> (atol, rtol): one rounding step of the store apart. The interpreter truncates float32 -> bf16
# where torch (and the compiled kernel) round to nearest, so bf16 copies may be one bf16 ulp (2^-7 relative) apart.
MI_TOLERANCE = {torch.float32: (2e-6, 2e-6), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
LATENT = (2, 16, 128, 128)  # a 1024x1024 Z-Image latent, batch 2: many blocks, still quick in the interpreter
SHAPES = [(1, 16, 13, 7), (3, 16, 5, 9), LATENT, (2049,), (1,)]
# the latent-sized shape in the models' dtype only: each interpreted call of it takes about a second
KERNEL_CASES = [(shape, dtype) for shape in SHAPES for dtype in TOLERANCE if shape != LATENT or dtype == torch.bfloat16]
GUIDANCE, STEP = 4.5, 0.3125


def _inputs(shape, dtype, device="cpu", seed=0):
    """(float32 sample, pred_cond, pred_uncond in ``dtype``)."""
    g = torch.Generator().manual_seed(seed)
    mk = lambda: torch.randn(shape, generator=g)  # noqa: E731
    return mk().to(device), mk().to(device, dtype), mk().to(device, dtype)


def _ref64(x, c, u, coeffs):
    """The step in float64, written independently in its linear form x' = x + d s c + d (1 - s) u."""
    s, d = coeffs.double().tolist()
    if u is None:
        return x.double() + d * c.double()
    return x.double() + (d * s) * c.double() + (d * (1 - s)) * u.double()


@pytest.mark.parametrize("uncond", [True, False])
@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("shape", SHAPES)
def test_reference_matches_float64_formula(shape, dtype, uncond):
    x, c, u = _inputs(shape, dtype)
    coeffs = pack_flow_coefficients(GUIDANCE, STEP)
    out = flow_euler_reference(x, c, u if uncond else None, coeffs)
    assert out.dtype == torch.float32 and out.shape == x.shape
    # float32 roundings of u + s (c - u) (terms up to |s (c - u)| ~ 40) and of x + d m
    torch.testing.assert_close(out.double(), _ref64(x, c, u if uncond else None, coeffs), atol=4e-6, rtol=2e-6)


@interpret
@pytest.mark.parametrize("shape,dtype", KERNEL_CASES)
@pytest.mark.parametrize("uncond,copies,mi_dtype", [(True, 2, torch.bfloat16), (True, 1, torch.float32),
                                                    (False, 1, torch.bfloat16), (False, 2, torch.float32),
                                                    (True, 0, None)])
def test_triton_matches_reference(shape, dtype, uncond, copies, mi_dtype):
    x, c, u = _inputs(shape, dtype)
    u = u if uncond else None
    coeffs = pack_flow_coefficients(GUIDANCE, STEP)
    mi_ref = torch.full((max(copies, 1) * shape[0],) + shape[1:], float("nan"), dtype=mi_dtype or torch.float32)
    mi_tri = mi_ref.clone()
    ref = flow_euler_reference(x, c, u, coeffs, model_input=mi_ref if copies else None)
    tri = flow_euler_triton(x, c, u, coeffs, model_input=mi_tri if copies else None)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(tri, ref, atol=atol, rtol=rtol)
    if copies:
        atol, rtol = MI_TOLERANCE[mi_dtype]
        torch.testing.assert_close(mi_tri, mi_ref, atol=atol, rtol=rtol)
        assert not torch.isnan(mi_tri).any()  # every element of every copy was written
        for k in range(1, copies):
            assert torch.equal(mi_tri[k * shape[0]:(k + 1) * shape[0]], mi_tri[:shape[0]])


@pytest.mark.parametrize("impl", ["reference", pytest.param("triton", marks=interpret)])
@pytest.mark.parametrize("mi_dtype", [None, torch.bfloat16, torch.float32])
def test_in_place_update(impl, mi_dtype):
    """The sampler updates its state in place (out is sample): each element is read before it is written."""
    x, c, u = _inputs((2, 16, 11, 13), torch.bfloat16)
    coeffs = pack_flow_coefficients(GUIDANCE, STEP)
    mi_want = None if mi_dtype is None else torch.empty((4, 16, 11, 13), dtype=mi_dtype)
    expected = flow_euler_step(x.clone(), c, u, coeffs, model_input=mi_want, impl=impl)
    state = x.clone()
    mi = None if mi_dtype is None else torch.empty_like(mi_want)
    got = flow_euler_step(state, c, u, coeffs, out=state, model_input=mi, impl=impl)
    assert got is state
    assert torch.equal(state, expected)
    if mi is not None:
        assert torch.equal(mi, mi_want)


@pytest.mark.parametrize("impl", ["reference", pytest.param("triton", marks=interpret)])
def test_coefficient_changes_are_read_from_the_device_tensor(impl):
    """New values copied into the same coefficient tensor (what a graph replay sees) change the result; every buffer
    is reused, nothing is re-created. s = 1 gives the cond prediction, s = 0 the uncond one, d = 0 the state."""
    x, c, u = _inputs((1, 16, 5, 7), torch.float32)
    state, mi = x.clone(), torch.empty((2, 16, 5, 7), dtype=torch.bfloat16)
    coeffs = pack_flow_coefficients(1.0, 1.0)
    for s, d, want in [(1.0, 1.0, x + c), (0.0, 1.0, x + u), (3.0, 0.0, x), (GUIDANCE, -0.25, None)]:
        state.copy_(x)
        coeffs.copy_(pack_flow_coefficients(s, d))
        flow_euler_step(state, c, u, coeffs, out=state, model_input=mi, impl=impl)
        if want is None:
            want = flow_euler_reference(x, c, u, pack_flow_coefficients(s, d))
        torch.testing.assert_close(state, want, atol=2e-6, rtol=2e-6)
        torch.testing.assert_close(mi, torch.cat([want, want]).bfloat16(), atol=1.6e-2, rtol=1.6e-2)


def _zimage_scheduler():
    """Z-Image-Turbo's scheduler settings (static shift 3.0) over a short custom sigma schedule."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    sched.set_timesteps(sigmas=[1.0, 0.75, 0.5, 0.25])
    return sched


@pytest.mark.parametrize("impl", ["reference", pytest.param("triton", marks=interpret)])
@pytest.mark.parametrize("pred_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("guided", [True, False])
def test_matches_diffusers_zimage_step(impl, pred_dtype, guided):
    """diffusers' ``ZImagePipeline`` step: pred = c + g (c - u) with g = s - 1 (its ``guidance_scale``), then
    ``FlowMatchEulerDiscreteScheduler.step(-pred)`` = x + (sigma_next - sigma) (-pred). Ours with
    d = sigma - sigma_next gives the same x' within 1e-6 at every step: absolute, and relative where |x'| > 1 (with
    independent random c and u, s (c - u) reaches 30 and x' passes 8, where float32's spacing is 9.5e-7 and the two
    formulas' roundings may differ by two steps)."""
    sched = _zimage_scheduler()
    s = 5.0
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 16, 9, 11, generator=g)
    assert len(sched.timesteps) == 4
    for i, t in enumerate(sched.timesteps):
        c = torch.randn(x.shape, generator=g).to(pred_dtype)
        u = torch.randn(x.shape, generator=g).to(pred_dtype) if guided else None
        pos = c.float()
        pred = pos + (s - 1) * (pos - u.float()) if guided else pos
        want = sched.step(-pred, t, x, return_dict=False)[0]
        d = (sched.sigmas[i] - sched.sigmas[i + 1]).item()
        assert d > 0  # denoising runs sigma downwards: Z-Image's caller passes a positive step
        got = flow_euler_step(x, c, u, pack_flow_coefficients(s, d), impl=impl)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        x = want


def test_reference_accepts_strided_views():
    x, c, u = _inputs((2, 16, 6, 10), torch.bfloat16)
    coeffs = pack_flow_coefficients(GUIDANCE, STEP)
    strided = [t.transpose(2, 3) for t in (x, c, u)]
    got = flow_euler_reference(*strided, coeffs)
    want = flow_euler_reference(*[t.contiguous() for t in strided], coeffs)
    assert torch.equal(got, want)


def _bad_cases():
    x, c, u = _inputs((1, 16, 4, 4), torch.float32)
    co = pack_flow_coefficients(GUIDANCE, STEP)
    meta = lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta")  # noqa: E731
    return [
        ("sample", ValueError, r"sample has dtype torch\.bfloat16 but the flow state is float32",
         (x.bfloat16(), c, u, co), {}),
        ("out_dtype", ValueError, r"out has dtype torch\.float16", (x, c, u, co), {"out": x.half()}),
        ("pred_cond_dtype", ValueError, r"pred_cond has dtype torch\.float64", (x, c.double(), u, co), {}),
        ("pred_uncond_dtype", ValueError, r"pred_uncond has dtype torch\.int32", (x, c, u.int(), co), {}),
        ("model_input_dtype", ValueError, r"model_input has dtype torch\.uint8", (x, c, u, co),
         {"model_input": torch.zeros(1, 16, 4, 4, dtype=torch.uint8)}),
        ("pred_cond_shape", ValueError, r"pred_cond has shape \(1, 8, 4, 4\) but sample has \(1, 16, 4, 4\)",
         (x, c[:, :8], u, co), {}),
        ("pred_uncond_shape", ValueError, r"pred_uncond has shape", (x, c, u[..., :3], co), {}),
        ("out_shape", ValueError, r"out has shape", (x, c, u, co), {"out": torch.zeros(2, 16, 4, 4)}),
        ("pred_cond_device", ValueError, r"pred_cond is on meta but sample is on cpu; move it to one device",
         (x, meta(c), u, co), {}),
        ("pred_uncond_device", ValueError, r"pred_uncond is on meta", (x, c, meta(u), co), {}),
        ("out_device", ValueError, r"out is on meta", (x, c, u, co), {"out": meta(x)}),
        ("coeffs_device", ValueError, r"coeffs is on meta", (x, c, u, meta(co)), {}),
        ("model_input_device", ValueError, r"model_input is on meta", (x, c, u, co),
         {"model_input": torch.empty(2, 16, 4, 4, device="meta")}),
        ("coeffs_dtype", ValueError, r"coeffs must be a float32 tensor of shape \(2,\)", (x, c, u, co.double()), {}),
        ("coeffs_shape", ValueError, r"coeffs must be a float32 tensor of shape \(2,\)",
         (x, c, u, torch.zeros(6)), {}),
        ("model_input_copies", ValueError, r"model_input has shape \(3, 16, 4, 4\); expected 1 or 2 copies",
         (x, c, u, co), {"model_input": torch.zeros(3, 16, 4, 4)}),
        ("model_input_rows", ValueError, r"model_input has shape", (x, c, u, co),
         {"model_input": torch.zeros(2, 8, 4, 4)}),
        ("model_input_0d", ValueError, r"model_input needs a batch axis but sample is 0-d",
         (x[0, 0, 0, 0], c[0, 0, 0, 0], None, co), {"model_input": torch.zeros(1)}),
        ("sample_type", TypeError, r"sample must be a torch\.Tensor, got ndarray", (x.numpy(), c, u, co), {}),
        ("pred_cond_none", TypeError, r"pred_cond must be a torch\.Tensor, got NoneType", (x, None, u, co), {}),
        ("coeffs_type", TypeError, r"coeffs must be a torch\.Tensor, got tuple", (x, c, u, (4.5, 0.3)), {}),
    ]


@pytest.mark.parametrize("impl", ["reference", "auto", pytest.param("triton", marks=interpret)])
@pytest.mark.parametrize("case", _bad_cases(), ids=lambda case: case[0])
def test_validation_errors_name_the_argument(case, impl):
    _, exc, match, args, kwargs = case
    with pytest.raises(exc, match=match):
        flow_euler_step(*args, **kwargs, impl=impl)


def test_impl_and_coefficient_errors():
    x, c, u = _inputs((1, 16, 4, 4), torch.float32)
    with pytest.raises(ValueError, match="impl='cuda'"):
        flow_euler_step(x, c, u, pack_flow_coefficients(GUIDANCE, STEP), impl="cuda")
    with pytest.raises(ValueError, match=r"guidance=nan: the step coefficients must be finite"):
        pack_flow_coefficients(float("nan"), STEP)
    with pytest.raises(ValueError, match=r"step=inf"):
        pack_flow_coefficients(GUIDANCE, float("inf"))
    coeffs = pack_flow_coefficients(GUIDANCE, -STEP, device="cpu")
    assert coeffs.dtype == torch.float32 and coeffs.tolist() == [GUIDANCE, -STEP]


def test_dispatcher_uses_reference_on_cpu_and_env_override(monkeypatch):
    monkeypatch.setenv("LEANDIFFUSION_FLOW_EULER", "reference")
    assert flow_euler_cfg.IMPL.resolve() == "reference"
    monkeypatch.setenv("LEANDIFFUSION_FLOW_EULER", "auto")
    calls = []
    monkeypatch.setattr(flow_euler_cfg, "flow_euler_triton", lambda *a, **k: calls.append("triton"))
    x, c, u = _inputs((1, 16, 4, 4), torch.float32)
    out = flow_euler_step(x, c, u, pack_flow_coefficients(GUIDANCE, STEP))
    assert calls == [] and out.shape == x.shape  # CPU tensors -> reference
    monkeypatch.setenv("LEANDIFFUSION_FLOW_EULER", "triton")
    flow_euler_step(x, c, u, pack_flow_coefficients(GUIDANCE, STEP))
    assert calls == ["triton"]  # the environment forces the kernel
    monkeypatch.setenv("LEANDIFFUSION_FLOW_EULER", "bogus")
    with pytest.raises(ValueError, match="LEANDIFFUSION_FLOW_EULER"):
        flow_euler_cfg.IMPL.resolve()


@pytest.mark.skipif(flow_euler_cfg.triton is None,
                    reason="the dispatcher only considers the kernel when triton imports")
@pytest.mark.parametrize("capability, usable", [((8, 0), True), ((6, 1), False)])
def test_auto_dispatch_skips_gpus_triton_does_not_support(monkeypatch, capability, usable):
    monkeypatch.setattr(dispatch, "triton_importable", lambda: True)
    monkeypatch.setattr(dispatch, "_capability", lambda index: capability)
    stub = SimpleNamespace(is_cuda=True, is_contiguous=lambda: True, device=torch.device("cuda", 0))
    assert flow_euler_cfg._triton_usable([stub, stub, stub]) == usable


def test_triton_entry_refuses_what_it_cannot_run(monkeypatch):
    x, c, u = _inputs((1, 16, 6, 6), torch.float32)
    coeffs = pack_flow_coefficients(GUIDANCE, STEP)
    with pytest.raises(ValueError, match=r"flow_euler_triton needs contiguous tensors; call .contiguous\(\) or use "
                                         r"flow_euler_reference"):
        flow_euler_triton(x.transpose(2, 3), c, u, coeffs)
    monkeypatch.setattr(flow_euler_cfg, "triton", None)
    with pytest.raises(RuntimeError, match=r"flow_euler_triton needs the 'triton' package; install triton or use "
                                           r"flow_euler_reference"):
        flow_euler_triton(x, c, u, coeffs)


@interpret
def test_triton_on_an_empty_batch_returns_the_empty_output():
    x, c, u = _inputs((0, 16, 6, 6), torch.float32)
    out = torch.empty_like(x)
    mi = torch.empty((0, 16, 6, 6), dtype=torch.bfloat16)
    assert flow_euler_triton(x, c, u, pack_flow_coefficients(GUIDANCE, STEP), out=out, model_input=mi) is out


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("shape", SHAPES + [(1, 16, 128, 128)])
def test_gpu_kernel_matches_reference(shape, dtype):
    x, c, u = _inputs(shape, dtype, device="cuda")
    coeffs = pack_flow_coefficients(GUIDANCE, STEP, device="cuda")
    mi = torch.empty((2 * shape[0],) + shape[1:], device="cuda", dtype=torch.bfloat16)
    ref = flow_euler_reference(x, c, u, coeffs)
    got = flow_euler_step(x, c, u, coeffs, model_input=mi)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(got, ref, atol=atol, rtol=rtol)
    mi_ref = torch.empty_like(mi)
    flow_euler_reference(x, c, u, coeffs, model_input=mi_ref)
    torch.testing.assert_close(mi, mi_ref, atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.gpu
def test_gpu_step_is_graph_capturable_and_replays_read_new_coefficients():
    """Captured once (in place, with the doubled bf16 model input), replayed with new (s, d) copied in."""
    x, c, u = _inputs((2, 16, 40, 24), torch.bfloat16, device="cuda")
    state, coeffs = x.clone(), pack_flow_coefficients(GUIDANCE, STEP, device="cuda")
    mi = torch.empty((4, 16, 40, 24), device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles the kernel outside the capture
        flow_euler_step(x.clone(), c, u, coeffs, model_input=mi)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        flow_euler_step(state, c, u, coeffs, out=state, model_input=mi)
    for s, d in [(GUIDANCE, STEP), (1.0, -0.2), (0.0, 0.05)]:
        before = state.clone()
        coeffs.copy_(pack_flow_coefficients(s, d, device="cuda"))
        graph.replay()
        want = flow_euler_reference(before, c, u, pack_flow_coefficients(s, d, device="cuda"))
        torch.testing.assert_close(state, want, atol=2e-6, rtol=2e-6)
        torch.testing.assert_close(mi, torch.cat([want, want]).bfloat16(), atol=1.6e-2, rtol=1.6e-2)

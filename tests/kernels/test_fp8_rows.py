"""Per-row fp8 quantization (``kernels/fp8_rows.py``): the reference against an independent float64 statement of the
scale rule and of e4m3fn's grid, the Triton kernel against the reference.

Runs the kernel on CPU tensors under ``TRITON_INTERPRET=1``; the ``gpu`` tests repeat it on the device. The
interpreter's float32 -> e4m3 conversion is its own bit arithmetic (a round-up that overflows the mantissa lands a
binade low, subnormals are truncated), so the interpreter tests convert with PyTorch's cast instead
(``torch_fp8_casts``), as the GPU's ``cvt.rn`` does. Without the GELU the kernel must then give the reference's bits,
on both. Guards: one scale per row (not per tensor), the margin (no value
reaches NaN), the GELU applied and rounded to the activation dtype before the amax, rows of other widths than the
block (tail mask), all-zero rows, the dispatcher and its environment override, the custom op under
``torch.compile`` and CUDA-graph capture.
"""
import math
import os

import pytest
import torch

from leandiffusion.kernels import fp8_rows as fr
from leandiffusion.kernels.fp8_rows import fp8_rows, fp8_rows_op, fp8_rows_reference, fp8_rows_triton

interpret = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or fr.triton is None,
                               reason="runs the Triton kernel on the CPU only under TRITON_INTERPRET=1")
gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
E4M3_MAX = 448.0
MIN_NORMAL = 2.0 ** -6


@pytest.fixture
def torch_fp8_casts(monkeypatch):
    """The interpreter's float32 -> float8e4nv conversion done by PyTorch (round to nearest even, subnormals kept)."""
    import numpy as np
    from triton.runtime import interpreter

    plain = interpreter._convert_float

    def convert(data, src, dst, rounding):
        if src == fr.tl.float32 and dst == fr.tl.float8e4nv:
            fp8 = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32)).to(torch.float8_e4m3fn)
            return fp8.view(torch.uint8).numpy()
        return plain(data, src, dst, rounding)

    monkeypatch.setattr(interpreter, "_convert_float", convert)


def _x(rows, k, dtype=torch.bfloat16, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    spread = torch.logspace(-2, 1, rows).unsqueeze(1)  # rows of very different magnitudes
    return (spread * torch.randn(rows, k, generator=g)).to(device, dtype)


def _gelu_tanh64(t: torch.Tensor) -> torch.Tensor:
    t = t.double()
    return 0.5 * t * (1 + torch.tanh(math.sqrt(2 / math.pi) * (t + 0.044715 * t ** 3)))


def _fp8_step(v: torch.Tensor) -> torch.Tensor:
    """The spacing of e4m3fn's grid at ``|v|``: 2^(e - 3) for normal values, 2^-9 below 2^-6."""
    a = v.double().abs().clamp(min=MIN_NORMAL)
    return torch.exp2(torch.floor(torch.log2(a)) - 3)


@pytest.mark.parametrize("gelu", [False, True])
def test_reference_is_the_per_row_scale_rule_on_e4m3s_grid(gelu):
    x = _x(6, 300)
    q, s = fp8_rows_reference(x, gelu_tanh=gelu)
    g = (_gelu_tanh64(x).to(x.dtype) if gelu else x).double()  # what diffusers' GELU returns, in bf16
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and s.shape == (6, 1) and s.dtype == torch.float32
    want_s = g.abs().amax(dim=1, keepdim=True) * (1 + 2 ** -7) / E4M3_MAX
    torch.testing.assert_close(s.double(), want_s, rtol=2e-7, atol=0)  # float32 rounding of the product
    scaled = g * s.double().reciprocal().float().double()  # the float32 reciprocal, as the rule says
    assert scaled.abs().max().item() < E4M3_MAX  # the margin: no value overflows to NaN
    err = (q.double() - scaled).abs()
    ulp = scaled.abs() * 2 ** -7 if gelu else 0  # float64 gelu vs PyTorch's may round one bf16 ulp apart
    assert torch.all(err <= _fp8_step(scaled) / 2 + ulp + 1e-12)  # the nearest point of the grid
    assert torch.isfinite(q.float()).all() and q.float().abs().amax(dim=1).min().item() == E4M3_MAX


def test_reference_scales_each_row_on_its_own():
    x = _x(4, 64)
    big = x.clone()
    big[0] *= 1000
    (q, s), (q2, s2) = fp8_rows_reference(x), fp8_rows_reference(big)
    assert s2[0].item() > 100 * s[0].item()
    assert torch.equal(s[1:], s2[1:]) and torch.equal(q2[1:].view(torch.uint8), q[1:].view(torch.uint8))


def test_zero_rows_get_the_floor_scale_and_zero_values():
    q, s = fp8_rows_reference(torch.zeros(3, 32, dtype=torch.bfloat16), gelu_tanh=True)
    assert torch.all(s == fr.MIN_ACT_SCALE) and torch.all(q.float() == 0)


@interpret
@pytest.mark.parametrize("rows,k", [(5, 100), (3, 2048), (2, 3000), (1, 16)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_triton_gives_the_references_bits_without_the_gelu(rows, k, dtype, torch_fp8_casts):
    x = 3 * _x(rows, k, dtype)
    (q, s), (want_q, want_s) = fp8_rows_triton(x), fp8_rows_reference(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and s.shape == (rows, 1)
    assert torch.equal(s, want_s) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@interpret
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # e^(-2u) = inf for t << 0: t / inf = -0, as tanh
@pytest.mark.parametrize("rows,k", [(5, 100), (2, 3000)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_triton_gelu_is_the_reference_within_a_rounding(rows, k, dtype, torch_fp8_casts):
    """The kernel's GELU (``t / (1 + e^(-2u))``, NumPy's ``exp`` here) and PyTorch's (``tanh``) may round a gelu one
    ulp of the activation dtype apart: its row's scale then moves by at most that ulp, a value by one fp8 step."""
    x = 3 * _x(rows, k, dtype)
    (q, s), (want_q, want_s) = fp8_rows_triton(x, True), fp8_rows_reference(x, True)
    ulp = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10, torch.float32: 1e-6}[dtype]
    torch.testing.assert_close(s, want_s, rtol=ulp, atol=0)
    assert torch.all((q.double() - want_q.double()).abs() <= _fp8_step(want_q))
    assert (q.view(torch.uint8) != want_q.view(torch.uint8)).float().mean().item() <= 0.05


@interpret
def test_triton_zero_rows_and_empty_rows(torch_fp8_casts):
    q, s = fp8_rows_triton(torch.zeros(2, 40), gelu_tanh=True)
    assert torch.all(s == fr.MIN_ACT_SCALE) and torch.all(q.float() == 0)
    q, s = fp8_rows_triton(torch.zeros(3, 0))
    assert q.shape == (3, 0) and torch.all(s == fr.MIN_ACT_SCALE)


def test_validation_errors():
    with pytest.raises(ValueError, match="2-D"):
        fp8_rows_reference(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="float64"):
        fp8_rows_reference(torch.zeros(2, 4, dtype=torch.float64))
    if fr.triton is not None:
        with pytest.raises(ValueError, match="contiguous"):
            fp8_rows_triton(torch.zeros(8, 4).t())
        with pytest.raises(ValueError, match=str(fr.MAX_ROW)):
            fp8_rows_triton(torch.zeros(1, fr.MAX_ROW + 16))


def test_dispatcher_takes_the_reference_on_the_cpu_and_follows_the_environment(monkeypatch):
    calls = []
    monkeypatch.setattr(fr, "fp8_rows_triton", lambda x, g=False: calls.append(g) or fp8_rows_reference(x, g))
    x = _x(2, 32)
    fp8_rows(x, True)
    assert calls == []
    monkeypatch.setenv("LEANDIFFUSION_FP8_ROWS", "triton")
    fp8_rows(x, True)
    assert calls == [True]
    monkeypatch.setenv("LEANDIFFUSION_FP8_ROWS", "bogus")
    with pytest.raises(ValueError, match="LEANDIFFUSION_FP8_ROWS"):
        fp8_rows(x)


def test_custom_op_is_the_dispatcher_and_traces_whole():
    x = _x(3, 48)
    q, s = fp8_rows_op(x, True)
    want_q, want_s = fp8_rows_reference(x, True)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)
    graph = torch.fx.experimental.proxy_tensor.make_fx(lambda t: fp8_rows_op(t, True))(x)
    ops = [n.target for n in graph.graph.nodes if n.op == "call_function" and n.target.__name__ != "getitem"]
    assert ops == [torch.ops.leandiffusion.fp8_rows.default]


@pytest.mark.parametrize("rows,k", [(16896, 12288), (37, 3072), (5, 100)], ids=["qwen-mlp", "narrow", "odd"])
@pytest.mark.parametrize("marks", [pytest.param(None, marks=gpu)])
def test_gpu_kernel_gives_the_references_bits_without_the_gelu(rows, k, marks):
    x = _x(rows, k, device="cuda")
    (q, s), (want_q, want_s) = fp8_rows(x), fp8_rows_reference(x)
    assert torch.equal(s, want_s) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("rows,k", [(16896, 12288), (5, 100)], ids=["qwen-mlp", "odd"])
@pytest.mark.parametrize("marks", [pytest.param(None, marks=gpu)])
def test_gpu_kernel_with_the_gelu_is_the_reference_within_an_ulp(rows, k, marks):
    """The kernel's GELU (``t / (1 + e^(-2u))``) and PyTorch's (``tanh``) may round a bf16 gelu one ulp apart: that
    moves a row's scale by at most one bf16 ulp of its amax and a few values by one fp8 step."""
    x = 3 * _x(rows, k, device="cuda")
    (q, s), (want_q, want_s) = fp8_rows(x, True), fp8_rows_reference(x, True)
    torch.testing.assert_close(s, want_s, rtol=2 ** -7, atol=0)
    same_scale = (s == want_s).squeeze(1)
    assert same_scale.float().mean().item() >= 0.9
    differ = (q[same_scale].view(torch.uint8) != want_q[same_scale].view(torch.uint8)).float().mean().item()
    assert differ <= 0.01
    deq, want = q.double() * s.double(), want_q.double() * want_s.double()
    assert ((deq - want).norm() / want.norm()).item() <= 5e-3


@pytest.mark.parametrize("marks", [pytest.param(None, marks=gpu)])
def test_gpu_op_compiles_whole_and_replays_in_a_cuda_graph(marks):
    x = _x(64, 1024, device="cuda")
    want_q, want_s = fp8_rows(x, True)
    compiled = torch.compile(lambda t: fp8_rows_op(t * 1, True), fullgraph=True)
    q, s = compiled(x)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)
    static = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fp8_rows_op(static, True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_q, out_s = fp8_rows_op(static, True)
    static.copy_(2 * x)
    graph.replay()
    want_q, want_s = fp8_rows(2 * x, True)
    assert torch.equal(out_q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(out_s, want_s)

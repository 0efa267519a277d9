"""fp8-fast feed-forwards (``memory/fp8_feedforward.py``): which diffusers ``FeedForward``s take the fused forward, that
every other call is diffusers' own forward bit for bit, and that the fused path computes ``(q s) (Q s_W)^T + b``
with ``q, s`` the per-row quantization of diffusers' GELU output.

The fused math runs on the CPU too (``torch._scaled_mm`` has a CPU build; the rows come from the reference
quantization there): against the same formula in float64 from independent pieces (diffusers' GELU module, the
layer's dequantized weight). The ``gpu`` tests run the kernel and cuBLAS, captured and compiled, and an engine
built with ``fp8_e4m3fn_fast``. Guards: a hooked output layer (a LoRA term) or a non-tanh GELU never fused, the
fallback's bits, the fused output within bf16 rounding of the formula and within fp8 rounding of the dequantized
layer.
"""
import copy

import pytest
import torch
from diffusers.models.attention import FeedForward

from leandiffusion.kernels import fp8_rows as fr
from leandiffusion.memory import fp8_feedforward as ffm, fp8_matmul, fp8_weights as fp8
from leandiffusion.memory.load import build_engine

gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or not fp8_matmul.rows_supported("cuda"),
                                           reason="needs a CUDA GPU with per-row-scaled fp8 GEMMs")]
LAYER_BOUND = 0.05  # fp8 activation rounding (~2.6% rms per element) against the dequantizing layer


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _ff(dim=64, activation="gelu-approximate", fast=True, device="cpu", seed=0):
    torch.manual_seed(seed)
    ff = FeedForward(dim, dim, activation_fn=activation).to(device, torch.bfloat16).eval()
    fp8.quantize_module(ff, torch.bfloat16, fast=fast)
    return ff


def _x(rows=2, tokens=37, dim=64, device="cpu"):
    return torch.randn(rows, tokens, dim, generator=torch.Generator().manual_seed(1)).to(device, torch.bfloat16)


def _install(ff):
    ff.forward = ffm.types.MethodType(ffm.fused_forward, ff)
    return ff


def _formula(ff, x):
    """float64: diffusers' GELU module's output quantized per row by the rule of ``kernels.fp8_rows``, times the
    output layer's dequantized weight, plus its bias."""
    act, _, out = ff.net
    with torch.no_grad():
        g = act(x).reshape(-1, x.shape[-1] * 4).double()
    s = g.abs().amax(dim=1, keepdim=True) * (1 + 2 ** -7) / 448
    s = s.float().double()
    q = (g / s).float().to(torch.float8_e4m3fn).double()
    w = fp8.dequantize(out.weight_fp8, out.fp8_scale, torch.float64)
    return ((q * s) @ w.t() + out.bias.detach().double()).reshape(*x.shape[:-1], -1)


def test_eligible_feedforwards():
    assert ffm.eligible(_ff())
    assert not ffm.eligible(_ff(activation="gelu"))  # exact erf GELU: not this kernel's
    assert not ffm.eligible(_ff(fast=False))
    assert not ffm.eligible(FeedForward(64, 64, activation_fn="gelu-approximate"))  # bf16 output layer
    assert not ffm.eligible(_install(_ff()))  # an instance forward is already there


def test_rows_wider_than_one_kernel_program_are_not_eligible():
    torch.manual_seed(0)
    wide = FeedForward(16, 16, activation_fn="gelu-approximate", inner_dim=fr.MAX_ROW + 16).to(torch.bfloat16)
    fp8.quantize_module(wide, torch.bfloat16, fast=True)
    assert wide.net[2].fp8_fast and not ffm.eligible(wide)


def test_no_fusion_where_the_device_has_no_per_row_gemm_or_no_triton(monkeypatch):
    ff = _ff()
    assert ffm.fuse_feedforwards(ff, "cpu") == 0 and not ffm.is_fused(ff) and "forward" not in ff.__dict__
    monkeypatch.setattr(ffm, "rows_supported", lambda device: True)
    monkeypatch.setattr(ffm, "triton_unusable_reason", lambda device: "no Triton here")
    assert ffm.fuse_feedforwards(ff, "cuda") == 0 and "forward" not in ff.__dict__
    monkeypatch.setattr(ffm, "triton_unusable_reason", lambda device: None)
    assert ffm.fuse_feedforwards(ff, "cuda") == 1 and ffm.is_fused(ff)
    assert ffm.fuse_feedforwards(ff, "cuda") == 0  # installed once


def test_build_engine_fuses_nothing_without_fp8_tensor_cores():
    from leandiffusion.memory.engine import parts_from_components
    from leandiffusion.memory.tiny_qwen_image import build_tiny_qwen_image

    engine = build_engine(parts_from_components(build_tiny_qwen_image(seed=0)), "full",
                          weight_dtype="fp8_e4m3fn_fast", device="cpu")
    feeds = [m for m in engine.parts.unet.modules() if isinstance(m, FeedForward)]
    assert feeds and not any(ffm.is_fused(m) for m in feeds)


def test_installed_forward_is_diffusers_bit_for_bit_off_the_fused_path():
    ff, x = _ff(), _x()
    plain = copy.deepcopy(ff)
    _install(ff)
    assert ffm.is_fused(ff) and not ffm.fused_now(ff, x)  # a CPU input
    with torch.no_grad():
        assert torch.equal(ff(x), plain(x))


def test_fused_path_is_the_per_row_formula(monkeypatch):
    ff, x = _install(_ff()), _x()
    monkeypatch.setattr(ffm, "fused_now", lambda module, t: True)  # the CPU build of _scaled_mm, reference rows
    with torch.no_grad():
        got = ff(x)
        plain = FeedForward.forward(ff, x)  # dequantizing output layer
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert _rel(got, _formula(ff, x)) <= 1e-2  # bf16 output rounding
    assert 1e-4 < _rel(got, plain) <= LAYER_BOUND  # really quantized, within fp8 rounding


def test_hooks_dropout_or_a_plain_output_layer_keep_diffusers_path():
    ff = _install(_ff())
    assert ffm.layers_ready(ff)
    for module, hook in ((ff.net[2], "register_forward_hook"), (ff.net[2], "register_forward_pre_hook"),
                         (ff.net[0], "register_forward_pre_hook")):  # a LoRA term is a forward hook
        handle = getattr(module, hook)(lambda *a: None)
        assert not ffm.layers_ready(ff)
        handle.remove()
        assert ffm.layers_ready(ff)
    ff.net[1].p = 0.1
    ff.train()
    assert not ffm.layers_ready(ff)
    ff.eval()
    ff.net[2].fp8_fast = False
    assert not ffm.layers_ready(ff)


@pytest.mark.parametrize("marks", [pytest.param(None, marks=gpu)])
def test_gpu_fused_feedforward_is_the_formula_and_near_the_dequantized_layer(marks):
    ff, x = _ff(dim=3072, device="cuda"), _x(tokens=1000, dim=3072, device="cuda")
    plain = copy.deepcopy(ff)
    assert ffm.fuse_feedforwards(ff, "cuda") == 1 and ffm.fused_now(ff, x)
    with torch.no_grad():
        got, per_tensor = ff(x), plain(x)
        dequantized = FeedForward.forward(copy.deepcopy(plain).apply(_slow), x)
    print(f"fused vs dequantized {_rel(got, dequantized):.4f}, per tensor vs dequantized "
          f"{_rel(per_tensor, dequantized):.4f}")
    assert _rel(got, _formula(ff, x)) <= 1e-2
    assert _rel(got, dequantized) <= LAYER_BOUND and _rel(got, per_tensor) <= 2 * LAYER_BOUND
    hooked = ff.net[2].register_forward_hook(lambda m, a, out: out)
    try:
        with torch.no_grad():
            assert torch.equal(ff(x), per_tensor)  # diffusers' path: the per-tensor fast layer
    finally:
        hooked.remove()


def _slow(module):
    if isinstance(module, fp8.Fp8Linear):
        module.fp8_fast = False


@pytest.mark.parametrize("marks", [pytest.param(None, marks=gpu)])
def test_gpu_fused_feedforward_captures_and_compiles(marks):
    ff, x = _ff(dim=256, device="cuda"), _x(tokens=300, dim=256, device="cuda")
    ffm.fuse_feedforwards(ff, "cuda")
    with torch.no_grad():
        eager = ff(x)
        compiled = torch.compile(ff, fullgraph=True)(x)
        # one graph around the kernel; inductor quantizes the first layer's input in fp32 where eager rounds
        # ``x / s_x`` to bf16 first, which moves some fp8 values a step (measured 3.3e-2 at this size on an H200)
        assert _rel(compiled, eager) <= LAYER_BOUND
        static = x.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            ff(static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = ff(static)
        static.copy_(-x)
        graph.replay()
        assert torch.equal(out, ff(-x))


def test_module_constants_are_the_kernels():
    assert fp8_matmul.ACT_SCALE_FACTOR == fr.ACT_SCALE_FACTOR and fp8_matmul.MIN_ACT_SCALE == fr.MIN_ACT_SCALE

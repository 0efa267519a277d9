"""The fused GEGLU + LoRA-delta kernel equals its plain-torch reference (the unfused path) over odd shapes, ranks
and dtypes; the reference equals an fp64 formula.

Runs the Triton kernel on CPU tensors under ``TRITON_INTERPRET=1``; the ``gpu`` test repeats it on the device.
Guards: tail masks (M and N not multiples of the 64x64 tile), rank padding (4, 8 -> 16; 33 -> 64), the [a | g]
split and the [up_a ; up_g] row split (an off-by-N swaps gate and value: O(1) error), a strided ``h`` (a column
slice of a shared down projection), the rounding order (delta added before the gelu, in the activation dtype).
"""
import math
import os

import pytest
import torch

from leandiffusion.kernels import geglu_lora as gl
from leandiffusion.kernels.geglu_lora import geglu_lora, geglu_lora_reference, geglu_lora_triton

interpret = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or gl.triton is None,
                               reason="runs the Triton kernel on the CPU only under TRITON_INTERPRET=1")

# dtype -> (atol, rtol) of kernel vs reference. Both accumulate the delta in fp32 and round a, g, gelu and the
# product at the same points; they differ by the delta's summation order, which can flip one rounding of a' or g'
# (1 ulp: 2^-11 relative in fp16, 2^-8 in bf16) and so the product by ~2 ulp.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
SHAPES = [(1, 1), (37, 50), (70, 65), (128, 64), (5, 130)]  # (M, N half); the tile is 64 x 64
RANKS = [4, 8, 32, 64]
# Triton 3.9's CPU interpreter converts fp32 -> bfloat16 by truncation (about half of random values differ from
# torch's round-to-nearest, ``fp_downcast_rounding="rtne"`` does not help), so under the interpreter a bf16
# result can be up to one truncation per rounding point (4) away: a wider bound there, the table's on the GPU.
INTERPRETER_BF16 = (6e-2, 3e-2)


def _inputs(m, n, r, dtype, device="cpu", seed=0, strided_h=False):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(m, 2 * n, generator=g)
    h = torch.randn(m, r + 3 if strided_h else r, generator=g) / math.sqrt(r)
    up = torch.randn(2 * n, r, generator=g)
    p, h, up = (t.to(device, dtype) for t in (p, h, up))
    return p, (h[:, 1:r + 1] if strided_h else h), up


def _ref64(p, h, up):
    z = p.double() + h.double() @ up.double().t()
    a, gate = z.chunk(2, dim=-1)
    return a * 0.5 * gate * (1 + torch.erf(gate / math.sqrt(2)))


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("m,n", SHAPES[:3])
def test_reference_matches_float64_formula(m, n, dtype):
    p, h, up = _inputs(m, n, 8, dtype)
    got = geglu_lora_reference(p, h, up)
    assert got.dtype == dtype and got.shape == (m, n)
    atol, rtol = TOLERANCE[dtype]
    # the reference rounds a', g', gelu and the product: 4 roundings of O(1) values
    torch.testing.assert_close(got.double(), _ref64(p, h, up), atol=atol * 20, rtol=rtol * 4)


@interpret
@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("r", RANKS)
@pytest.mark.parametrize("m,n", SHAPES)
def test_triton_matches_reference(m, n, r, dtype):
    p, h, up = _inputs(m, n, r, dtype, strided_h=r == 8)
    ref = geglu_lora_reference(p, h, up)
    out = torch.full((m, n), float("nan"), dtype=dtype)
    tri = geglu_lora_triton(p, h, up, out=out)
    assert tri.data_ptr() == out.data_ptr() and not torch.isnan(out).any()  # every element written
    atol, rtol = INTERPRETER_BF16 if dtype == torch.bfloat16 else TOLERANCE[dtype]
    torch.testing.assert_close(tri, ref, atol=atol, rtol=rtol)


@interpret
def test_triton_odd_rank_and_strided_p():
    """Rank 33 pads to 64; ``p`` a column slice of a wider buffer (any strides)."""
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(19, 2 * 40 + 6, generator=g)
    p = wide[:, 3:83]
    h, up = torch.randn(19, 33, generator=g) / 6, torch.randn(80, 33, generator=g)
    torch.testing.assert_close(geglu_lora_triton(p, h, up), geglu_lora_reference(p, h, up), atol=1e-5, rtol=1e-5)


@interpret
def test_delta_split_is_value_then_gate():
    """up_a only moves the value half, up_g only the gate: zeroing one half of ``up`` must change the output the
    way the formula says (a swap of the halves would not)."""
    p, h, up = _inputs(9, 20, 4, torch.float32)
    up_a_only = up.clone()
    up_a_only[20:] = 0
    want = (p[:, :20] + h @ up[:20].t()) * torch.nn.functional.gelu(p[:, 20:])
    torch.testing.assert_close(geglu_lora_triton(p, h, up_a_only), want, atol=1e-5, rtol=1e-5)


def test_validation_errors():
    p, h, up = _inputs(4, 6, 4, torch.float32)
    with pytest.raises(ValueError, match="odd last dimension"):
        geglu_lora_reference(p[:, :11], h, up[:11])
    with pytest.raises(ValueError, match="do not chain"):
        geglu_lora_reference(p, h[:3], up)
    with pytest.raises(ValueError, match="do not chain"):  # ranks of h and up differ
        geglu_lora_triton(p, h, up[:, :3])
    with pytest.raises(ValueError, match="dtype"):
        geglu_lora_reference(p, h.double(), up)
    with pytest.raises(ValueError, match="out"):
        geglu_lora_reference(p, h, up, out=torch.empty(4, 5))
    with pytest.raises(ValueError, match="2-D"):
        geglu_lora_reference(p[None], h, up)
    with pytest.raises(ValueError, match="impl"):
        geglu_lora(p, h, up, impl="cuda")


def test_dispatcher_uses_reference_on_cpu_and_env_override(monkeypatch):
    calls = []
    monkeypatch.setattr(gl, "geglu_lora_triton", lambda *a, **k: calls.append("triton"))
    p, h, up = _inputs(4, 6, 4, torch.float32)
    monkeypatch.setenv(gl.IMPL.env_name, "auto")
    torch.testing.assert_close(geglu_lora(p, h, up), geglu_lora_reference(p, h, up), atol=0, rtol=0)
    assert calls == []  # CPU tensors -> reference
    monkeypatch.setenv(gl.IMPL.env_name, "triton")
    geglu_lora(p, h, up)
    assert calls == ["triton"]
    monkeypatch.setenv(gl.IMPL.env_name, "bogus")
    with pytest.raises(ValueError, match=gl.IMPL.env_name):
        gl.IMPL.resolve()


def test_dispatcher_under_torch_compile_takes_the_reference_unless_an_impl_is_forced(monkeypatch):
    """While ``torch.compile`` traces, ``auto`` is the reference (inductor fuses it), but ``impl=`` still wins
    (a forced ``impl="triton"`` must not silently run the reference under compile)."""
    calls = []
    monkeypatch.setattr(gl, "geglu_lora_triton", lambda *a, **k: calls.append("triton"))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setenv(gl.IMPL.env_name, "triton")  # not read while tracing
    p, h, up = _inputs(4, 6, 4, torch.float32)
    torch.testing.assert_close(geglu_lora(p, h, up), geglu_lora_reference(p, h, up), atol=0, rtol=0)
    assert calls == []
    geglu_lora(p, h, up, impl="triton")
    assert calls == ["triton"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("m,n,r", [(37, 50, 4), (70, 65, 33), (8192, 640, 32), (2048, 1280, 64)])
def test_gpu_kernel_matches_reference(m, n, r, dtype):
    p, h, up = _inputs(m, n, r, dtype, device="cuda", strided_h=True)
    ref = geglu_lora_reference(p, h, up)
    got = geglu_lora(p, h, up)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(got, ref, atol=atol, rtol=rtol)


# The reference's given output and the kernel entry's refusals.
def test_reference_writes_into_a_given_output():
    p, h, up = _inputs(5, 6, 4, torch.float32)
    out = torch.full((5, 6), float("nan"))
    assert geglu_lora_reference(p, h, up, out=out) is out
    torch.testing.assert_close(out, geglu_lora_reference(p, h, up), atol=0, rtol=0)


def test_triton_entry_refuses_what_it_cannot_run(monkeypatch):
    p, h, up = _inputs(4, 6, 4, torch.float32)
    with pytest.raises(ValueError, match=r"geglu_lora_triton supports float16, bfloat16 and float32, got "
                                         r"torch.float64; use geglu_lora_reference"):
        geglu_lora_triton(p.double(), h.double(), up.double())
    monkeypatch.setattr(gl, "triton", None)
    with pytest.raises(RuntimeError, match=r"geglu_lora_triton needs the 'triton' package; install triton or use "
                                           r"geglu_lora_reference"):
        geglu_lora_triton(p, h, up)


def test_triton_on_no_rows_returns_the_empty_output():
    p, h, up = _inputs(0, 6, 4, torch.float32)
    assert geglu_lora_triton(p, h, up).shape == (0, 6)


@interpret
def test_triton_rounds_value_and_gate_to_the_activation_dtype_before_the_product():
    """The module's rounding model in fp16, element by element: ``round(round(a + da) * round(gelu(round(g +
    dg))))``. The deltas (rank 1, ``h`` = 1) are exact in fp32 and under an ulp of ``p``, so only the roundings
    decide the result. Keeping ``a'`` or ``g'`` in fp32 differs from the model in about a third of the elements;
    the kernel differs in a few percent (by an ulp, where its fp32 erf and torch's fp64 one round the gelu
    differently)."""
    g = torch.Generator().manual_seed(0)
    m, n = 64, 64
    p = (torch.randn(m, 2 * n, generator=g) * 2).clamp(-3, 3).half()  # gelu stays a normal fp16 number
    h = torch.ones(m, 1).half()
    up = (torch.randn(2 * n, 1, generator=g) * 1e-3).half()
    a, gate = (p.double() + h.double() @ up.double().t()).chunk(2, dim=-1)
    a16, g16 = a.half().double(), gate.half().double()
    gelu16 = (0.5 * g16 * (1 + torch.erf(g16 / math.sqrt(2)))).half().double()
    model = (a16 * gelu16).half()
    got = geglu_lora_triton(p, h, up)
    differ = got != model
    assert differ.float().mean().item() <= 0.05
    # one ulp of the gelu factor moves the product by at most two of its own ulps
    ulp = torch.finfo(torch.float16).eps * model.double().abs().clamp_min(2 ** -14)
    assert ((got.double() - model.double()).abs() <= 2 * ulp).all()

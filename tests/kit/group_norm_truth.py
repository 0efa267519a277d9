"""GroupNorm by its definition in float64, computed apart from any kernel, and the error bound the GroupNorm kernel
tests hold (tests/kernels/test_group_norm*.py)."""
import torch

ULPS = {torch.float32: 2 ** -20, torch.float16: 2 ** -9, torch.bfloat16: 2 ** -6}  # 2-4 ulp, relative
# The interpreter truncates fp32 -> bf16 (see tests/kernels/test_geglu_lora.py) at each of the five rounding points
# (sum, mean, rstd, normalised value, SiLU): up to ~4 bf16 ulps there. A wrong channel, sample or tile is O(1) off.
INTERPRETER_ULPS = {**ULPS, torch.bfloat16: 2 ** -5}


def inputs(shape, dtype, device="cpu", offset=0.0, spread=3.0, seed=0):
    """``x`` (of ``spread`` about ``offset``), per-channel ``weight`` and ``bias``, a per-(sample, channel) ``add``."""
    g = torch.Generator().manual_seed(seed)
    c = shape[1]
    x = (torch.randn(shape, generator=g) * spread + offset).to(device, dtype)
    w = (1 + 0.5 * torch.randn(c, generator=g)).to(device, dtype)
    b = torch.randn(c, generator=g).to(device, dtype)
    add = (2 * torch.randn(shape[0], c, generator=g)).to(device, dtype)
    return x, w, b, add


def truth(x, groups, w, b, eps, add=None, silu=False):
    """Float64 GroupNorm by its definition (biased variance per (sample, group)), from the rounded input."""
    x = x.double()
    if add is not None:
        x = (x + add.double().reshape(x.shape[:2] + (1,) * (x.dim() - 2))).to(add.dtype).double()
    n, c = x.shape[:2]
    rows = x.reshape(n, groups, -1)
    mean, var = rows.mean(-1, keepdim=True), rows.var(-1, unbiased=False, keepdim=True)
    y = ((rows - mean) / torch.sqrt(var + eps)).reshape(x.shape)
    shape = (1, c) + (1,) * (x.dim() - 2)
    if w is not None:
        y = y * w.double().reshape(shape)
    if b is not None:
        y = y + b.double().reshape(shape)
    return y * torch.sigmoid(y) if silu else y


def assert_near(got, want, dtype, ulps=INTERPRETER_ULPS):
    """``got`` within ``ulps[dtype]`` of the output scale of ``want`` (float64), everywhere, and finite."""
    scale = float(want.abs().max())
    assert torch.isfinite(got).all()
    err = float((got.double() - want).abs().max())
    assert err <= ulps[dtype] * max(scale, 1.0), f"max error {err:.3g} at output scale {scale:.3g}"


def replay_error(group_norm, reference, memory_format=torch.contiguous_format) -> float:
    """A [2, 640, 40, 40] fp16 CUDA GroupNorm (+ add, SiLU) captured in a CUDA graph, its input overwritten, replayed:
    the largest error against ``reference`` on the new input, relative to the output's largest value (the kernels
    must read the static input at replay, not what they saw at capture)."""
    x, w, b, add = inputs((2, 640, 40, 40), torch.float16, device="cuda")
    static = x.clone(memory_format=memory_format)
    y = group_norm(static, 32, w, b, add=add, silu=True)  # compiles the kernels before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = group_norm(static, 32, w, b, add=add, silu=True)
    static.copy_(x * 2 - 1)
    graph.replay()
    torch.cuda.synchronize()
    want = reference(x * 2 - 1, 32, w, b, add=add, silu=True)
    return float((y.float() - want.float()).abs().max()) / float(want.abs().max())

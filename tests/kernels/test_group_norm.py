"""The GroupNorm kernels (``kernels/group_norm.py``) equal GroupNorm's definition, computed independently in float64,
within the output dtype's rounding; with ``add`` and ``silu`` they equal diffusers' resnet ops (add, norm, SiLU).

Runs the Triton kernels on CPU tensors under ``TRITON_INTERPRET=1``; the ``gpu`` tests repeat them on the device
against ``F.group_norm`` itself. Guards: rows spanning several tiles (the exact merge of the tile statistics), a
tail tile (masking), a large mean against a small spread (centred sums, no cancellation), the channel of each
element (weights per channel, rows of several channels, samples), the per-(sample, channel) addend, SiLU after the
rounded normalisation, no affine parameters, fp32 parameters with a half input, the dispatcher (the kernels only
for contiguous CUDA inputs, the reference under ``torch.compile``, on the CPU, and for strided inputs), errors
naming the bad argument, CUDA-graph capture.
"""
import os

import pytest
import torch
import torch.nn.functional as F

from leandiffusion.kernels import group_norm as gn
from leandiffusion.kernels.group_norm import BLOCK, MAX_TILES, group_norm, group_norm_reference, group_norm_triton
from leandiffusion.tests.kit.group_norm_truth import ULPS, assert_near, inputs, replay_error, truth

interpret = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or gn.triton is None,
                               reason="runs the Triton kernels on the CPU only under TRITON_INTERPRET=1")

# (shape, groups): one block; a row of several tiles with a tail (3 * BLOCK + 40 elements); several samples and
# channels per group with spatial tails; a 1-D spatial input; one channel per group
CASES = [((2, 8, 5, 7), 4), ((1, 2, 3 * BLOCK + 40), 1), ((3, 12, 33, 31), 3), ((2, 6, 11), 6)]
LONG_ROW = 2 * BLOCK * MAX_TILES + 40  # tiles of several blocks each (merged inside the program), a tail block


def test_reference_with_add_and_silu_is_diffusers_resnet_ops():
    x, w, b, add = inputs((2, 8, 5, 7), torch.float32)
    norm = torch.nn.GroupNorm(4, 8, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(w)
        norm.bias.copy_(b)
        want = torch.nn.SiLU()(norm(x + add[:, :, None, None]))
        assert torch.equal(group_norm_reference(x, 4, norm.weight, norm.bias, 1e-6, add=add, silu=True), want)
        assert torch.equal(group_norm_reference(x, 4, norm.weight, norm.bias, 1e-6), norm(x))


@interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape,groups", CASES)
@pytest.mark.parametrize("add,silu", [(False, False), (True, True), (False, True)])
def test_triton_matches_the_definition(shape, groups, dtype, add, silu):
    x, w, b, extra = inputs(shape, dtype)
    extra = extra if add else None
    got = group_norm_triton(x, groups, w, b, 1e-5, add=extra, silu=silu)
    assert got.shape == x.shape and got.dtype == dtype
    assert_near(got, truth(x, groups, w, b, 1e-5, extra, silu), dtype)


@interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_row_of_several_blocks_per_tile(dtype):
    x, w, b, add = inputs((1, 3, LONG_ROW), dtype)
    assert_near(group_norm_triton(x, 3, w, b, 1e-5, add=add, silu=True), truth(x, 3, w, b, 1e-5, add, True), dtype)


@interpret
def test_a_large_mean_against_a_small_spread_keeps_its_digits():
    # fp32 sums of squares about zero would cancel here (mean^2 / var = 1e8: the variance O(1) off, so the output
    # too); the tiles centre their sums. PyTorch's affine form x * (rstd w) + (b - mean rstd w) itself rounds at
    # |mean| rstd |w| ~ 2.5e4, a few 1e-3 absolute: the bound is 1e-3 of the output scale.
    x, w, b, _ = inputs((1, 2, LONG_ROW), torch.float32, offset=1000.0, spread=0.1)
    want = truth(x, 2, w, b, 1e-5)
    err = float((group_norm_triton(x, 2, w, b, 1e-5).double() - want).abs().max())
    assert err <= 1e-3 * float(want.abs().max())


@interpret
def test_no_affine_parameters_and_fp32_parameters_with_a_half_input():
    x, w, b, _ = inputs((2, 8, 9, 9), torch.float16)
    assert_near(group_norm_triton(x, 4), truth(x, 4, None, None, 1e-5), torch.float16)
    assert_near(group_norm_triton(x, 4, w.float(), b.float()), truth(x, 4, w.float(), b.float(), 1e-5),
                 torch.float16)


def test_dispatcher_takes_the_reference_on_the_cpu_and_for_stridedinputs(monkeypatch):
    calls = []
    monkeypatch.setattr(gn, "group_norm_triton", lambda *a, **k: calls.append(1))
    x, w, b, _ = inputs((2, 8, 5, 7), torch.float32)
    assert torch.equal(group_norm(x, 4, w, b), F.group_norm(x, 4, w, b))
    assert torch.equal(group_norm(x.transpose(2, 3), 4, w, b), F.group_norm(x.transpose(2, 3), 4, w, b))
    assert calls == []


def test_dispatcher_takes_the_reference_while_compiling(monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(gn, "group_norm_triton", lambda *a, **k: pytest.fail("kernel called while compiling"))
    x, w, b, _ = inputs((2, 8, 5, 7), torch.float32)
    assert torch.equal(group_norm(x, 4, w, b), F.group_norm(x, 4, w, b))


def test_environment_override_is_checked(monkeypatch):
    monkeypatch.setenv("LEANDIFFUSION_GROUP_NORM", "fastest")
    x, w, b, _ = inputs((2, 8, 5, 7), torch.float32)
    with pytest.raises(ValueError, match="LEANDIFFUSION_GROUP_NORM"):
        group_norm(x, 4, w, b)


def test_a_row_longer_than_the_kernels_index_is_refused(monkeypatch):
    monkeypatch.setattr(gn, "MAX_ROW", 69)
    x, w, b, _ = inputs((2, 8, 5, 7), torch.float32)
    with pytest.raises(ValueError, match="70 elements per"):
        group_norm_triton(x, 4, w, b)


@pytest.mark.parametrize("bad,match", [
    (dict(groups=3), "divisible by groups=3"),
    (dict(weight=torch.ones(5)), "weight has 5 elements"),
    (dict(add=torch.ones(2, 5)), "add has shape"),
])
def test_bad_arguments_are_named(bad, match):
    x, w, b, _ = inputs((2, 8, 5, 7), torch.float32)
    kw = dict(groups=4, weight=w, bias=b)
    kw.update(bad)
    with pytest.raises(ValueError, match=match):
        group_norm_reference(x, **kw)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape,groups", [((2, 320, 128, 128), 32), ((2, 1920, 32, 32), 32), ((1, 6, 70, 9), 3)]
                         + CASES)
def test_gpu_triton_matches_torch_group_norm(shape, groups, dtype):
    x, w, b, add = inputs(shape, dtype, device="cuda", offset=1.0)
    for extra, silu in ((None, False), (add, True)):
        want = group_norm_reference(x, groups, w, b, 1e-5, add=extra, silu=silu)
        got = group_norm(x, groups, w, b, 1e-5, add=extra, silu=silu)
        assert_near(got, want.double(), dtype, ULPS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_kernels_are_taken_and_replay_from_a_cuda_graph(monkeypatch):
    taken = []
    real = gn.group_norm_triton
    monkeypatch.setattr(gn, "group_norm_triton", lambda *a, **k: taken.append(1) or real(*a, **k))
    assert replay_error(group_norm, group_norm_reference) <= ULPS[torch.float16] and taken

"""The channels-last GroupNorm kernels (``kernels/group_norm_nhwc.py``, reached through ``kernels.group_norm``) equal
GroupNorm's definition, computed independently in float64, within the output dtype's rounding, and keep the
channels-last layout.

Runs the Triton kernels on CPU tensors under ``TRITON_INTERPRET=1``; the ``gpu`` tests repeat them on the device
against ``F.group_norm`` on the contiguous input, at SDXL's shapes. Guards: several spatial tiles with several blocks
each and a tail (the merge of the tile statistics), several channel blocks with a masked tail, groups spanning
channel blocks, statistic merges of several chunks, the per-(sample, channel) addend, SiLU, no affine parameters,
fp32 parameters with a half input, a large mean against a small spread, the dispatcher taking these kernels for a
channels-last CUDA input, CUDA-graph capture.
"""
import os

import pytest
import torch

from leandiffusion.kernels import group_norm as gn
from leandiffusion.kernels import group_norm_nhwc as nhwc
from leandiffusion.kernels.group_norm import group_norm, group_norm_reference, group_norm_triton
from leandiffusion.tests.kit.group_norm_truth import ULPS, assert_near, inputs, replay_error, truth

interpret = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or gn.triton is None,
                               reason="runs the Triton kernels on the CPU only under TRITON_INTERPRET=1")

CL = torch.channels_last
# (shape, groups): one block, groups of 2 channels; a channel tail (96 = 64 + 32) with groups of 3 channels across
# the channel blocks; 65 spatial blocks -> 33 tiles of 2 blocks with a tail, and 33 x 40 (tile, channel) statistics
# -> 2 merge chunks; one group of all channels
CASES = [((2, 8, 5, 7), 4), ((1, 96, 9, 11), 32), ((1, 80, 64, 65), 2), ((2, 70, 3, 3), 1)]


def _channels_last(*tensors):
    return tuple(t.contiguous(memory_format=CL) for t in tensors[:1]) + tensors[1:]


def test_the_cases_cover_what_the_docstring_claims():
    assert nhwc.triton is None or nhwc._launch_shape((1, 80, 64, 65), 2) == (4160, 33, 2, 2, 2)
    assert nhwc.triton is None or nhwc._launch_shape((1, 96, 9, 11), 32)[3] == 2


@interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape,groups", CASES)
@pytest.mark.parametrize("add,silu", [(False, False), (True, True)])
def test_triton_matches_the_definition(shape, groups, dtype, add, silu):
    x, w, b, extra = _channels_last(*inputs(shape, dtype))
    extra = extra if add else None
    got = group_norm_triton(x, groups, w, b, 1e-5, add=extra, silu=silu)
    assert got.shape == x.shape and got.dtype == dtype and got.is_contiguous(memory_format=CL)
    assert_near(got, truth(x, groups, w, b, 1e-5, extra, silu), dtype)


@interpret
def test_no_affine_parameters_fp32_parameters_and_a_large_mean():
    x, w, b, _ = _channels_last(*inputs((2, 8, 9, 9), torch.float16))
    assert_near(group_norm_triton(x, 4), truth(x, 4, None, None, 1e-5), torch.float16)
    assert_near(group_norm_triton(x, 4, w.float(), b.float()), truth(x, 4, w.float(), b.float(), 1e-5),
                torch.float16)
    # centred sums (mean^2 / var = 1e8): see tests/kernels/test_group_norm.py for the bound
    x, w, b, _ = _channels_last(*inputs((1, 80, 64, 65), torch.float32, offset=1000.0, spread=0.1))
    want = truth(x, 2, w, b, 1e-5)
    assert float((group_norm_triton(x, 2, w, b, 1e-5).double() - want).abs().max()) <= 1e-3 * float(want.abs().max())


def test_a_sample_longer_than_the_kernels_index_is_refused(monkeypatch):
    monkeypatch.setattr(gn, "MAX_ROW", 8 * 5 * 7 - 1)
    x, w, b, _ = _channels_last(*inputs((2, 8, 5, 7), torch.float32))
    with pytest.raises(ValueError, match="280 elements per"):
        group_norm_triton(x, 4, w, b)


def test_other_strides_are_refused_by_name():
    x, w, b, _ = inputs((2, 8, 5, 7), torch.float32)
    with pytest.raises(ValueError, match="contiguous or 4-D channels-last"):
        group_norm_triton(x.transpose(2, 3), 4, w, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape,groups", [((2, 320, 128, 128), 32), ((2, 1920, 32, 32), 32), ((2, 960, 64, 64), 32)]
                         + CASES)
def test_gpu_channels_last_matches_torch_group_norm(shape, groups, dtype, monkeypatch):
    taken = []
    real = nhwc.launch_channels_last
    monkeypatch.setattr(nhwc, "launch_channels_last", lambda *a: taken.append(1) or real(*a))
    x, w, b, add = inputs(shape, dtype, device="cuda", offset=1.0)
    for extra, silu in ((None, False), (add, True)):
        want = group_norm_reference(x, groups, w, b, 1e-5, add=extra, silu=silu)
        got = group_norm(x.contiguous(memory_format=CL), groups, w, b, 1e-5, add=extra, silu=silu)
        assert got.is_contiguous(memory_format=CL)
        assert_near(got, want.double(), dtype, ULPS)
    assert len(taken) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_channels_last_replays_from_a_cuda_graph(monkeypatch):
    taken = []
    real = nhwc.launch_channels_last
    monkeypatch.setattr(nhwc, "launch_channels_last", lambda *a: taken.append(1) or real(*a))
    assert replay_error(group_norm, group_norm_reference, CL) <= ULPS[torch.float16] and taken

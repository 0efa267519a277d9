"""``upscale.descriptor.Upscaler``: the facts the tiled runner sizes tiles and budgets from.

Guards: the weight and activation byte estimates follow the documented model
(``bytes_per_px * b * h * w`` plus input and output staging, ``b`` the element size of the run's dtype), and an
``Upscaler`` is immutable as its docstring promises. Expected numbers are written out by hand from that model.
"""
import dataclasses

import pytest
import torch

from leandiffusion.upscale.descriptor import Upscaler


def _upscaler(**kw) -> Upscaler:
    module = torch.nn.Conv2d(3, 5, 3)  # 3*5*9 weights + 5 biases = 140 parameters
    return Upscaler(module, "test", **{"scale": 4, "in_channels": 3, "out_channels": 3, "bytes_per_px": 100.0,
                                       **kw})


@pytest.mark.parametrize("dtype, size", [(torch.float16, 2), (torch.bfloat16, 2), (torch.float32, 4)])
def test_weight_bytes_are_parameters_times_the_element_size(dtype, size):
    assert _upscaler().param_count() == 140
    assert _upscaler().weight_bytes(dtype) == 140 * size


@pytest.mark.parametrize("dtype, b", [(torch.float16, 2), (torch.float32, 4)])
def test_work_bytes_follow_the_documented_model(dtype, b):
    # activations 100 channels per input pixel; staging: 3 input channels + 3 output channels at 4x4 pixels each
    up = _upscaler()
    assert up.work_bytes(10, 20, dtype) == (100 * b + (3 + 3 * 16) * b) * 10 * 20
    assert _upscaler(scale=2, out_channels=4).work_bytes(8, 8, dtype) == (100 * b + (3 + 4 * 4) * b) * 64


def test_an_upscaler_is_immutable():
    up = _upscaler()
    with pytest.raises(dataclasses.FrozenInstanceError):
        up.scale = 2


@pytest.mark.parametrize("default, expected", [(None, 4.0), (2.0, 2.0)])
def test_native_output_scale(default, expected):
    assert _upscaler(default_output_scale=default).native_output_scale == expected

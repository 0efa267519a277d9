"""``memory.plan.activation_bytes``: the UNet activation estimate, worked by hand on stand-in units.

Worked by hand because the policy tests compare plans with each other: a skip sum without the downsamplers'
outputs, a dropped fragmentation factor or the CUDA workspace counted on the CPU would pass them all.
"""
from types import SimpleNamespace

from leandiffusion.memory.plan import activation_bytes


def _unit(name, kind, out_numel):
    return SimpleNamespace(name=name, kind=kind, out_numel=out_numel)


UNITS = [
    _unit("down_blocks.0.resnets.0", "resnet", 1000),
    _unit("down_blocks.0.attentions.0.transformer_blocks.0", "transformer", 1000),
    _unit("down_blocks.0.downsamplers.0", "downsample", 250),
    _unit("mid_block.resnets.0", "resnet", 250),
    _unit("up_blocks.0.resnets.0", "resnet", 2000),
    _unit("up_blocks.0.upsamplers.0", "upsample", 4000),
]


def test_activation_estimate_by_hand():
    # skips: the down path's resnet and downsampler outputs (1000 + 250: a resnet and its attention leave one skip,
    # counted at the resnet); transient: the largest of 6 x 1000, 18 x 1000, 2 x 250, 6 x 250, 6 x 2000, 3 x 4000
    skips, transient = 1000 + 250, 18 * 1000
    assert activation_bytes(UNITS, 2, "cpu") == int(1.3 * (skips + transient) * 2)
    assert activation_bytes(UNITS, 4, "cuda") == int(1.3 * (skips + transient) * 4) + 576 * 2 ** 20
    assert activation_bytes([], 2, "cpu") == 0


def test_module_bytes_counts_the_run_dtype_by_hand():
    """The weights' size in the dtype they will run in, not the dtype they were built in
    (the CPU builds fp32 modules that CUDA runs in fp16); integer buffers are not parameters and do not count."""
    import torch

    from leandiffusion.memory.plan import module_bytes
    lin = torch.nn.Linear(300, 7)  # weight 2100 + bias 7 elements, each slot rounded up to 512 bytes
    assert module_bytes(lin, torch.float32) == 8704 + 512  # 8400 -> 8704, 28 -> 512
    assert module_bytes(lin, torch.float16) == 4608 + 512  # 4200 -> 4608, 14 -> 512
    assert module_bytes(lin.half(), torch.float32) == 8704 + 512
    assert module_bytes(torch.nn.ReLU(), torch.float16) == 0 and module_bytes(None, torch.float16) == 0

"""``vae/stats.py``: GroupNorm applied with given whole-image statistics, in half precision.

Guard: for an fp16 / bf16 band the statistics stay fp32 in the fused ``batch_norm`` (the module docstring); rounded to
the band's dtype, a group whose mean is large against its spread loses the spread (fp16 rounds a mean near 100 to 1/16):
reference: fp64 ``F.group_norm`` of the same values.
"""
import pytest
import torch
import torch.nn.functional as F

from leandiffusion.vae.stats import GroupStats, apply_group_norm


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_band_is_normalised_with_fp32_statistics(dtype):
    g = torch.Generator().manual_seed(0)
    shift = 100.0 + 3.0 * torch.rand(8, generator=g).view(1, 8, 1, 1)
    x = (torch.randn(1, 8, 16, 12, generator=g) + shift).to(dtype)
    weight, bias = 1 + 0.1 * torch.randn(8, generator=g), 0.1 * torch.randn(8, generator=g)
    stats = GroupStats(4)
    stats.add(x)
    got = apply_group_norm(x, stats, weight, bias, 1e-6)
    ref = F.group_norm(x.double(), 4, weight.double(), bias.double(), 1e-6)
    assert got.dtype == dtype
    # one rounding of the output (|out| < 4: 2^-9 fp16, 2^-6 bf16) and of x's own fp32 statistics
    assert (got.double() - ref).abs().max().item() <= 2 * torch.finfo(dtype).eps * 4

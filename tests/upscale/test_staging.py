"""Seam weights and the fp32 staging of kept tiles (``upscale.staging``).
"""
import pytest
import torch

from leandiffusion.upscale import staging
from leandiffusion.upscale.tiling import Span, axis_weights, plan_axis


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("weighted", [False, True])
def test_weighted_fp32_widens_then_multiplies_once_in_fp32(dtype, weighted):
    """What the CUDA stager downloads (``staging.weighted_fp32``): a new contiguous fp32 tensor, each element the
    tile's value times its seam weight rounded once to fp32 (fp64 reference), from a permuted, cropped view as
    ``_upscale_one`` passes it. A product taken in the model's dtype misses by ~1e-3 (fp16) / ~1e-2 (bf16)."""
    r, c = plan_axis(200, 36, 16)[1], plan_axis(200, 26, 16)[1]
    assert r.band_lo and r.band_hi and c.band_lo and c.band_hi  # inner spans: seams on all four sides
    h, w = (r.keep1 - r.keep0) * 2, (c.keep1 - c.keep0) * 2
    y = (0.5 + torch.rand(3, h + 4, w + 6, generator=torch.Generator().manual_seed(1))).to(dtype)
    tile = y[:, 2:2 + h, 4:4 + w].permute(1, 2, 0)
    weight = staging.seam_weight(r, c, 2, torch.device("cpu")) if weighted else None
    if weighted:
        assert weight.shape == (h, w, 1) and weight.dtype == torch.float32 and float(weight.min()) < 0.05
    got = staging.weighted_fp32(tile, weight)
    assert got.dtype == torch.float32 and got.is_contiguous() and got.data_ptr() != tile.data_ptr()
    want = tile.double() * (weight.double() if weighted else 1.0)
    assert torch.equal(got, want.float())


def test_seam_weight_is_none_without_seams_and_separable_with():
    spans = plan_axis(120, 48, 8)
    first, inner = spans[0], spans[1]
    assert staging.seam_weight(Span(0, 10, 0, 10, 0, 0), Span(0, 12, 0, 12, 0, 0), 4, torch.device("cpu")) is None
    w = staging.seam_weight(first, inner, 2, torch.device("cpu"))
    torch.testing.assert_close(w[..., 0], axis_weights(first, 2)[:, None] * axis_weights(inner, 2)[None, :],
                               atol=0, rtol=0)

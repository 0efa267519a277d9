"""The tile plan (``upscale.tiling``): cores partition the image, windows stay inside it and aligned, feather
weights sum to one, and the staging bounds hold every window and kept part.
"""
import pytest
import torch

from leandiffusion.upscale.tiling import axis_weights, largest_keep, largest_window, plan, plan_axis


@pytest.mark.parametrize("length,tile,overlap,m,min_window", [
    (100, 32, 8, 1, 1), (97, 40, 32, 1, 1), (128, 32, 0, 4, 1), (64, 64, 32, 1, 1), (250, 33, 30, 2, 1),
    (1000, 512, 32, 1, 1), (100, 32, 0, 1, 40), (100, 32, 8, 1, 64), (128, 32, 0, 4, 37), (40, 8, 0, 1, 40),
    (128, 32, 6, 4, 1), (90, 20, 5, 2, 1)])  # overlaps that are no multiple of m: rounded up, windows stay aligned
def test_plan_axis_invariants(length, tile, overlap, m, min_window):
    spans = plan_axis(length, tile, overlap, m, min_window)
    cover = torch.zeros(length * 3)
    o = -(-overlap // m) * m
    for i, s in enumerate(spans):
        assert 0 <= s.win0 <= s.keep0 < s.keep1 <= s.win1 <= length
        assert s.win0 % m == 0 and s.win1 % m == 0
        assert s.win1 - s.win0 >= min_window  # the model's smallest accepted side
        cover[s.keep0 * 3:s.keep1 * 3] += axis_weights(s, 3)
        if len(spans) > 1:
            assert s.keep1 - s.keep0 <= tile + m + o  # core (<= tile, rounded to m) plus the bands
            # context beyond the kept part on interior sides: at least 3/4 of the overlap
            if s.keep0 > 0:
                assert s.keep0 - s.win0 >= o - o // 4
            if s.keep1 < length:
                assert s.win1 - s.keep1 >= o - o // 4
    torch.testing.assert_close(cover, torch.ones_like(cover), atol=1e-6, rtol=0)
    if length <= tile:
        assert len(spans) == 1


@pytest.mark.parametrize("length,tile,overlap,m,want", [
    # n = ceil(L / t) cores, f = min(o // 4, shortest core // 2); kept = core +- f, window = core +- o (clipped)
    (100, 32, 8, 1, [(0, 27, 0, 33), (23, 52, 17, 58), (48, 77, 42, 83), (73, 100, 67, 100)]),  # cores of 25, f 2
    (97, 40, 32, 1, [(0, 40, 0, 64), (24, 73, 0, 97), (57, 97, 33, 97)]),  # cores 0|32|65|97, f = 32 // 4 = 8
    (64, 20, 40, 4, [(0, 24, 0, 56), (8, 40, 0, 64), (24, 56, 0, 64), (40, 64, 8, 64)]),  # f = 16 // 2 = 8
])
def test_plan_axis_feathers_the_documented_band(length, tile, overlap, m, want):
    """The module docstring's plan, computed by hand: neighbouring kept parts overlap by 2 f and are cross-faded
    there. Guards a plan without feathering (f = 0 still partitions the image, so the invariants above pass, but
    an RRDB seam is then a hard edge) and a band of the wrong width."""
    spans = plan_axis(length, tile, overlap, m)
    assert [(s.keep0, s.keep1, s.win0, s.win1) for s in spans] == want
    band = want[0][1] - want[1][0]
    assert [(s.band_lo, s.band_hi) for s in spans] == [(0, band)] + [(band, band)] * (len(want) - 2) + [(band, 0)]
    # ramp at output pixel centres (scale 2): w_right(j) = (j + 0.5) / (2 f s)
    ramp = (torch.arange(2 * band, dtype=torch.float64) + 0.5) / (2 * band)
    torch.testing.assert_close(axis_weights(spans[1], 2)[:2 * band].double(), ramp, atol=1e-7, rtol=0)
    torch.testing.assert_close(axis_weights(spans[0], 2)[-2 * band:].double(), 1 - ramp, atol=1e-7, rtol=0)


def test_staging_buffers_hold_every_window_and_kept_part_of_a_wide_image():
    """The CUDA stager sizes its pinned buffers from ``largest_window`` / ``largest_keep`` (rows, columns): every
    tile's window and kept part must fit them, and each bound is reached (40 x 200 px, 32 px tiles, overlap 8: by
    hand, row windows of 28 and kept rows of 22; column windows up to 29 + 2 * 8 = 45, kept columns up to 29 + 4)."""
    tiles = plan(40, 200, 32, 8)
    assert largest_window(tiles) == (28, 45) and largest_keep(tiles) == (22, 33)
    for span_of, bound in ((lambda s: s.win1 - s.win0, largest_window(tiles)),
                           (lambda s: s.keep1 - s.keep0, largest_keep(tiles))):
        assert all(span_of(r) <= bound[0] and span_of(c) <= bound[1] for r, c in tiles)
        assert max(span_of(r) for r, _ in tiles) == bound[0] and max(span_of(c) for _, c in tiles) == bound[1]

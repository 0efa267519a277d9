"""vae.estimated_stats: ``blend`` mode's statistics for the GroupNorm after a convolution.

Guards the math the estimate rests on: the group means of a convolution's output are exact (linearity: per-row
column sums of its input, the zero padding's missing rows and columns subtracted), whatever the bands and their
halo rows; the convolution runs at every ``s``-th column and nothing else changes (rows, halo algebra); the
variance is the samples' spread about the exact mean; the column stride samples only groups that hold many values.
"""
import pytest
import torch

from leandiffusion.vae.estimated_stats import MAX_STRIDE, MIN_SAMPLES, ColumnSampledConv, column_stride
from leandiffusion.vae.program import Op
from leandiffusion.vae.stats import GroupStats


def _conv(kernel: int, c_in: int = 6, c_out: int = 8, seed: int = 0) -> torch.nn.Conv2d:
    torch.manual_seed(seed)
    conv = torch.nn.Conv2d(c_in, c_out, kernel, padding=kernel // 2).double()
    torch.nn.init.normal_(conv.weight)
    torch.nn.init.normal_(conv.bias)
    return conv


def _bands(sampler: ColumnSampledConv, u: torch.Tensor, rows: int) -> list:
    """Feed ``u`` [1, C, H, W] through ``sampler`` band by band as the exact executor does: each band's rows plus
    the halo its convolution needs (``op.need``), the halo rows cropped from the output."""
    h = u.shape[2]
    outs = []
    for a in range(0, h, rows):
        b = min(a + rows, h)
        lo, hi = sampler.need(a, b, h)
        y, ylo = sampler.forward(u[:, :, lo:hi], lo, h)
        outs.append(y[:, :, a - ylo:b - ylo])
    return outs


@pytest.mark.parametrize("kernel", [1, 3])
@pytest.mark.parametrize("shape,rows", [((1, 6, 13, 11), 4), ((1, 6, 1, 9), 1), ((1, 6, 7, 1), 3), ((1, 6, 9, 2), 9)])
def test_group_means_are_exact_from_row_sums(kernel, shape, rows):
    """Uneven bands (halo rows seen twice), one-row and one-column maps, large channel offsets: the means from the
    row sums equal the fp64 mean of the full convolution's output."""
    conv = _conv(kernel)
    g = torch.Generator().manual_seed(1)
    u = torch.randn(shape, dtype=torch.float64, generator=g) + 50.0 * torch.randn(1, shape[1], 1, 1,
                                                                                  dtype=torch.float64, generator=g)
    sampler = ColumnSampledConv(Op("conv3" if kernel == 3 else "conv1", conv), shape[2], shape[3],
                                stride=3 if shape[3] >= 4 else 1)
    _bands(sampler, u, rows)
    with torch.no_grad():
        want = conv(u).mean(dim=(0, 2, 3))
    got = sampler.output_means()
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-9), (got - want).abs().max()


@pytest.mark.parametrize("stride", [1, 2, 3, 8])
def test_sampled_convolution_is_the_module_at_every_stride_th_column(stride):
    """Rows as the module computes them (its padding, the band's halo), columns s // 2, s // 2 + s, ... up to the
    second-to-last one (stride 1: every column): the sampled outputs are exactly the module's output there."""
    conv = _conv(3)
    u = torch.randn(1, 6, 10, 19, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    sampler = ColumnSampledConv(Op("conv3", conv), 10, 19, stride=stride)
    got = torch.cat(_bands(sampler, u, 3), dim=2)
    with torch.no_grad():
        full = conv(u)
        want = full if stride == 1 else full[:, :, :, stride // 2:full.shape[3] - 1:stride]
    assert got.shape == want.shape
    assert torch.allclose(got, want, rtol=0, atol=1e-12)


def test_estimate_is_the_samples_spread_about_the_exact_mean():
    conv = _conv(3, c_out=8)
    u = torch.randn(1, 6, 12, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) + 3.0
    sampler = ColumnSampledConv(Op("conv3", conv), 12, 16, stride=2)
    samples = GroupStats(4)
    for y in _bands(sampler, u, 5):
        samples.add(y)
    est = sampler.estimate(samples)
    with torch.no_grad():
        full = conv(u)
    mean = full.view(4, -1).mean(dim=1)
    sampled = full[:, :, :, 1:-1:2].reshape(4, -1)
    want_var = ((sampled - mean[:, None]) ** 2).mean(dim=1)
    assert torch.allclose(est.mean, mean, rtol=1e-12)
    assert torch.allclose(est.variance(), want_var, rtol=1e-6)  # GroupStats reduces each band in fp32
    # and it is an estimate of the whole map's variance, not something else: within 15% of it here
    assert ((est.variance() / full.view(4, -1).var(dim=1, correction=0)) - 1).abs().max().item() < 0.15


def test_column_stride_samples_only_large_groups_with_odd_strides():
    """Few values per group: every column; many: an odd stride up to MAX_STRIDE (an even stride samples one phase of
    the maps' 2x-upsampled column structure: a biased variance)."""
    assert MAX_STRIDE % 2 == 1
    assert column_stride(64, 32, 37, 45) == 1  # a latent-resolution map: 2 x 1665 values per group
    assert column_stride(64, 32, 296, 360) == MAX_STRIDE == 7  # 213120 values per group
    assert column_stride(32, 32, 148, 180) == 1  # 26640 values per group: a stride of 2 would leave too few
    assert column_stride(32, 32, 296, 180) == 3  # 53280 values per group: 3 of the 4 strides they allow
    assert column_stride(512, 32, 4096, 4096) == MAX_STRIDE
    assert column_stride(512, 32, 100000, 48) == 3  # at least 16 sampled columns
    assert column_stride(512, 32, 100000, 40) == 1
    assert MIN_SAMPLES * 3 <= 53280 < MIN_SAMPLES * 4


def test_refusals():
    with pytest.raises(ValueError, match="wraps a convolution op, got 'silu'"):
        ColumnSampledConv(Op("silu"), 4, 4, 1)
    with pytest.raises(ValueError, match="stride=0: expected 1, or a column stride that leaves a sampled column"):
        ColumnSampledConv(Op("conv3", _conv(3)), 4, 4, 0)
    with pytest.raises(ValueError, match="stride=5: .* of width 3"):
        ColumnSampledConv(Op("conv3", _conv(3)), 4, 3, 5)
    ColumnSampledConv(Op("conv3", _conv(3)), 4, 4, 3)  # column 1 (its neighbours 0 and 2 are real)
    sampler = ColumnSampledConv(Op("conv3", _conv(3)), 4, 4, 1)
    with pytest.raises(RuntimeError, match="saw no band"):
        sampler.output_means()
    with pytest.raises(RuntimeError, match="planned for 4x4"):
        sampler.forward(torch.zeros(1, 6, 4, 5, dtype=torch.float64), 0, 4)

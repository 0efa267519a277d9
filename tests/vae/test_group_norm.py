"""vae.group_norm: grid-wide GroupNorm statistics equal PyTorch's GroupNorm; the swap is scoped and lossless.

References are independent of the code under test: ``F.group_norm`` (PyTorch's kernel) and the same GroupNorm
evaluated in fp64. The CPU tests call the parallel math directly (the module only dispatches to it on CUDA) and
force the dispatch for a whole tiny-VAE decode; the GPU tests check the real dispatch on the full-size VAE.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

from leandiffusion.tests.kit import tiny_components
from leandiffusion.vae import group_norm as gn
from leandiffusion.vae.untiled import vae_decode, vae_encode


def _input(shape, dtype=torch.float32, seed=0, offset=3.0):
    g = torch.Generator().manual_seed(seed)
    # per-channel offsets larger than the spread: the case where a naive sum / sum-of-squares variance cancels
    shift = offset * torch.randn(shape[1], generator=g).view(1, -1, *([1] * (len(shape) - 2)))
    x = torch.randn(shape, generator=g) * 0.5 + shift
    return x.to(dtype)


def _affine(c, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (1 + 0.3 * torch.randn(c, generator=g)).to(dtype), (0.2 * torch.randn(c, generator=g)).to(dtype)


def _force_parallel(monkeypatch) -> list:
    """Take the parallel path wherever the layout allows (also on the CPU); returns the list of its input shapes."""
    calls = []
    real = gn.parallel_stats_group_norm

    def counted(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(gn, "takes_parallel_path", lambda x, groups, weight=None: gn.layout_supported(x))
    monkeypatch.setattr(gn, "parallel_stats_group_norm", counted)
    return calls


@pytest.mark.parametrize("shape,groups", [((1, 64, 40, 24), 32), ((3, 32, 17, 9), 8), ((2, 48, 300), 16),
                                          ((2, 8, 4, 5, 6), 4)])
@pytest.mark.parametrize("affine", [True, False])
def test_fp32_matches_pytorch_group_norm(shape, groups, affine):
    x = _input(shape)
    w, b = _affine(shape[1]) if affine else (None, None)
    ours = gn.parallel_stats_group_norm(x, groups, w, b, 1e-6)
    ref = F.group_norm(x.double(), groups, None if w is None else w.double(), None if b is None else b.double(), 1e-6)
    native = F.group_norm(x, groups, w, b, 1e-6)
    assert ours.shape == x.shape and ours.dtype == x.dtype
    assert (ours.double() - ref).abs().max().item() <= 1e-5
    assert (ours - native).abs().max().item() <= 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_is_as_accurate_as_pytorch(dtype):
    x = _input((2, 64, 32, 32), dtype)
    w, b = _affine(64, dtype)
    ref = F.group_norm(x.double(), 32, w.double(), b.double(), 1e-5)
    ours = gn.parallel_stats_group_norm(x, 32, w, b, 1e-5)
    native = F.group_norm(x.float(), 32, w.float(), b.float(), 1e-5).to(dtype)  # fp32 math, one final rounding
    err_ours = (ours.double() - ref).abs().max().item()
    err_native = (native.double() - ref).abs().max().item()
    ulp = torch.finfo(dtype).eps
    assert ours.dtype == dtype
    # statistics rounded to the input's dtype as PyTorch's own kernel stores them: a few output ulps at most
    assert err_ours <= err_native + 8 * ulp * ref.abs().max().item()


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 0.003), (torch.bfloat16, 0.02)])
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
def test_half_channel_means_far_from_zero_merge_without_rounding(layout, dtype, tol):
    """Channel means near 100 (fp16 spacing 0.0625, bf16 0.5) with per-channel offsets in a group: the group
    statistics must come from channel means kept in fp32; only the final group mean is rounded to the input's dtype,
    as PyTorch stores it. ``torch.var_mean`` returns the channel means in the input's dtype, and merging those puts
    the spread term off (from this reference, NCHW / channels-last: fp16 0.079 / 0.004, bf16 0.64 / 0.069; fp32
    channel means leave 0.0016 / 0.0015 and 0.012 / 0.011; the bounds are about 2 output ulps)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 64, 32, 32, generator=g) + 100 + 3 * torch.rand(64, generator=g).view(1, 64, 1, 1)
    x = x.to(dtype).contiguous(memory_format=layout)
    w, b = torch.ones(64, dtype=dtype), torch.zeros(64, dtype=dtype)
    rows = x.double().reshape(32, -1)
    mean, var = rows.mean(1, keepdim=True), rows.var(1, unbiased=False, keepdim=True)
    ref = ((rows - mean.to(dtype).double()) / (var + 1e-5).sqrt()).view(x.shape)
    ours = gn.parallel_stats_group_norm(x, 32, w, b, 1e-5)
    assert (ours.double() - ref).abs().max().item() <= tol


@pytest.mark.parametrize("spread", [400.0, 1e-3, 3e-3])
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
def test_fp16_spreads_beyond_a_half_variances_range(layout, spread):
    """The channel and group variances stay fp32 (PyTorch's kernel keeps only ``rstd``). Kept in fp16 (``torch.var`` of
    a half tensor, or the group variance rounded to the input's dtype before normalising), a spread of 400 overflows the
    variance (160000 > 65504) to inf and normalises every group to its bias (6.2 off this reference); spreads of 0.001 /
    0.003 make it subnormal (0.042 / 0.0098 off, NCHW; 0.025 / 0.0067 channels-last). With the variance in fp32 the
    error is at most 0.0027 (F.group_norm's own: 0.0019); outputs reach 5.8, so the bound is one output ulp. Reference:
    fp64 GroupNorm with the group mean rounded to fp16 as PyTorch stores it."""
    g = torch.Generator().manual_seed(0)
    x = (spread * torch.randn(1, 64, 32, 32, generator=g)).half().contiguous(memory_format=layout)
    w, b = (t.half() for t in _affine(64))
    rows = x.double().reshape(32, -1)
    mean, var = rows.mean(1, keepdim=True), rows.var(1, unbiased=False, keepdim=True)
    ref = ((rows - mean.half().double()) / (var + 1e-6).sqrt()).view(x.shape) * w.double().view(1, -1, 1, 1) \
        + b.double().view(1, -1, 1, 1)
    ours = gn.parallel_stats_group_norm(x, 32, w, b, 1e-6)
    assert (ours.double() - ref).abs().max().item() <= 4e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_channels_last_image_keeps_its_layout(dtype):
    x = _input((1, 64, 33, 20), dtype).contiguous(memory_format=torch.channels_last)
    w, b = _affine(64, dtype)
    ours = gn.parallel_stats_group_norm(x, 32, w, b, 1e-6)
    ref = gn.parallel_stats_group_norm(x.contiguous(), 32, w, b, 1e-6)
    assert ours.is_contiguous(memory_format=torch.channels_last)
    if dtype == torch.float32:
        assert torch.allclose(ours, ref, atol=1e-5)
    else:  # two low-precision roundings of the statistics: each against fp64 (channels-last merges in fp32)
        exact = F.group_norm(x.double(), 32, w.double(), b.double(), 1e-6)
        err_cl, err_contiguous = ((t.double() - exact).abs().max().item() for t in (ours, ref))
        assert err_cl <= 1.5 * err_contiguous, (err_cl, err_contiguous)


def test_refusals_name_the_problem():
    with pytest.raises(ValueError, match="do not split into 32 groups"):
        gn.parallel_stats_group_norm(torch.zeros(1, 48, 4, 4), 32, None, None, 1e-6)
    batch_cl = torch.zeros(2, 32, 4, 4).contiguous(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="unsupported layout"):
        gn.parallel_stats_group_norm(batch_cl, 8, None, None, 1e-6)
    assert not gn.layout_supported(batch_cl) and not gn.layout_supported(torch.zeros(4, 4).t()[None])


def test_dispatch_only_for_long_contiguous_cuda_rows():
    x = torch.zeros(1, 32, 512, 512)  # long rows, but on the CPU
    assert not gn.takes_parallel_path(x, 32)
    assert not gn.takes_parallel_path(torch.zeros(1, 32, 4, 4, device="meta"), 32)


def test_scope_swaps_only_plain_group_norms_and_restores_them():
    class Custom(torch.nn.GroupNorm):
        pass

    model = torch.nn.Sequential(torch.nn.GroupNorm(2, 4), torch.nn.Conv2d(4, 4, 1), Custom(2, 4))
    state = copy.deepcopy(model.state_dict())
    with gn.parallel_group_norms(model):
        assert type(model[0]) is gn.ParallelStatsGroupNorm and isinstance(model[0], torch.nn.GroupNorm)
        assert type(model[2]) is Custom  # subclasses keep their own forward
    assert type(model[0]) is torch.nn.GroupNorm
    with pytest.raises(RuntimeError, match="interrupted"):
        with gn.parallel_group_norms(model):
            raise RuntimeError("interrupted")
    assert type(model[0]) is torch.nn.GroupNorm
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


@pytest.mark.gpu
def test_dispatch_threshold_is_inclusive_on_gpu():
    """Exactly ``MIN_GROUP_ELEMENTS`` per (sample, group) row takes the parallel path, one fewer does not (``>=``, not
    ``>``; like the affine check below, only a CUDA tensor reaches these checks)."""
    rows = gn.MIN_GROUP_ELEMENTS
    assert gn.takes_parallel_path(torch.empty(2, 64, rows // 512, 256, device="cuda"), 32)
    assert not gn.takes_parallel_path(torch.empty(2, 64, rows // 2 - 1, device="cuda"), 32)
    # affine parameters wider than the input (PyTorch then keeps fp32 statistics) stay native
    x = torch.empty(1, 64, rows // 512, 256, device="cuda", dtype=torch.float16)
    assert gn.takes_parallel_path(x, 32, torch.ones(64, device="cuda", dtype=torch.float16))
    assert not gn.takes_parallel_path(x, 32, torch.ones(64, device="cuda"))


@pytest.mark.gpu
def test_half_statistics_are_rounded_as_pytorchs_cuda_kernel_rounds_them():
    """PyTorch's CUDA GroupNorm stores a half input's mean (and rstd) in half (``RowwiseMomentsCUDAKernel``); a
    group whose mean is large against its spread then loses ~1/16 of its spread, and the parallel path must round
    the same way (fp32 statistics are closer to fp64 but 0.05 away from PyTorch's own output; half *channel* means,
    merged, 0.080: see ``test_half_channel_means_far_from_zero_merge_without_rounding``)."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(1, 64, 32, 32, generator=g) + 100 + 3 * torch.rand(64, generator=g).view(1, 64, 1, 1))
    x = x.half().cuda()
    w, b = torch.ones(64, device="cuda", dtype=torch.float16), torch.zeros(64, device="cuda", dtype=torch.float16)
    native = F.group_norm(x, 32, w, b, 1e-5).double()
    exact = F.group_norm(x.double(), 32, w.double(), b.double(), 1e-5)
    assert (native - exact).abs().max().item() > 0.02  # PyTorch's kernel really rounds the mean here
    ours = gn.parallel_stats_group_norm(x, 32, w, b, 1e-5).double()
    assert (ours - native).abs().max().item() <= 0.01


@pytest.mark.parametrize("batch", [1, 2])
def test_forced_parallel_path_decodes_a_tiny_vae_like_diffusers(monkeypatch, batch):
    """Every GroupNorm whose layout the parallel path reads goes through it (all of them for one image: the blocks
    after the attention run channels-last); the decode matches diffusers' own."""
    vae = tiny_components("sdxl")["vae"].float().eval()
    z = torch.randn(batch, vae.config.latent_channels, 12, 10, generator=torch.Generator().manual_seed(3))
    n_norms = sum(type(m) is torch.nn.GroupNorm for m in vae.decoder.modules())
    with torch.no_grad():
        ref = vae.decode(z, return_dict=False)[0]  # diffusers with PyTorch's GroupNorm
        calls = _force_parallel(monkeypatch)
        with gn.parallel_group_norms(vae):
            ours = vae.decode(z, return_dict=False)[0]
    if batch == 1:
        assert len(calls) == n_norms > 0
    else:
        assert 0 < len(calls) < n_norms  # channels-last batches stay native
    assert (ours - ref).abs().max().item() <= 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_full_size_vae_decode_on_gpu(dtype):
    """Real dispatch on the full-size SD/SDXL VAE at 1024 px (the rows that take the parallel path): the decode is as
    close to the fp64 decode (PyTorch's GroupNorm) as diffusers' own decode in the same dtype is.

    As in ``test_gpu.py``: both fast decodes round (TF32 convolutions, fp16), so each is measured against fp64 and
    ours must satisfy ``err <= 2 * err_native + floor`` (floor: one 8-bit level of the [-1, 1] image range, 2/255).
    A wrong statistic (a group mixed with its neighbour, a wrong variance) moves whole channels, far above that."""
    from leandiffusion.bench.models import full_vae

    vae = full_vae(device="cuda", dtype=dtype)
    z = torch.randn(1, 4, 128, 128, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    taken = []
    real = gn.takes_parallel_path

    def spy(x, groups, weight=None):
        taken.append(real(x, groups, weight))
        return taken[-1]

    with torch.no_grad():
        native = vae.decode(z.to(dtype), return_dict=False)[0].double()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(gn, "takes_parallel_path", spy)
            with gn.parallel_group_norms(vae):
                ours = vae.decode(z.to(dtype), return_dict=False)[0].double()
        ref = vae.double().decode(z.double(), return_dict=False)[0]
    assert len(taken) >= 20 and all(taken)  # at 1024 px every decoder row reaches MIN_GROUP_ELEMENTS
    err_native = (native - ref).abs().max().item()
    err_ours = (ours - ref).abs().max().item()
    assert err_ours <= 2 * err_native + 2 / 255, (err_ours, err_native)
    assert type(vae.decoder.conv_norm_out) is torch.nn.GroupNorm


def test_engine_and_stream_decodes_run_inside_the_swap(monkeypatch):
    """``vae.untiled.vae_decode`` / ``vae_encode`` and the Stream Scheduler's untiled decode take the swapped
    GroupNorm (forced here on the CPU), and their images still match diffusers' plain decode."""
    from leandiffusion.sampling.stream.scheduler import run_stream
    from leandiffusion.sampling.stream.settings import StreamSettings
    from leandiffusion.tests.kit import tiny_engine

    engine = tiny_engine("sd1")
    vae = engine.parts.vae
    z = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = (vae.decode(z, return_dict=False)[0] / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1)
    calls = _force_parallel(monkeypatch)
    with engine.session("vae"):
        image = vae_decode(engine, z)
    assert calls and (image - plain).abs().max().item() <= 1e-4
    calls.clear()
    with engine.session("vae"):
        vae_encode(engine, image)
    assert calls
    calls.clear()
    settings = StreamSettings.from_text("a cat", negative="", seed=3, steps=2, cfg=5.0, width=64, height=64)
    result = run_stream(engine, settings, quiet=True)
    assert calls and result.images.shape == (1, 64, 64, 3)
    assert all(type(m) is torch.nn.GroupNorm for m in vae.modules() if isinstance(m, torch.nn.GroupNorm))


@pytest.mark.parametrize("mean,spread", [(0.5, 0.05), (0.7, 1e-3), (3.0, 0.01)])
def test_cpu_channels_last_input_is_normalised_as_accurately_as_nchw(mean, spread):
    """Issue 41 item 8: PyTorch's CPU GroupNorm loses a channels-last input's variance to cancellation when the
    group's mean is large against its spread (torch 2.13: 2.0e-4, 0.46 and 0.17 off fp64 in these three cases
    without the affine parameters; the NCHW kernel stays within 6e-5). The untiled CPU encode hands it exactly that
    (an IMAGE's permute is a channels-last view), so inside the swap such an input is normalised as an NCHW copy."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(1, 64, 37, 45, generator=g, dtype=torch.float64) * spread + mean).float()
    x = x.contiguous(memory_format=torch.channels_last)
    norm = torch.nn.GroupNorm(32, 64, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(_affine(64)[0])
        norm.bias.copy_(_affine(64)[1])
        with gn.parallel_group_norms(norm):
            out = norm(x)
        ref = F.group_norm(x.double(), 32, norm.weight.double(), norm.bias.double(), 1e-6)
    assert (out.double() - ref).abs().max().item() <= 1e-4
    assert type(norm) is torch.nn.GroupNorm  # restored

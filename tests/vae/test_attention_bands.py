"""The VAE attention in bands (``vae.attention_bands``): equal to the block's own forward in fp64 for both schemes and
any band height, the planner's choice, and a device-memory peak that stays within the plan's estimate at full size.

The bug it guards: an exact tiler that runs the mid-block attention on the whole map holds its normalised input, q, k,
v and output (five map-sized tensors), a floor under any activation budget: about 0.9 GiB at 2048 px and 3.0 GiB at
4096 px in fp32, whatever the budget asked.
"""
import pytest
import torch

from leandiffusion.tests.vae.live_bytes import LiveBytes
from leandiffusion.vae import attention_bands
from leandiffusion.vae.attention import run_attention, spec_from_diffusers
from leandiffusion.vae.attention_bands import (HALF_ONLINE_MIN_TOKENS, RESIDENT, STREAMED, BandPlan, MapCost,
                                               online_steps, plan_bands, prefers_online, resident_bytes, run_banded,
                                               streamed_bytes)
from leandiffusion.vae.stats import GroupStats
from leandiffusion.vae.stores import DeviceStore, HostStore, Streams

GiB = 2 ** 30
CPU = torch.device("cpu")


def _block(channels=64, heads=1, rescale=1.0, groups=8, seed=0):
    from diffusers.models.attention_processor import Attention

    torch.manual_seed(seed)
    attn = Attention(channels, heads=heads, dim_head=channels // heads, rescale_output_factor=rescale,
                     eps=1e-6, norm_num_groups=groups, spatial_norm_dim=None, residual_connection=True, bias=True,
                     upcast_softmax=True, _from_deprecated_attn_block=True).eval().requires_grad_(False)
    with torch.no_grad():
        for p in attn.parameters():  # scores of a few units, as in a trained VAE (random init gives ~0)
            p.normal_(0.0, 0.2 if p.ndim > 1 else 0.5)
    return attn


def _store(x_chw: torch.Tensor, on_device: bool):
    c, h, w = x_chw.shape
    hwc = x_chw.permute(1, 2, 0).contiguous()
    streams = Streams(CPU)
    if on_device:
        store = DeviceStore(h, w, c, hwc.dtype, CPU, streams)
        store.data.copy_(hwc)
        return store
    return HostStore(h, w, c, hwc.dtype, CPU, streams, data=hwc)


def _banded(attn, x, band_plan, on_device=True):
    """The block on ``x`` [1, C, H, W] through ``run_banded``, assembled into [1, C, H, W]."""
    spec = spec_from_diffusers(attn)
    stats = GroupStats(attn.group_norm.num_groups)
    stats.add(x)
    out = torch.full_like(x, float("nan"))
    seen = []

    def sink(a, y):
        seen.append((a, y.shape[2]))
        out[:, :, a:a + y.shape[2]] = y

    run_banded(spec, _store(x[0], on_device).prefetch, stats, tuple(x.shape[1:]), band_plan, sink, x.dtype)
    return out, seen


@pytest.mark.parametrize("scheme,online", [(RESIDENT, False), (RESIDENT, True), (STREAMED, False)])
@pytest.mark.parametrize("rows", [1, 3, 7])  # 7 rows = one band; 3 does not divide 7
@pytest.mark.parametrize("heads,rescale,on_device", [(1, 1.0, True), (2, 2.0, False)])
def test_banded_attention_equals_the_block_in_fp64(scheme, online, rows, heads, rescale, on_device):
    attn = _block(heads=heads, rescale=rescale)
    x = torch.randn(1, 64, 7, 5, dtype=torch.float64) * 3 + 1
    with torch.no_grad():
        ref = attn.double()(x)
        attn.float()
    got, seen = _banded(attn, x.float(), BandPlan(scheme, rows, 0, online), on_device)
    assert seen == [(a, min(rows, 7 - a)) for a in range(0, 7, rows)]  # every row once, in order
    scale = ref.abs().max().item()
    err = (got.double() - ref).abs().max().item()
    assert err <= 2e-6 * scale, (scheme, rows, err, scale)
    # the whole-map block the executor ran before agrees as closely
    whole = run_attention(spec_from_diffusers(attn), x.float())
    assert (whole.double() - ref).abs().max().item() <= 2e-6 * scale


@pytest.mark.parametrize("scheme,online", [(RESIDENT, True), (STREAMED, False)])
def test_online_softmax_survives_scores_far_apart(scheme, online):
    """The online merge rescales earlier chunks when a later chunk holds a larger score; with scores hundreds
    apart (e^-300 underflows) a merge without the running maximum gives NaN or zeros."""
    attn = _block(seed=1)
    with torch.no_grad():
        attn.to_q.weight.mul_(12.0)
    x = torch.randn(1, 64, 6, 4, dtype=torch.float64)
    x[..., 5, :] += 4.0  # the last rows' keys score far above the others
    with torch.no_grad():
        ref = attn.double()(x)
        attn.float()
    got, _ = _banded(attn, x.float(), BandPlan(scheme, 2, 0, online))
    assert torch.isfinite(got).all()
    assert (got.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


SDXL_2048 = MapCost(512, 256, 256, 4, 4, True)  # the SD / SDXL VAE mid block at 2048 px, fp32


def test_online_softmax_of_rows_whose_every_score_is_far_below_zero():
    """The running maximum starts at -inf, not 0 (the other tests' scores reach above zero, so 0 would pass them): with
    0, a row whose scores all lie below about -104 sums ``e^(s - 0)`` to 0 in fp32 and divides 0 by 0. Scores near -1000
    in three chunks against fp64 softmax attention."""
    gen = torch.Generator().manual_seed(0)
    d = 16
    k = 1.0 + 0.01 * torch.randn(1, 1, 12, d, generator=gen, dtype=torch.float64)
    v = torch.randn(1, 1, 12, d, generator=gen, dtype=torch.float64)
    q = -250.0 * (1.0 + 0.1 * torch.randn(1, 1, 5, d, generator=gen, dtype=torch.float64))
    q, k, v = (t.float().double() for t in (q, k, v))  # the fp32 inputs, exactly
    scores = q @ k.transpose(-1, -2) / d ** 0.5
    assert scores.max() < -500
    ref = torch.softmax(scores, dim=-1) @ v
    chunks = [(k[:, :, a:a + 4].float(), v[:, :, a:a + 4].float()) for a in range(0, 12, 4)]
    got = attention_bands._online_attention(q.float(), chunks, False)
    assert torch.isfinite(got).all()
    assert (got.double() - ref).abs().max() <= 1e-3  # fp32 scores near -1000 round by ~6e-5 (measured 4.7e-5)


def test_plan_takes_resident_bands_when_keys_and_values_fit():
    whole = resident_bytes(SDXL_2048, 256)
    assert plan_bands(SDXL_2048, whole) == BandPlan(RESIDENT, 256, whole)
    p = plan_bands(SDXL_2048, int(0.4 * GiB))  # keys + values: 256 MiB
    assert p.scheme == RESIDENT and p.estimate <= 0.4 * GiB < resident_bytes(SDXL_2048, p.rows + 1)
    assert plan_bands(SDXL_2048, int(0.4 * GiB), max_rows=5).rows == 5


def test_plan_streams_below_the_keys_and_values():
    budget = int(0.2 * GiB)
    assert resident_bytes(SDXL_2048, 1) > budget
    p = plan_bands(SDXL_2048, budget)
    assert p.scheme == STREAMED and p.estimate <= budget < streamed_bytes(SDXL_2048, p.rows + 1)
    tiny = plan_bands(SDXL_2048, 1)  # nothing fits: the smallest bands, the out-of-memory error is the caller's
    assert tiny.scheme == STREAMED and tiny.rows == 1


def test_online_plan_weighs_band_count_against_recomputed_projections():
    """With the online form both schemes run ``bands^2`` chunk steps; ``streamed`` also recomputes the key/value
    projections per query band. Resident keys with tiny bands lose to streamed ones with large bands; with bands as
    large as streamed's, resident wins (no recomputation)."""
    cost = MapCost(512, 512, 512, 4, 4, True)  # fp32 at 4096 px: keys + values 1 GiB
    kv = 2 * 512 * 512 * 512 * 4
    roomy = plan_bands(cost, kv + int(0.5 * GiB), online=True)
    assert roomy.scheme == RESIDENT and roomy.online
    assert roomy.rows >= plan_bands(cost, int(0.5 * GiB), online=True).rows
    squeezed = plan_bands(cost, kv + 40 * 2**20, online=True)  # resident bands of a few rows only
    assert squeezed.scheme == STREAMED
    resident_rows = plan_bands(cost, kv + 40 * 2**20).rows  # (without online: resident, SDPA)
    assert online_steps(cost, resident_rows, False) > online_steps(cost, squeezed.rows, True)
    assert not plan_bands(cost, 10 * GiB).online and plan_bands(cost, 10 * GiB).scheme == RESIDENT


def test_online_steps_count_a_short_last_band():
    """The plan tests use band heights that divide the map, so counting ``H // rows`` bands (the short last band
    dropped) would pass them. 10 rows in bands of 3 are 4 bands: 16 chunk steps, plus the key/value projection pass
    (``H W C^2 bytes / 2^32`` steps) once resident and once per query band streamed."""
    cost = MapCost(512, 10, 4, 4, 4, True)
    projection = 10 * 4 * 512 ** 2 * 4 / 2 ** 32
    assert online_steps(cost, 3, False) == pytest.approx(16 + projection, rel=1e-12)
    assert online_steps(cost, 3, True) == pytest.approx(16 + 4 * projection, rel=1e-12)
    assert online_steps(cost, 10, True) == pytest.approx(1 + projection, rel=1e-12)


def test_online_form_is_chosen_by_dtype_device_and_map_size():
    """fp32 follows the convolutions' TF32 setting; half precision takes the online form above a 2048 px image's
    map (256 x 256) only, where PyTorch's memory-efficient kernel for the 512-channel head stops winning, and only
    for heads too wide for the flash kernels; the CPU never (no TF32 there)."""
    fp16 = lambda side: MapCost(512, side, side, 2, 2, True)  # noqa: E731
    assert prefers_online(MapCost(512, 128, 128, 4, 4, True), True, True)
    assert not prefers_online(MapCost(512, 512, 512, 4, 4, True), True, False)  # strict fp32
    assert not prefers_online(fp16(256), True, True)
    assert prefers_online(fp16(257), True, True) and prefers_online(fp16(512), True, False)
    assert not prefers_online(fp16(512), False, True) and not prefers_online(MapCost(512, 512, 512, 4, 4, True),
                                                                             False, True)
    assert HALF_ONLINE_MIN_TOKENS == 256 * 256
    # heads the flash kernels take (<= 256 channels each) keep SDPA at any size
    assert not prefers_online(MapCost(512, 512, 512, 2, 2, True, heads=2), True, True)
    assert prefers_online(MapCost(1024, 512, 512, 2, 2, True, heads=2), True, True)


def _o_n_sdpa(q, k, v, tf32=False):
    """What CUDA runs for the resident scheme (PyTorch's memory-efficient kernel, O(N) memory): the output only.
    The CPU fallback's chunked score matrices are not what a CUDA budget has to hold."""
    return torch.empty_like(q)


@pytest.mark.parametrize("dtype,px,budget_gib,online,scheme", [
    (torch.float32, 2048, 0.5, False, RESIDENT),  # the whole-map block would hold ~0.9 GiB
    (torch.float32, 2048, 0.5, True, RESIDENT),
    (torch.float32, 2048, 0.15, False, STREAMED),
    (torch.float16, 4096, 0.6, False, RESIDENT),  # keys + values 0.5 GiB
    (torch.float16, 4096, 1.0, True, RESIDENT),  # half maps this large take the online form (prefers_online)
    (torch.float16, 4096, 0.3, True, STREAMED),
    (torch.float32, 4096, 0.4, True, STREAMED),  # the whole-map block would hold ~3.0 GiB
    (torch.float32, 4096, 1.6, True, RESIDENT),
])
@pytest.mark.parametrize("on_device", [True, False])
def test_full_size_peak_stays_within_the_estimate(monkeypatch, dtype, px, budget_gib, online, scheme, on_device):
    """Every tensor the attention stage holds at once, counted on the ``meta`` device at full size (SD / SDXL mid
    block: 512 channels at 1/8 of the image), fits the plan's estimate, which fits the budget, and is far below
    what the whole-map block holds."""
    attn, band_plan, live = _meta_peak(monkeypatch, dtype, px, budget_gib, online, on_device)
    assert (band_plan.scheme, band_plan.online) == (scheme, online and scheme == RESIDENT)
    assert live.peak <= band_plan.estimate <= budget_gib * GiB, (band_plan, live.peak / GiB, live.peak_op)
    n = px // 8
    whole = LiveBytes("meta", exclude=list(attn.parameters()))
    x = torch.empty((1, 512, n, n), dtype=dtype, device="meta")
    with whole:
        run_attention(spec_from_diffusers(attn), x)
    assert whole.peak > band_plan.estimate


def _meta_peak(monkeypatch, dtype, px, budget_gib, online, on_device, heads=1):
    """The plan for the SD / SDXL mid block (512 channels, ``heads`` heads) at ``px`` image pixels, and the bytes the
    attention stage held at once running it on the ``meta`` device at full size."""
    monkeypatch.setattr(attention_bands, "_sdpa", _o_n_sdpa)
    monkeypatch.setattr("leandiffusion.vae.attention._sdpa", _o_n_sdpa)
    with torch.device("meta"):
        attn = _block(channels=512, heads=heads, groups=32).to(dtype)
    spec = spec_from_diffusers(attn)
    n = px // 8
    cost = MapCost(512, n, n, dtype.itemsize, dtype.itemsize, on_device, heads)
    band_plan = plan_bands(cost, int(budget_gib * GiB), online=online)
    meta = torch.device("meta")
    streams = Streams(meta)
    if on_device:
        store = DeviceStore(n, n, 512, dtype, meta, streams)
    else:
        store = HostStore(n, n, 512, dtype, meta, streams, data=torch.empty((n, n, 512), dtype=dtype))
    stats = GroupStats(32, 1.0, torch.zeros(32, dtype=torch.float64, device=meta),
                       torch.ones(32, dtype=torch.float64, device=meta))
    out_stats = GroupStats(32)
    live = LiveBytes("meta", exclude=list(attn.parameters()) + [store.data])
    with live:
        run_banded(spec, store.prefetch, stats, (512, n, n), band_plan, lambda a, y: out_stats.add(y, chunked=True),
                   dtype)
    return attn, band_plan, live


@pytest.mark.parametrize("online,scheme", [(True, RESIDENT), (True, STREAMED), (False, RESIDENT)])
def test_multi_head_peak_stays_within_the_estimate(monkeypatch, online, scheme):
    """The SD VAE has one head, so an estimate that counted one score block instead of one per head would pass the test
    above. A multi-head map (8 heads of 64 channels, fp32, 2048 px) holds ``heads`` fp32 score blocks per chunk step;
    the meta count must stay within the estimate for each scheme."""
    budget = {(True, RESIDENT): 0.6, (True, STREAMED): 0.1, (False, RESIDENT): 0.5}[(online, scheme)]
    _, band_plan, live = _meta_peak(monkeypatch, torch.float32, 2048, budget, online, True, heads=8)
    assert (band_plan.scheme, band_plan.online) == (scheme, online and scheme == RESIDENT)
    assert live.peak <= band_plan.estimate <= budget * GiB, (band_plan, live.peak / GiB, live.peak_op)


def test_interrupt_between_key_chunks_stops_the_stage(monkeypatch):
    """Streamed, one band of queries runs a chunk per band of keys (hundreds at tiny budgets): Cancel is checked
    between chunks, so it stops the stage inside the first band of queries, before any output."""
    from leandiffusion import bridge

    calls, outputs = [], []

    def interrupt():
        calls.append(1)
        if len(calls) == 3:  # the first query band's check, then its first two chunks'
            raise bridge.Interrupted("cancelled")

    spec = spec_from_diffusers(_block())
    x = torch.randn(1, 64, 7, 5)
    stats = GroupStats(8)
    stats.add(x)
    bridge.set_interrupt_hook(interrupt)
    try:
        with pytest.raises(bridge.Interrupted):
            run_banded(spec, _store(x[0], True).prefetch, stats, (64, 7, 5), BandPlan(STREAMED, 2, 0),
                       lambda a, y: outputs.append(a), x.dtype)
    finally:
        bridge.set_interrupt_hook(None)
    assert len(calls) == 3 and outputs == []

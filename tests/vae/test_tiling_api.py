"""Node/API contracts: clear errors, OOM fallback, the overlap both modes ignore, statistics accuracy.

Guards the issue's error lines (both/neither model input, channel mismatch, bad tile settings), the
halve-and-retry promise on out-of-memory, and the numerical core (Chan-merged GroupNorm statistics). ``blend``'s
accuracy and cost: ``test_blend.py``.
"""
import logging

import pytest
import torch

import leandiffusion.vae.tiled as tiled
from leandiffusion.nodes.vae import LeanTiledVAEDecode, LeanTiledVAEEncode
from leandiffusion.tests.kit import tiny_engine
from leandiffusion.vae.stats import GroupStats, apply_group_norm
from leandiffusion.vae.targets import from_module
from leandiffusion.vae.untiled import vae_decode



@pytest.fixture(scope="module")
def engine():
    return tiny_engine("sd1")


# ----------------------------------------------------------------------------------------------- errors
def test_exactly_one_model_input(engine):
    z = {"samples": torch.randn(1, 4, 8, 8)}
    with pytest.raises(ValueError, match="neither given"):
        LeanTiledVAEDecode().decode(z, 0, 64, "exact")
    with pytest.raises(ValueError, match="both given"):
        LeanTiledVAEDecode().decode(z, 0, 64, "exact", lean_model=engine, vae=object())
    with pytest.raises(ValueError, match="neither given"):
        LeanTiledVAEEncode().encode(torch.rand(1, 64, 64, 3), 0, 64, "exact")


def test_channel_mismatch(engine):
    with pytest.raises(ValueError, match="16 channels but this VAE takes 4"):
        LeanTiledVAEDecode().decode({"samples": torch.randn(1, 16, 8, 8)}, 0, 64, "exact", lean_model=engine)


def test_tile_below_the_minimum(engine):
    with pytest.raises(ValueError, match="below the minimum 128"):
        LeanTiledVAEDecode().decode({"samples": torch.randn(1, 4, 8, 8)}, 64, 16, "exact", lean_model=engine)
    with pytest.raises(ValueError, match="below the minimum 128"):
        LeanTiledVAEEncode().encode(torch.rand(1, 64, 64, 3), 64, 16, "blend", lean_model=engine)


def test_exact_ignores_the_overlap_whatever_the_tile(engine):
    """``exact`` computes its own halo: the minimum tile with the default overlap (128 / 64), or an overlap larger
    than the tile, decodes and encodes like the untiled VAE (it was refused as 'too small for the overlap')."""
    z = torch.randn(1, 4, 40, 24)  # 320 x 192 px: several 128 px tiles
    image = torch.rand(1, 320, 192, 3)
    vae = engine.parts.vae  # diffusers' AutoencoderKL, untiled: the reference
    with torch.no_grad():
        ref_image = ((vae.decode(z).sample + 1) / 2).clamp(0, 1).permute(0, 2, 3, 1)
        ref_latent = vae.encode(image.permute(0, 3, 1, 2) * 2 - 1).latent_dist.mean
    for overlap in (64, 200):
        (img,) = LeanTiledVAEDecode().decode({"samples": z}, 128, overlap, "exact", lean_model=engine)
        (lat,) = LeanTiledVAEEncode().encode(image, 128, overlap, "exact", lean_model=engine)
        assert (img - ref_image).abs().max().item() <= 1e-4, overlap
        assert (lat["samples"] - ref_latent).abs().max().item() <= 1e-4, overlap


def test_blend_ignores_the_overlap_whatever_the_tile(engine):
    """``blend`` runs exact's bands too (with estimated statistics): any valid overlap, also one above half the tile
    (refused while ``blend`` cross-faded tiles), gives the same picture."""
    z = torch.randn(1, 4, 40, 24, generator=torch.Generator().manual_seed(3))
    image = torch.rand(1, 320, 192, 3, generator=torch.Generator().manual_seed(4))
    imgs = [LeanTiledVAEDecode().decode({"samples": z}, 128, o, "blend", lean_model=engine)[0] for o in (0, 64, 200)]
    lats = [LeanTiledVAEEncode().encode(image, 128, o, "blend", lean_model=engine)[0]["samples"] for o in (0, 200)]
    assert torch.equal(imgs[0], imgs[1]) and torch.equal(imgs[0], imgs[2]) and torch.equal(lats[0], lats[1])


def test_bad_seam_mode_and_vae(engine):
    with pytest.raises(ValueError, match="seam_mode='seamless'"):
        LeanTiledVAEDecode().decode({"samples": torch.randn(1, 4, 8, 8)}, 0, 64, "seamless", lean_model=engine)
    with pytest.raises(TypeError, match="first_stage_model"):
        LeanTiledVAEDecode().decode({"samples": torch.randn(1, 4, 8, 8)}, 0, 64, "exact", vae=object())


@pytest.mark.parametrize("samples,match", [
    (torch.zeros(1, 4, 2, 8, 8),
     r"samples: expected a LATENT tensor \[B, C, h, w\], got torch.Size\(\[1, 4, 2, 8, 8\]\)"),
    ([[0.0]], r"samples: expected a LATENT tensor \[B, C, h, w\], got list"),
    (torch.zeros(1, 4, 0, 8), r"samples: empty latent of shape \(1, 4, 0, 8\)"),
])
def test_latents_that_cannot_be_decoded_are_named(engine, samples, match):
    with pytest.raises(ValueError, match=match):
        LeanTiledVAEDecode().decode({"samples": samples}, 0, 64, "exact", lean_model=engine)


@pytest.mark.parametrize("tile,overlap,match", [
    (256.0, 64, r"tile_size=256.0: expected 0 \(auto\) or an integer number of pixels >= 128"),
    (True, 64, r"tile_size=True: expected 0 \(auto\)"),
    (256, 600, r"overlap=600: expected an integer number of pixels in 0..512"),
    (256, "64", r"overlap='64': expected an integer number of pixels in 0..512"),
])
def test_tile_settings_of_the_wrong_type_are_named(engine, tile, overlap, match):
    with pytest.raises(ValueError, match=match):
        LeanTiledVAEDecode().decode({"samples": torch.zeros(1, 4, 8, 8)}, tile, overlap, "exact", lean_model=engine)


def test_a_lean_model_that_is_no_engine_is_named():
    with pytest.raises(TypeError, match=r"lean_model: expected a LEAN_MODEL engine, got str"):
        LeanTiledVAEDecode().decode({"samples": torch.zeros(1, 4, 8, 8)}, 0, 64, "exact", lean_model="model")


# ----------------------------------------------------------------------------------------------- OOM fallback
def test_oom_halves_tile_and_retries(engine, monkeypatch, caplog):
    """An injected OOM for tiles above 256 px: the run retries at 512, then 256, and still matches untiled."""
    real = tiled.run_exact
    seen = []

    def flaky(program, sample, cfg, *args, **kwargs):
        seen.append(cfg.tile_px)
        if cfg.tile_px > 256:
            raise tiled._OOM("CUDA out of memory (injected)")
        return real(program, sample, cfg, *args, **kwargs)

    monkeypatch.setattr(tiled, "run_exact", flaky)
    z = torch.randn(1, 4, 9, 7)
    with caplog.at_level(logging.WARNING):
        img = tiled.tiled_decode(from_module(engine.parts.vae), z, tile_size=1024, overlap=64, quiet=True)
    assert seen == [1024, 512, 256]
    assert "retrying with 256 px tiles" in caplog.text
    with engine.session("vae"):
        ref = vae_decode(engine, z)
    assert (img - ref).abs().max().item() <= 1e-4


def test_a_cpu_allocation_failure_halves_the_tile_too_and_other_errors_do_not(engine, monkeypatch):
    """torch's CPU allocator raises a RuntimeError, not OutOfMemoryError: the tile must shrink all the same, while
    any other error propagates at once."""
    real = tiled.run_exact
    seen = []

    def flaky(program, sample, cfg, *args, **kwargs):
        seen.append(cfg.tile_px)
        if cfg.tile_px > 256:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 9000000000 bytes")
        return real(program, sample, cfg, *args, **kwargs)

    monkeypatch.setattr(tiled, "run_exact", flaky)
    tiled.tiled_decode(from_module(engine.parts.vae), torch.randn(1, 4, 9, 7), tile_size=512, overlap=64, quiet=True)
    assert seen == [512, 256]

    def broken(program, sample, cfg, *args, **kwargs):
        seen.append(cfg.tile_px)
        raise RuntimeError("a real bug")

    seen.clear()
    monkeypatch.setattr(tiled, "run_exact", broken)
    with pytest.raises(RuntimeError, match="a real bug"):
        tiled.tiled_decode(from_module(engine.parts.vae), torch.randn(1, 4, 9, 7), tile_size=512, overlap=64,
                           quiet=True)
    assert seen == [512]


def test_oom_down_to_128_then_clear_error(engine, monkeypatch):
    seen = []

    def always(program, sample, cfg, *args, **kwargs):
        seen.append(cfg.tile_px)
        raise tiled._OOM("CUDA out of memory (injected)")

    monkeypatch.setattr(tiled, "run_exact", always)
    with pytest.raises(tiled._OOM, match=r"even with 128 px tiles \(tried \[512, 256, 128\]"):
        tiled.tiled_decode(from_module(engine.parts.vae), torch.randn(1, 4, 8, 8), tile_size=512, overlap=64,
                           quiet=True)
    assert seen == [512, 256, 128]


# ----------------------------------------------------------------------------------------------- blend
def test_blend_on_maps_too_small_to_sample_equals_exact(engine):
    """Where no group holds enough values to sample (``estimated_stats.column_stride`` is 1 on every map of a small
    image), blend's statistics are exact: exact means, variances over every value. So it is exact's picture."""
    z = torch.randn(1, 4, 10, 9)
    with engine.session("vae"):
        ref = vae_decode(engine, z)
    img = tiled.tiled_decode(from_module(engine.parts.vae), z, tile_size=128, overlap=32, seam_mode="blend",
                             quiet=True)
    assert (img - ref).abs().max().item() <= 1e-4


# ----------------------------------------------------------------------------------------------- statistics
@pytest.mark.parametrize("trend", [0.0, 0.3])
def test_group_stats_merge_matches_fp64_whole(trend):
    """Uneven row bands merged with Chan's formula == fp64 statistics of the whole image, even with a large mean.
    ``trend`` gives the bands different means (a row gradient) and the channels of a group different offsets, so
    both the between-band term of the merge and the within-group spread carry real weight."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 64, 37, 23, dtype=torch.float64, generator=g) * 0.5 + 1000.0
    x = x + trend * torch.arange(37, dtype=torch.float64).view(1, 1, 37, 1) \
        + trend * 10 * torch.randn(1, 64, 1, 1, dtype=torch.float64, generator=g)
    stats = GroupStats(32)
    for a, b in ((0, 5), (5, 6), (6, 30), (30, 37)):
        stats.add(x[:, :, a:b].float())
    var, mean = torch.var_mean(x.view(1, 32, -1), dim=-1, correction=0)
    assert (stats.mean - mean[0]).abs().max().item() <= 1e-4
    assert ((stats.variance() - var[0]) / var[0]).abs().max().item() <= 1e-3
    gn = torch.nn.GroupNorm(32, 64, eps=1e-6)
    torch.nn.init.normal_(gn.weight)
    torch.nn.init.normal_(gn.bias)
    x32 = x.float()
    with torch.no_grad():
        assert (apply_group_norm(x32, stats, gn.weight, gn.bias, gn.eps) - gn(x32)).abs().max().item() <= 2e-3


def test_group_stats_reduces_a_large_band_in_row_chunks(monkeypatch):
    """With ``chunked`` (the attention stage's output bands), a band over ``STATS_CHUNK_ELEMENTS`` is reduced in row
    chunks (on CUDA one ``var_mean`` allocated ~20 bytes per element of it: 0.64 GiB for a 2048 px fp16 band of the
    SD VAE's mid block) with the same statistics."""
    from leandiffusion.vae import stats as stats_mod

    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 64, 37, 23, dtype=torch.float64, generator=g) * 2 + 5 \
        + 0.3 * torch.arange(37, dtype=torch.float64).view(1, 1, 37, 1)
    seen = []
    real = torch.var_mean

    def spy(t, *a, **k):
        seen.append(t.numel())
        return real(t, *a, **k)

    monkeypatch.setattr(stats_mod, "STATS_CHUNK_ELEMENTS", 64 * 23 * 5)  # five rows
    monkeypatch.setattr(torch, "var_mean", spy)
    unchunked = GroupStats(32)
    unchunked.add(x.float())
    assert seen == [x.numel()]  # the convolution stages' bands: one call
    seen.clear()
    stats = GroupStats(32)
    stats.add(x.float(), chunked=True)
    assert seen and max(seen) <= 64 * 23 * 5 and sum(seen) == x.numel() and len(seen) == 8
    monkeypatch.setattr(torch, "var_mean", real)
    var, mean = torch.var_mean(x.view(1, 32, -1), dim=-1, correction=0)
    assert (stats.mean - mean[0]).abs().max().item() <= 1e-5
    assert ((stats.variance() - var[0]) / var[0]).abs().max().item() <= 1e-5
    assert stats_mod.stats_transient_bytes(10 ** 9) == 20 * stats_mod.STATS_CHUNK_ELEMENTS


def test_group_stats_rejects_empty_and_batches():
    with pytest.raises(RuntimeError, match="no data"):
        GroupStats(4).variance()
    with pytest.raises(ValueError, match="one image"):
        GroupStats(4).add(torch.zeros(2, 8, 2, 2))


def test_an_engine_under_a_hard_budget_gives_the_vae_its_room():
    from leandiffusion.memory.load import build_engine
    from leandiffusion.tests.kit import tiny_parts
    from leandiffusion.vae.targets import from_engine

    budgeted = build_engine(tiny_parts("sd1"), "stream", 1.0, device="cpu", weight_dtype="fp32", vae_dtype="fp32")
    assert from_engine(budgeted).room is not None
    assert from_engine(budgeted).room() is None  # on the CPU nothing is capped
    assert from_engine(tiny_engine("sd1")).room is None


@pytest.mark.parametrize("room, expected", [
    (2200 * 2**20, 1000 * 2**20),  # what the budget leaves, over the reserved/estimate factor
    (-5, tiled.MIN_ACTIVATION_BYTES),  # the process already holds more: the floor, retries halve from there
    (None, int(0.8 * 70 * 2**30)),  # no budget on this device: 80% of the free VRAM
])
def test_activation_budget_follows_the_budgets_room(monkeypatch, room, expected):
    from leandiffusion.vae.targets import VaeTarget

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    target = VaeTarget(torch.nn.Conv2d(1, 1, 1), torch.device("cuda", 0), torch.float32, room=lambda: room)
    assert tiled.DECODE_RESERVED_FACTOR == 2.2
    assert abs(tiled.activation_budget(target) - expected) <= 1  # (float division)
    assert tiled.activation_budget(target, budget_bytes=123) == 123  # the caller's value wins


# ----------------------------------------------------------------------------------------------- node declarations
@pytest.mark.parametrize("node, method, returns", [(LeanTiledVAEDecode, "decode", ("IMAGE",)),
                                                  (LeanTiledVAEEncode, "encode", ("LATENT",))])
def test_node_declarations_are_the_documented_ones(node, method, returns):
    """docs/vae.md: tile_size 0 (auto) or up to 4096 in steps of 32, overlap 0-512, seam_mode 'exact' (default) or
    'blend', the model as one of two optional inputs; the editor's defaults are the Python defaults, so a workflow and
    an API call that leave a widget out get the same tiles (ranges, the overlap and seam_mode defaults, the outputs
    and the inputs' optionality must not change unnoticed)."""
    import inspect

    spec = node.INPUT_TYPES()
    req = spec["required"]
    assert {k: v[0] for k, v in spec["optional"].items()} == {"lean_model": "LEAN_MODEL", "vae": "VAE"}
    assert (req["tile_size"][1]["min"], req["tile_size"][1]["max"], req["tile_size"][1]["step"]) == (0, 4096, 32)
    assert (req["overlap"][1]["min"], req["overlap"][1]["max"]) == (0, 512)
    assert req["seam_mode"][0] == ["exact", "blend"]
    params = inspect.signature(getattr(node, method)).parameters
    for name in ("tile_size", "overlap", "seam_mode"):
        assert req[name][1]["default"] == params[name].default, name
    assert params["seam_mode"].default == "exact"
    assert node.RETURN_TYPES == returns and node.CATEGORY == "LeanDiffusion/vae"

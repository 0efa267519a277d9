"""A batch through Tiled VAE Decode / Encode: one progress bar, out-of-memory retries, interruption.

Guards:
- The bar ends exactly at its total: ``exact`` counts one unit per stage of the VAE per image, but under a budget
  that parks an upsampler's output in host memory the executor fuses the upsampler into the next block and ticked
  once for both (the SD1 test VAE's decode stopped at 26 of 32 with a 1 MiB budget, its encode at 18 of 24).
- After an out-of-memory retry every later image of the batch started again from the tile (and activation budget)
  that had failed (one more out-of-memory error and warning per image); a retried image that ran more units than
  the bar had planned left the bar at the image's share while the image ran on. Now later images keep the tile
  that worked, and the bar is re-planned (back to the finished images' units, out of a total that counts the new
  tile's units for this and every later image): it never passes its total and ends at it. ``exact`` gives the same
  picture at any tile, so a retried batch equals the untiled decode / encode; ``blend`` (the same executor with
  estimated statistics) takes the same path.
- An interrupted batch returns nothing, and the exception no longer keeps the half-filled batch output (nor the
  interrupted image's stores) alive through the finished frames for as long as the caller holds it.
References: the untiled modules (diffusers' ``decode`` / ``encode`` through the engine) for pictures; the bar is a
stand-in that clamps like ComfyUI's (``update_absolute``) and records every value it showed.
"""
import pytest
import torch

import leandiffusion.vae.tiled as tiled
from leandiffusion import bridge
from leandiffusion.tests.kit import tiny_engine
from leandiffusion.tests.kit.progress import ComfyLikeBar
from leandiffusion.vae.adapters import decoder_program, encoder_program
from leandiffusion.vae.exact import ExactConfig, plan
from leandiffusion.vae.targets import from_module
from leandiffusion.vae.untiled import vae_decode, vae_encode

TOL = 1e-4
OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("sd1")


@pytest.fixture
def bars(monkeypatch):
    made = []

    def make(total, desc="", quiet=False):
        made.append(ComfyLikeBar(total))
        return made[-1]

    monkeypatch.setattr(bridge, "ProgressBar", make)
    return made


def _untiled(engine, direction, x):
    with engine.session("vae"):
        return vae_decode(engine, x) if direction == "decode" else vae_encode(engine, x)


def _run(engine, direction, x, tile, overlap, mode, **kw):
    fn = tiled.tiled_decode if direction == "decode" else tiled.tiled_encode
    return fn(from_module(engine.parts.vae), x, tile, overlap, mode, quiet=True, **kw)


# ------------------------------------------------------------------------------------- the bar ends at its total
@pytest.mark.parametrize("direction,budget", [("decode", 2**20), ("encode", 200_000)])
def test_exact_progress_ends_at_its_total_when_the_budget_fuses_upsamplers(engine, bars, direction, budget):
    vae = engine.parts.vae
    if direction == "decode":
        x, program, shape = torch.randn(2, 4, 32, 32), decoder_program(vae), (4, 32, 32)
    else:
        x, program, shape = torch.rand(2, 256, 256, 3), encoder_program(vae), (3, 256, 256)
    fused = plan(program, shape, ExactConfig(torch.device("cpu"), torch.float32, budget, 0))
    assert len(fused) < len(program.stages)  # the case under test: some resampler runs fused into the next block
    out = _run(engine, direction, x, 0, 64, "exact", budget_bytes=budget)
    (bar,) = bars
    assert bar.total == 2 * len(program.stages)
    assert all(value <= total for value, total in bar.seen), bar.seen
    assert bar.value == bar.total, f"the bar ended at {bar.value} of {bar.total}"
    assert (out - _untiled(engine, direction, x)).abs().max().item() <= TOL


# ------------------------------------------------------------------------------------- out-of-memory retries
class _OomAfterTicks:
    """Stands in for ``run_exact``: records each call's tile (px) and configuration; a call that
    ``fails(call_number, tile)`` selects runs until it has ticked ``ticks`` times, then runs out of memory (what a
    real out-of-memory error midway through an image does)."""

    def __init__(self, real, fails, ticks):
        self.real, self.fails, self.ticks = real, fails, ticks
        self.tiles, self.configs = [], []

    def __call__(self, *args, **kwargs):
        cfg = args[2]
        assert isinstance(cfg, ExactConfig)
        self.tiles.append(cfg.tile_px)
        self.configs.append(cfg)
        tile = cfg.tile_px
        if not self.fails(len(self.tiles), tile):
            return self.real(*args, **kwargs)
        args, kwargs, key = list(args), dict(kwargs), "progress" if "progress" in kwargs else None
        tick = kwargs[key] if key else args[5]
        count = [0]

        def failing_tick():
            tick()
            count[0] += 1
            if count[0] == self.ticks:
                raise OOM("injected: CUDA out of memory")
        if key:
            kwargs[key] = failing_tick
        else:
            args[5] = failing_tick
        return self.real(*args, **kwargs)


@pytest.mark.parametrize("failing_image", [1, 2])
@pytest.mark.parametrize("mode", ["exact", "blend"])
@pytest.mark.parametrize("direction", ["decode", "encode"])
def test_oom_retry_keeps_the_bar_within_its_total_and_later_images_keep_the_tile(engine, bars, monkeypatch, caplog,
                                                                               mode, direction, failing_image):
    """3 images at tile 512: image 1 or 2 runs out of memory after some units of progress and is retried at 256 px,
    which fits; the images after it must start at 256 px (one failed attempt in all)."""
    x = torch.randn(3, 4, 40, 40) if direction == "decode" else torch.rand(3, 320, 320, 3)
    first = 512
    fault = _OomAfterTicks(tiled.run_exact, lambda call, tile: call == failing_image, ticks=3)
    monkeypatch.setattr(tiled, "run_exact", fault)
    with caplog.at_level("WARNING"):
        out = _run(engine, direction, x, 512, 32, mode)
    assert fault.tiles == [first] * failing_image + [first // 2] * (4 - failing_image), fault.tiles
    assert caplog.text.count("retrying with 256 px tiles") == 1
    (bar,) = bars
    assert all(value <= total for value, total in bar.seen), bar.seen
    assert bar.value == bar.total, f"the bar ended at {bar.value} of {bar.total}"
    assert bar.total == 3 * len(decoder_program(engine.parts.vae).stages if direction == "decode"
                                else encoder_program(engine.parts.vae).stages)
    assert all(cfg.estimate_inner_stats == (mode == "blend") for cfg in fault.configs)
    if mode == "exact":
        assert (out - _untiled(engine, direction, x)).abs().max().item() <= TOL  # the same picture at any tile


# ------------------------------------------------------------------------------------- interruption
def _held_tensors(exc, exclude):
    """Tensors reachable from the frames of ``exc``'s traceback: their locals and the attributes of their locals
    (the executor's stores hold their tensors as attributes); views of ``exclude`` (the caller's input) left out."""
    base = exclude.untyped_storage().data_ptr()
    found, tb = [], exc.__traceback__
    while tb is not None:
        for value in tb.tb_frame.f_locals.values():
            for t in [value] + list(getattr(value, "__dict__", {}).values()):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() != base:
                    found.append(t)
        tb = tb.tb_next
    return found


@pytest.mark.parametrize("mode", ["exact", "blend"])
@pytest.mark.parametrize("direction", ["decode", "encode"])
def test_interruption_releases_the_half_done_batch(engine, mode, direction):
    """Interrupted inside the second of 3 images: nothing is returned, and no tensor of at least one output image's
    size stays reachable from the exception's frames (main kept the batch output and the image's stores)."""
    if direction == "decode":
        x, per_image = torch.randn(3, 4, 24, 24), 192 * 192 * 3
    else:
        x, per_image = torch.rand(3, 192, 192, 3), 4 * 24 * 24
    checks = []
    bridge.set_interrupt_hook(lambda: checks.append(1))  # how many checks one image makes
    try:
        _run(engine, direction, x[:1], 128, 32, mode)
    finally:
        bridge.set_interrupt_hook(None)
    per_image_checks, checks = len(checks), []
    assert per_image_checks > 1

    def hook():
        checks.append(1)
        if len(checks) == per_image_checks + per_image_checks // 2:
            raise bridge.Interrupted("user pressed cancel")

    bridge.set_interrupt_hook(hook)
    try:
        with pytest.raises(bridge.Interrupted) as info:
            _run(engine, direction, x, 128, 32, mode)
    finally:
        bridge.set_interrupt_hook(None)
    held = [tuple(t.shape) for t in _held_tensors(info.value, x) if t.numel() >= per_image]
    assert held == [], f"the interrupted run's frames still hold {held}"


def test_oom_retry_halves_the_activation_budget_with_the_tile(engine, monkeypatch):
    """Keeping the activation budget on retry (halving the tile only) would pass tests that look at tiles and the bar.
    Out of memory at 512 px under a 1 GiB budget retries at 256 px and 0.5 GiB, and the next image starts from both
    (module docstring: the tile and the activation budget are halved)."""
    seen = []
    real = tiled.run_exact

    def fault(program, x, cfg, *a, **k):
        seen.append((cfg.tile_px, cfg.budget_bytes))
        if len(seen) == 1:
            raise tiled._OOM("simulated")
        return real(program, x, cfg, *a, **k)

    monkeypatch.setattr(tiled, "run_exact", fault)
    _run(engine, "decode", torch.randn(2, 4, 9, 6), 512, 32, "exact", budget_bytes=2**30)
    assert seen == [(512, 2**30), (256, 2**29), (256, 2**29)]

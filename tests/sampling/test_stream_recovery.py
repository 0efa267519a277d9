"""Stream Scheduler Sampler: clear errors, out-of-memory recovery, interruption, one progress bar, the node.

Guards: empty prompts and bad numbers fail before any model runs, naming the input; an out-of-memory error in the
middle of a run (injected by a UNet wrapper / a failing VAE decode) is recovered by halving the batch (or tiling
the decode) with every image produced exactly once and equal to its one-prompt run; an OOM even at batch 1 ends
with the sizes tried; an interrupt stops all stages, returns nothing, says how far it got and leaves the engine
usable; the progress bar counts images x steps once, even across a retried batch; the node is plumbing.
"""
import dataclasses

import pytest
import torch

from leandiffusion import bridge
from leandiffusion.nodes.stream import LeanStreamSampler
from leandiffusion.sampling.loop import sample
from leandiffusion.sampling.stream.scheduler import run_stream
from leandiffusion.sampling.stream.settings import StreamSettings
from leandiffusion.tests.kit import tiny_engine
from leandiffusion.vae.untiled import vae_decode

OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
PROMPTS = "a red boat\na lighthouse\nsnowy forest"


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("sd1")


def _settings(**kw):
    base = dict(negative="", seed=3, steps=2, cfg=5.0, width=64, height=64, acceleration="none", max_batch=2)
    base.update(kw)
    return StreamSettings.from_text(base.pop("prompts", PROMPTS), **base)


def _refs(engine, s):
    s = s.validated()
    k = s.images_per_prompt  # prompt-major with seed + n, written out (not read from ``s.jobs()``)
    return torch.cat([sample(engine, s.sampler_settings(s.prompts[n // k], s.seed + n), quiet=True)["samples"]
                      for n in range(len(s.prompts) * k)])


def _close(got, ref, rel=1e-5):
    for n in range(ref.shape[0]):
        err = (got[n] - ref[n]).abs().max().item()
        assert err <= rel * max(1.0, ref[n].abs().max().item()), f"image {n}: max abs diff {err:.3g}"


class OOMUNet(torch.nn.Module):
    """Wraps a UNet; raises out-of-memory on the calls ``fail(rows, call_index)`` selects."""

    def __init__(self, unet, fail, error=None):
        super().__init__()
        self.inner = unet
        self.config = unet.config
        self.fail = fail
        self.error = error
        self.calls = []

    def forward(self, sample, *args, **kwargs):
        index = len(self.calls)
        self.calls.append(sample.shape[0])
        if self.fail(sample.shape[0], index):
            if self.error is not None:
                raise self.error()
            raise OOM(f"injected: CUDA out of memory (batch rows {sample.shape[0]})")
        return self.inner(sample, *args, **kwargs)


def _with_unet(engine, fail, error=None):
    wrapper = OOMUNet(engine.parts.unet, fail, error)
    return engine.with_changes(parts=dataclasses.replace(engine.parts, unet=wrapper)), wrapper


# --------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("text", ["", "\n   \n\t\n"])
def test_empty_prompts_is_a_clear_error(engine, text):
    with pytest.raises(ValueError, match="prompts: no prompt given"):
        run_stream(engine, StreamSettings.from_text(text), quiet=True)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(images_per_prompt=0), ValueError, "images_per_prompt=0"),
    (dict(max_batch=-1), ValueError, "max_batch=-1"),
    (dict(max_batch=True), TypeError, "max_batch=True"),
    (dict(decode_tile_size=100), ValueError, "tile_size=100"),
    (dict(width=100), ValueError, "width=100 is not a multiple of 8"),
    (dict(steps=0), ValueError, "steps=0"),
    (dict(seed=2 ** 64 - 2), ValueError, "the last seed"),
])
def test_bad_inputs_name_the_input(engine, kw, exc, match):
    with pytest.raises(exc, match=match):
        run_stream(engine, _settings(**kw), quiet=True)


def test_the_last_image_may_take_the_largest_seed():
    """Image n uses seed + n: a run of 3 images may start at MAX_SEED - 2 (its last image takes MAX_SEED itself),
    one more is refused naming the largest start."""
    from leandiffusion.sampling.settings import MAX_SEED

    assert _settings(seed=MAX_SEED - 2).validated().seed == MAX_SEED - 2
    with pytest.raises(ValueError, match=rf"the last seed {MAX_SEED + 1} exceeds {MAX_SEED}; use a seed <= "
                                         rf"{MAX_SEED - 2}"):
        _settings(seed=MAX_SEED - 1).validated()


def test_prompts_must_be_text():
    with pytest.raises(TypeError, match="prompts"):
        StreamSettings.from_text(["a", "b"])


# --------------------------------------------------------------------------------------------- out of memory
def test_oom_mid_run_halves_the_batch_and_loses_nothing(engine):
    # batch 0 (2 images) runs; batch 1's second step runs out of memory -> images 2.. retried in batches of 1
    eng, wrapper = _with_unet(engine, lambda rows, i: i == 3)
    s = _settings(prompts="a red boat\na lighthouse\nsnowy forest\na cat", max_batch=2)
    result = run_stream(eng, s, quiet=True)
    assert result.oom_retries == 1
    assert result.batch_sizes == (2, 1, 1)
    assert wrapper.calls == [4, 4, 4, 4, 2, 2, 2, 2]  # rows = 2 x images (CFG); the failed call is counted too
    _close(result.latents, _refs(engine, s))


def test_oom_on_every_large_batch_shrinks_until_it_fits(engine):
    eng, _ = _with_unet(engine, lambda rows, i: rows > 2)
    s = _settings(max_batch=3)
    result = run_stream(eng, s, quiet=True)
    assert result.batch_sizes == (1, 1, 1) and result.oom_retries == 1
    _close(result.latents, _refs(engine, s))


def test_a_cpu_allocation_failure_shrinks_the_batch_like_an_out_of_memory_error(engine):
    """torch's CPU allocator raises a RuntimeError, not OutOfMemoryError; the batch must shrink all the same."""
    message = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 120000000000 bytes"
    eng, _ = _with_unet(engine, lambda rows, i: rows > 2, error=lambda: RuntimeError(message))
    s = _settings(max_batch=3)
    result = run_stream(eng, s, quiet=True)
    assert result.batch_sizes == (1, 1, 1) and result.oom_retries == 1
    _close(result.latents, _refs(engine, s))


def test_an_error_that_is_not_out_of_memory_is_not_retried(engine):
    eng, wrapper = _with_unet(engine, lambda rows, i: True, error=lambda: RuntimeError("a real bug"))
    with pytest.raises(RuntimeError, match="a real bug"):
        run_stream(eng, _settings(max_batch=3), quiet=True)
    assert len(wrapper.calls) == 1


def test_oom_inside_a_streamed_block_is_recovered_under_the_stream_policy():
    """The real case on a tight budget: the OOM is raised inside a block the ``stream`` policy streams, midway
    through the UNet's schedule; the retried batch runs on the same streamed UNet."""
    from leandiffusion.memory.load import build_engine
    from leandiffusion.memory.plan import GiB, module_bytes
    from leandiffusion.memory.policies import stream_working_minimum_gb
    from leandiffusion.tests.kit import tiny_parts

    parts = tiny_parts("sd1")
    budget = stream_working_minimum_gb(parts, "cpu") + 0.3 * module_bytes(parts.unet, torch.float32) / GiB
    eng = build_engine(parts, "stream", budget, device="cpu")
    streamer = eng.placement.streamer
    block = dict(parts.unet.named_modules())[streamer.schedule.order[streamer.schedule.streamed[-1]].name]
    original, calls = block.forward, []

    def fail_on_the_big_batch(hidden, *args, **kwargs):
        calls.append(hidden.shape[0])
        if hidden.shape[0] > 2:
            raise OOM("injected: CUDA out of memory inside a streamed block")
        return original(hidden, *args, **kwargs)

    s = _settings(max_batch=2)
    block.forward = fail_on_the_big_batch
    try:
        result = run_stream(eng, s, quiet=True)
    finally:
        del block.forward
    assert result.oom_retries == 1 and result.batch_sizes == (1, 1, 1)
    assert 4 in calls  # the injected failure really happened inside the schedule
    _close(result.latents, _refs(eng, s))


def test_oom_at_batch_1_reports_what_was_tried(engine):
    eng, _ = _with_unet(engine, lambda rows, i: True)
    with pytest.raises(OOM, match=r"batch sizes tried: \[2, 1\]") as info:
        run_stream(eng, _settings(max_batch=2), quiet=True)
    assert "0 of 3 images were finished (unfinished: images 0-2)" in "".join(getattr(info.value, "__notes__", []))


def test_an_image_failing_alone_in_a_short_last_batch_is_reported_not_retried(engine):
    """3 images in batches of 2: the last batch holds 1 image, which runs out of memory. Nothing is smaller than
    the batch that failed (1, not the run's batch size 2), so the error says so at once, naming that image and the
    sizes tried."""
    eng, wrapper = _with_unet(engine, lambda rows, i: rows == 2)
    with pytest.raises(OOM, match=r"out of memory denoising image 2 even with a batch of 1 \(batch sizes tried: "
                                  r"\[1\]\)"):
        run_stream(eng, _settings(max_batch=2), quiet=True)
    assert wrapper.calls == [4, 4, 2]


def test_tiled_decode_oom_at_the_smallest_tile_is_raised_with_the_tiles_tried(engine, monkeypatch):
    """A tiled decode that runs out of memory at every tile halves down to 128 px, then raises what it tried
    (it does not retry 128 px again)."""
    import leandiffusion.sampling.stream.decode as stream_decode

    tiles = []

    def oom(program, z, cfg, *args, **kwargs):
        tiles.append(cfg.tile_px)
        if len(tiles) > 4:
            raise AssertionError(f"tiles retried without end: {tiles}")
        raise OOM("injected: CUDA out of memory in the tiled decode")

    monkeypatch.setattr(stream_decode, "run_exact", oom)
    with pytest.raises(OOM, match=r"tiled VAE decode ran out of memory even with 128 px tiles \(tried \[256, 128\] "
                                  r"px\).*Last error: injected"):
        run_stream(engine, _settings(decode_tile_size=256), quiet=True)
    assert tiles == [256, 128]


def test_decode_oom_falls_back_to_exact_tiles(engine, monkeypatch):
    vae = engine.parts.vae
    real = vae.decode
    state = {"calls": 0}

    def flaky(z, *a, **k):
        state["calls"] += 1
        if state["calls"] == 2:
            raise OOM("injected: CUDA out of memory in the VAE")
        return real(z, *a, **k)

    monkeypatch.setattr(vae, "decode", flaky)
    s = _settings()
    result = run_stream(engine, s, quiet=True)
    monkeypatch.undo()
    with engine.session("vae"):
        want = vae_decode(engine, result.latents)
        first = vae_decode(engine, result.latents[:1])
    assert state["calls"] == 2  # image 0 untiled, image 1 failed -> images 1, 2 tiled
    assert (result.images - want).abs().max().item() <= 1e-4
    assert torch.equal(result.images[:1], first)  # the image decoded before the failure is kept, not redone in tiles


def test_tiled_decode_oom_later_images_keep_the_smaller_tile(engine, monkeypatch, caplog):
    """After one image's tiled decode ran out of memory and worked at half the tile, every later image of the run
    starts from the tile that worked, not from the one that failed (one more out-of-memory error and warning per
    image); the images still equal the untiled decode."""
    import leandiffusion.sampling.stream.decode as stream_decode

    real, tiles, budgets = stream_decode.run_exact, [], []

    def flaky(program, z, cfg, *args, **kwargs):
        tiles.append(cfg.tile_px)
        budgets.append(cfg.budget_bytes)
        if cfg.tile_px > 256:
            raise OOM("injected: CUDA out of memory in the tiled decode")
        return real(program, z, cfg, *args, **kwargs)

    monkeypatch.setattr(stream_decode, "run_exact", flaky)
    with caplog.at_level("WARNING"):
        result = run_stream(engine, _settings(decode_tile_size=512), quiet=True)
    monkeypatch.undo()
    assert tiles == [512, 256, 256, 256]
    # the activation budget is halved with the tile (not below 64 MiB) and later images keep the halved one too
    assert budgets[0] > 128 * 2 ** 20 and budgets[1:] == [budgets[0] // 2] * 3
    assert caplog.text.count("retrying with 256 px tiles") == 1
    with engine.session("vae"):
        want = vae_decode(engine, result.latents)
    assert (result.images - want).abs().max().item() <= 1e-4


def test_a_row_decoded_twice_is_refused(engine):
    """The decode stage writes each output row once: a batch submitted again for rows already written (a scheduler
    bug) is an error naming the rows, not a silent overwrite."""
    from leandiffusion.sampling.stream.decode import DecodeStage
    from leandiffusion.sampling.stream.streams import StageStreams

    images, latents = torch.zeros(3, 64, 64, 3), torch.zeros(3, 4, 8, 8)
    stage = DecodeStage(engine, 0, False, StageStreams(torch.device("cpu")), images, latents)
    z = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    stage.submit(0, 2, z)
    stage.drain()
    assert stage.written.tolist() == [True, True, False]
    stage.submit(1, 3, z)
    with pytest.raises(RuntimeError, match="images 1-2 were produced twice"):
        stage.drain()


def test_a_batch_never_decoded_is_an_error_not_a_blank_image(engine, monkeypatch):
    """The run checks that every row was written before returning: a batch the decode stage dropped (a scheduler
    bug, stubbed here) fails the run naming the images, instead of returning uninitialised rows."""
    from leandiffusion.sampling.stream.decode import DecodeStage

    real = DecodeStage.submit

    def drop_the_second_batch(self, start, stop, final):
        if start != 2:
            real(self, start, stop, final)

    monkeypatch.setattr(DecodeStage, "submit", drop_the_second_batch)
    with pytest.raises(RuntimeError, match=r"images \[2\] were never written"):
        run_stream(engine, _settings(), quiet=True)


# --------------------------------------------------------------------------------------------- interruption
def test_interrupt_stops_cleanly_and_engine_stays_usable(engine):
    checks = {"n": 0}

    def hook():
        checks["n"] += 1
        if checks["n"] == 6:
            raise bridge.Interrupted("user pressed cancel")

    s = _settings()
    bridge.set_interrupt_hook(hook)
    try:
        with pytest.raises(bridge.Interrupted) as info:
            run_stream(engine, s, quiet=True)
    finally:
        bridge.set_interrupt_hook(None)
    notes = "".join(getattr(info.value, "__notes__", []))
    assert "Stream Scheduler Sampler stopped" in notes and "nothing was returned" in notes
    result = run_stream(engine, s, quiet=True)  # the engine is usable and gives the same images
    _close(result.latents, _refs(engine, s))


def test_interrupted_run_releases_its_outputs(engine):
    """An interrupted run returns nothing, and its exception must not keep the run's whole IMAGE output (images x H x W
    x 3 floats: 0.8 GB for 64 images of 1024 px) and the stages' buffers alive through the scheduler's frame for as long
    as the caller holds it: no tensor of an image's size is reachable from the exception's frames (their locals, and the
    attributes of their locals: the decode stage's buffers)."""
    checks = {"n": 0}

    def hook():
        checks["n"] += 1
        if checks["n"] == 8:  # images 0-1 denoised, inside image 2
            raise bridge.Interrupted("user pressed cancel")

    bridge.set_interrupt_hook(hook)
    try:
        with pytest.raises(bridge.Interrupted) as info:
            run_stream(engine, _settings(prompts="a\nb\nc\nd", max_batch=1), quiet=True)
    finally:
        bridge.set_interrupt_hook(None)
    held, tb = [], info.value.__traceback__
    while tb is not None:
        for name, value in list(tb.tb_frame.f_locals.items()):
            for t in [value] + list(getattr(value, "__dict__", {}).values()):
                if isinstance(t, torch.Tensor) and t.numel() >= 64 * 64 * 3:
                    held.append((tb.tb_frame.f_code.co_name, name, tuple(t.shape)))
        tb = tb.tb_next
    assert held == [], f"the interrupted run's frames still hold {held}"


# --------------------------------------------------------------------------------------------- progress
class RecordingBar:
    made = []

    def __init__(self, total, desc="", quiet=False):
        self.total, self.updates = total, []
        RecordingBar.made.append(self)

    def update(self, n=1):
        self.updates.append(n)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_one_progress_bar_over_images_and_steps_even_with_a_retry(engine, monkeypatch):
    RecordingBar.made = []
    monkeypatch.setattr(bridge, "ProgressBar", RecordingBar)
    eng, _ = _with_unet(engine, lambda rows, i: i == 3)
    s = _settings(prompts="a\nb\nc\nd", steps=3, max_batch=2)
    run_stream(eng, s, quiet=True)
    assert len(RecordingBar.made) == 1
    bar = RecordingBar.made[0]
    assert bar.total == 4 * 3 and sum(bar.updates) == 12 and all(u > 0 for u in bar.updates)


def test_the_progress_bar_ends_at_its_total_after_a_short_last_batch(engine, monkeypatch):
    """3 images in batches of 2: the last batch has 1 image, and advances the bar by 1 unit per step, not 2."""
    RecordingBar.made = []
    monkeypatch.setattr(bridge, "ProgressBar", RecordingBar)
    run_stream(engine, _settings(steps=3, max_batch=2), quiet=True)
    (bar,) = RecordingBar.made
    assert bar.total == 3 * 3 and bar.updates == [2, 2, 2, 1, 1, 1]


# --------------------------------------------------------------------------------------------- node
def test_node_is_plumbing(engine):
    node = LeanStreamSampler()
    image, latent = node.run(engine, PROMPTS, "", 3, 2, 5.0, 64, 64, "leading", "cuda_graph", 1, 2, 0)
    want = run_stream(engine, _settings(acceleration="cuda_graph"), quiet=True)
    assert torch.equal(image, want.images) and torch.equal(latent["samples"], want.latents)
    assert image.shape == (3, 64, 64, 3) and image.dtype == torch.float32
    assert 0.0 <= image.min().item() and image.max().item() <= 1.0


def test_node_inputs_match_the_issue():
    spec = LeanStreamSampler.INPUT_TYPES()
    assert list(spec["required"]) == ["lean_model", "prompts", "negative", "seed", "steps", "cfg", "width",
                                      "height", "timestep_spacing", "acceleration", "images_per_prompt",
                                      "max_batch", "decode_tile_size"]
    assert LeanStreamSampler.RETURN_TYPES == ("IMAGE", "LATENT")
    assert spec["required"]["images_per_prompt"][1]["max"] == 64
    assert spec["required"]["max_batch"][1]["min"] == 0



def test_unfinished_images_are_named_as_spans():
    from leandiffusion.sampling.stream.scheduler import _spans

    assert _spans([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8" and _spans([4]) == "4" and _spans([]) == ""


def test_node_inputs_shared_with_the_fused_sampler_are_declared_alike():
    """docs/stream.md: seed, steps, cfg, width, height, timestep_spacing and acceleration are "as the Fused DDIM
    Sampler"; images_per_prompt 1-64, max_batch and decode_tile_size 0 = automatic (the default), the tile 128-4096
    as the Tiled VAE nodes' (defaults and ranges here must not drift unnoticed)."""
    from leandiffusion.nodes.sampler import LeanFusedDDIMSampler

    def bare(decl):
        return decl[0], {k: v for k, v in (decl[1] if len(decl) > 1 else {}).items() if k != "tooltip"}

    mine, fused = LeanStreamSampler.INPUT_TYPES()["required"], LeanFusedDDIMSampler.INPUT_TYPES()["required"]
    for name in ("lean_model", "negative", "seed", "steps", "cfg", "width", "height", "timestep_spacing",
                 "acceleration"):
        assert bare(mine[name]) == bare(fused[name]), name
    assert bare(mine["images_per_prompt"]) == ("INT", {"default": 1, "min": 1, "max": 64})
    assert bare(mine["max_batch"])[1]["default"] == 0
    assert bare(mine["decode_tile_size"]) == ("INT", {"default": 0, "min": 0, "max": 4096, "step": 32})
    assert LeanStreamSampler.CATEGORY == "LeanDiffusion/sampling"


def test_node_hands_every_widget_to_run_stream(engine, monkeypatch):
    """The node hands decode_tile_size, images_per_prompt and negative_cond on (the other node tests run with the
    defaults, so dropping one would pass them)."""
    import leandiffusion.nodes.stream as node_module

    class Result:
        images, latents = "images", "latents"

    seen = {}
    monkeypatch.setattr(node_module, "run_stream", lambda model, settings, **kw: seen.update(kw, settings=settings)
                        or Result())
    pos, neg = [["pos"]], [["neg"]]
    image, latent = LeanStreamSampler().run(engine, PROMPTS, "fog", 9, 4, 3.0, 72, 80, "trailing", "none", 3, 5, 256,
                                            positive_cond=pos, negative_cond=neg)
    assert (image, latent) == ("images", {"samples": "latents"})
    s = seen["settings"]
    assert (s.negative, s.seed, s.steps, s.cfg, s.width, s.height) == ("fog", 9, 4, 3.0, 72, 80)
    assert (s.timestep_spacing, s.acceleration, s.images_per_prompt, s.max_batch, s.decode_tile_size) == (
        "trailing", "none", 3, 5, 256)
    assert seen["positive_cond"] is pos and seen["negative_cond"] is neg

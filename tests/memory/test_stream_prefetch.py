"""Next-forward prefetch (``memory/stream_prefetch.py``, ``BlockStreamer.prefetch_next``): eager streamed steps copy
the next step's head blocks during the current step, each block once per step, and the latent stays the same.

Guards issue 42's 6 GB line's means (the copy engine kept busy across steps, the picture unchanged): a tiny Z-Image
whose DiT streams under ``stream`` on the CPU (the CUDA path's schedule, copies synchronous). The prefetched copies
are really what the next step computes on: the head blocks' host copies are spoiled before the last step, and only
the prefetched run still gives the latent (without prefetch the spoil shows, so the check can fail).
"""
import pytest
import torch

from leandiffusion.memory.engine import parts_from_components
from leandiffusion.memory.streaming import BlockStreamer
from leandiffusion.sampling.flow.loop import sample_flow
from leandiffusion.sampling.flow.settings import FlowSettings
from leandiffusion.tests.kit.partial_stream import engine_under, replace_deeper

WORKING_SHAPE = (1, 8, 8)


def _settings(steps: int) -> FlowSettings:
    return FlowSettings("a red cat", seed=3, steps=steps, cfg=1.0, width=48, height=32, acceleration="none")


def _engine():
    """The tiny Z-Image with a DiT of 2 + 2 + 6 blocks, most of them streamed."""
    from diffusers import ZImageTransformer2DModel

    from leandiffusion.memory import tiny_zimage

    comps = tiny_zimage.build_tiny_zimage(0)
    build = lambda: (ZImageTransformer2DModel(**{**tiny_zimage.transformer_config(), "n_layers": 6,  # noqa: E731
                                                  "n_refiner_layers": 2}), comps["text_encoder"])
    engine = engine_under(parts_from_components(replace_deeper(comps, 1, build), name="tiny-zimage-prefetch"),
                          "stream", WORKING_SHAPE)
    streamer = engine.placement.streamer
    assert streamer._prefetch_after and len(engine.placement.schedule.streamed) > 3  # heads to prefetch, a ring
    return engine, streamer


def _heads(streamer) -> list[int]:
    return list(streamer._issue_after.get(-1, []))


def _no_prefetch(monkeypatch):
    monkeypatch.setattr(BlockStreamer, "prefetch_next", lambda self, on: None)


def test_each_step_copies_the_next_step_s_heads_once_and_the_last_copies_none(monkeypatch):
    engine, streamer = _engine()
    forwards: list[list[int]] = []
    start, copy = streamer._start, streamer.copier.copy
    monkeypatch.setattr(streamer, "_start", lambda: (forwards.append([]), start())[1])
    monkeypatch.setattr(streamer.copier, "copy",
                        lambda dst, src, k, gate: (forwards[-1].append(k), copy(dst, src, k, gate))[1])
    sample_flow(engine, _settings(3), quiet=True)
    heads, every = _heads(streamer), list(range(len(engine.placement.schedule.streamed)))
    rest = [k for k in every if k not in heads]
    assert forwards[0] == every + heads  # the first step copies its own blocks, then the second step's heads
    assert forwards[1] == rest + heads  # its own heads were copied ahead
    assert forwards[2] == rest  # the last step copies nothing ahead
    assert not streamer._prefetch and streamer._prefetched == set()  # the run's end forgets the prefetch


@pytest.mark.parametrize("prefetch", [True, False])
def test_the_last_step_computes_on_the_heads_copied_during_the_step_before(monkeypatch, prefetch):
    engine, streamer = _engine()
    if not prefetch:
        _no_prefetch(monkeypatch)
    want = sample_flow(engine, _settings(2), quiet=True)["samples"]
    saved = {k: streamer._src[k].clone() for k in _heads(streamer)}
    start, forwards = streamer._start, []

    def spoiled_before_the_last_forward():
        forwards.append(1)
        if len(forwards) == 2:
            for k in saved:
                streamer._src[k].fill_(0x7f)
        start()

    monkeypatch.setattr(streamer, "_start", spoiled_before_the_last_forward)
    try:
        got = sample_flow(engine, _settings(2), quiet=True)["samples"]
    finally:
        for k, values in saved.items():
            streamer._src[k].copy_(values)
    assert torch.equal(got, want) == prefetch


def test_prefetch_gives_the_latent_of_the_same_engine_without_it(monkeypatch):
    engine, _ = _engine()
    got = sample_flow(engine, _settings(3), quiet=True)["samples"]
    _no_prefetch(monkeypatch)
    assert torch.equal(sample_flow(engine, _settings(3), quiet=True)["samples"], got)


def test_every_copy_waits_for_the_unit_that_frees_its_ring_slice(monkeypatch):
    """The gate each copy is issued with is the unit its ring slice's last earlier reader is (``wait_for``), or the
    forward's fork for a head copied at the start; a head copied ahead waits for its prefetch point."""
    from leandiffusion.memory.stream_schedule import prefetch_points

    engine, streamer = _engine()
    gates: dict[int, set] = {}
    copy = streamer.copier.copy
    monkeypatch.setattr(streamer.copier, "copy",
                        lambda dst, src, k, gate: (gates.setdefault(k, set()).add(gate), copy(dst, src, k, gate))[1])
    sample_flow(engine, _settings(2), quiet=True)
    schedule = engine.placement.schedule
    ahead = {k: j for j, ks in prefetch_points(schedule).items() for k in ks}
    for k, dep in enumerate(schedule.wait_for):
        assert gates[k] == ({None, ahead[k]} if dep == -1 else {dep}), k

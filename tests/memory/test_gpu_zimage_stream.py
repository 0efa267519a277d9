"""GPU: the full-size Z-Image-Turbo (random bf16 weights: the 6.15B DiT, the Qwen3-4B text encoder, the Flux VAE)
under ``stream`` at 6 GB keeps every stage within the budget with the allocator capped, and computes what the fully
resident model computes.

Guards issue 42's "stream keeps every stage (the 4B text encoder included, streamed block by block like the DiT)
within vram_budget_gb": the process's caching allocator is capped at the budget (plus what it held before the
engine existed) with ``torch.cuda.set_per_process_memory_fraction``, so a stage that needs more fails with out of
memory instead of passing quietly; the peak reserved memory is read back as well. The references are the same
modules fully resident (policy ``full``, no cap). bf16 results of the same kernels may differ where cuBLAS picks
another algorithm under the cap (a smaller workspace): ``REL`` bounds that; a block computing with another block's
weights (a stale ring slot) moves the result by far more.
"""
import pytest
import torch

from leandiffusion.memory.load import build_engine
from leandiffusion.sampling.flow.loop import sample_flow
from leandiffusion.sampling.flow.settings import FlowSettings
from leandiffusion.sampling.flow.text import encode_prompts
from leandiffusion.tests.kit.gpu_budget import GiB, capped_allocator, drop_engine, host_parts, peak_over, rel, \
    reserved_now

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BUDGET_GB = 6.0
REL = 2e-2
# 512 tokens after the chat template (the tokenizer is byte-level: one token per byte; longer prompts are cut
# at 512): the longest caption the sampler takes, the plan's text working shape and the largest caption bucket.
LONG = ("a lighthouse on a cliff at dusk, waves breaking on black rocks, gulls over the foam, warm light in every "
        "window, a fishing boat coming home, clouds lit orange and violet, ") * 5
NEGATIVE = "blurry, dark"


def _settings(acceleration: str) -> FlowSettings:
    return FlowSettings(LONG, NEGATIVE, seed=7, steps=2, cfg=4.0, width=1024, height=1024, batch_size=1,
                        acceleration=acceleration)


@pytest.fixture(scope="module")
def parts():
    from leandiffusion.bench.zimage_models import full_zimage_components

    return host_parts(full_zimage_components(device="cuda"), "z-image-turbo-random")


@pytest.fixture(scope="module")
def reference(parts):
    engine = build_engine(parts, "full", weight_dtype="bf16", vae_dtype="bf16", device="cuda")
    try:
        text = [t.clone() for t in encode_prompts(engine, [LONG])]
        latent = sample_flow(engine, _settings("none"), quiet=True)["samples"]
    finally:
        drop_engine(engine)
    assert text[0].shape[0] == 512  # the prompt really fills the longest caption
    return {"text": text, "latent": latent}


@pytest.fixture(scope="module")
def streamed(parts, reference):
    """The engine under ``stream`` and what the process held (reserved) before it existed."""
    base = reserved_now()
    engine = build_engine(parts, "stream", BUDGET_GB, weight_dtype="bf16", vae_dtype="bf16", device="cuda")
    yield engine, base
    drop_engine(engine)


@pytest.fixture
def capped(streamed):
    """The allocator capped at the budget plus what the process held before the engine; yields the engine."""
    engine, base = streamed
    with capped_allocator(BUDGET_GB, base):
        yield engine


def _peak_over_base(streamed) -> int:
    return peak_over(streamed[1])


def test_the_plan_streams_both_within_the_budget(streamed):
    plan = streamed[0].placement.plan
    assert plan.text_mode == "stream" and plan.unet_mode == "stream" and plan.streamed_units > 0
    assert max(plan.peaks.values()) <= BUDGET_GB * GiB


def test_the_streamed_text_encoder_stays_within_the_budget(streamed, reference, capped):
    hidden = encode_prompts(capped, [LONG])
    peak = _peak_over_base(streamed)
    assert peak <= BUDGET_GB * GiB, f"text stage peak reserved {peak / GiB:.3f} GiB over {BUDGET_GB} GiB"
    assert rel(hidden[0], reference["text"][0]) <= REL
    # the ring is gone once the stage exits: what stays is the placement's resident set (and the returned rows)
    held = torch.cuda.memory_allocated() - streamed[1]
    assert held <= capped.placement.budget.resident_bytes + 64 * 2 ** 20


@pytest.mark.parametrize("acceleration", ["none", "cuda_graph"])
def test_the_streamed_dit_stays_within_the_budget(streamed, reference, capped, acceleration):
    """Prompt -> latent through the Fused Flow Sampler: text stage, then the DiT's steps (eager under either
    acceleration: the DiT streams) with a 512-token caption, batch 2 (guidance) at 1024 px."""
    latent = sample_flow(capped, _settings(acceleration), quiet=True)["samples"]
    peak = _peak_over_base(streamed)
    assert peak <= BUDGET_GB * GiB, f"peak reserved {peak / GiB:.3f} GiB over {BUDGET_GB} GiB ({acceleration})"
    assert rel(latent, reference["latent"]) <= REL
    measured = capped.placement.measured
    assert {"text", "unet"} <= set(measured)
    assert all(value <= BUDGET_GB * GiB + streamed[1] for value, _ in measured.values())


def test_a_short_prompt_under_cuda_graph_steps_the_streamed_dit_eagerly(streamed, capped):
    """Two ``cuda_graph`` runs of a short prompt at cfg 1 under the cap: the DiT streams blocks at every step, so
    its steps run eagerly (``sampling.dit_steps.streams_weights``: nothing captured) and give the same latent twice;
    the peak stays within the budget."""
    from leandiffusion.sampling.graph_runner import GraphRunner

    runner = GraphRunner()
    settings = FlowSettings("a red fox in the snow", seed=3, steps=2, cfg=1.0, width=1024, height=1024,
                            acceleration="cuda_graph")
    first = sample_flow(capped, settings, runner=runner, quiet=True)["samples"]
    second = sample_flow(capped, settings, runner=runner, quiet=True)["samples"]
    assert runner.captures(capped) == 0
    assert torch.equal(first, second)
    peak = _peak_over_base(streamed)
    assert peak <= BUDGET_GB * GiB, f"peak reserved {peak / GiB:.3f} GiB over {BUDGET_GB} GiB"


def test_a_one_row_run_holds_streamed_blocks_in_its_spare_room_with_the_same_latent(streamed, capped, monkeypatch):
    """cfg 1 computes one row where the plan reserved activations for two: the run holds some streamed DiT blocks
    in the room left (``memory.spare_room``), within the budget, and gives the latent of the same run holding
    none, bit for bit."""
    streamer = capped.placement.streamer
    held, hold = [], streamer.hold
    monkeypatch.setattr(streamer, "hold", lambda room: held.append(hold(room)) or held[-1])
    settings = FlowSettings("a red fox in the snow", seed=3, steps=2, cfg=1.0, width=1024, height=1024,
                            acceleration="none")
    latent = sample_flow(capped, settings, quiet=True)["samples"]
    assert held and held[-1] > 0
    peak = _peak_over_base(streamed)
    assert peak <= BUDGET_GB * GiB, f"peak reserved {peak / GiB:.3f} GiB over {BUDGET_GB} GiB"
    monkeypatch.setattr(streamer, "hold", lambda room: 0)
    assert torch.equal(sample_flow(capped, settings, quiet=True)["samples"], latent)


def test_prefetching_the_next_step_s_blocks_gives_the_latent_of_the_steps_without_it(streamed, capped, monkeypatch):
    """Eager streamed steps copy the next step's head blocks during the current step (``memory.stream_prefetch``):
    on the GPU's copy and decode streams the latent equals the same run without the prefetch, bit for bit, with as
    many copies (each block once a step), within the budget."""
    streamer = capped.placement.streamer
    settings = FlowSettings("a red fox in the snow", seed=3, steps=3, cfg=1.0, width=1024, height=1024,
                            acceleration="none")
    switched, switch = [], streamer.prefetch_next
    monkeypatch.setattr(streamer, "prefetch_next", lambda on: (switched.append(on), switch(on))[1])
    before = streamer.copies_issued
    latent = sample_flow(capped, settings, quiet=True)["samples"]
    copies = streamer.copies_issued - before
    assert switched == [True, True, False]
    peak = _peak_over_base(streamed)
    assert peak <= BUDGET_GB * GiB, f"peak reserved {peak / GiB:.3f} GiB over {BUDGET_GB} GiB"
    monkeypatch.setattr(streamer, "prefetch_next", lambda on: None)
    before = streamer.copies_issued
    assert torch.equal(sample_flow(capped, settings, quiet=True)["samples"], latent)
    assert streamer.copies_issued - before == copies

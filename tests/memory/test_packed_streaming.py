"""Streamed bf16 weights that cross packed give the model the same weights, so the same outputs, bit for bit, as
plain copies; the plan reserves the packed slot inside the budget, and falls back to plain copies without room.

Guards issue 42's 6 GB line's means (fewer bytes over PCIe, the picture unchanged): a tiny Z-Image in bf16 under
``stream`` on the CPU with the planner's packing switch forced on (on its own it packs on CUDA only), against the
same engine with packing off: the DiT's and the text encoder's streamed blocks really cross packed, the flow
sampler's latent is equal, and ``remove`` leaves plain modules. A wrong ring/slot split, a slot too small, a decode
into the wrong slice or a stale slot would each change the latent.
"""
import pytest
import torch

from leandiffusion.memory import planner
from leandiffusion.memory.engine import parts_from_components
from leandiffusion.memory.load import build_engine
from leandiffusion.memory.packed_weights import SLOT_FRACTION, slot_bytes_for, slot_count, slot_fraction
from leandiffusion.memory.stream_schedule import plan_schedule
from leandiffusion.memory.unet_units import Unit
from leandiffusion.sampling.flow.loop import sample_flow
from leandiffusion.sampling.flow.settings import FlowSettings
from leandiffusion.memory.plan import GiB, module_bytes
from leandiffusion.memory.policies import stream_working_minimum_gb
from leandiffusion.tests.kit.partial_stream import removed_to_plain, replace_deeper

WORKING_SHAPE = (1, 8, 8)
SETTINGS = FlowSettings("a red cat", "blurry", seed=3, steps=2, cfg=4.0, width=48, height=32, acceleration="none")


def _parts():
    """A tiny Z-Image whose DiT (4 + 2 blocks, wider than the suite's tiny one so each block packs) and 6-layer
    text encoder both stream at the partly-streamed budget."""
    from diffusers import ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    from leandiffusion.memory import tiny_zimage

    comps = tiny_zimage.build_tiny_zimage(0)
    config = Qwen3Config(**{**tiny_zimage.text_config(len(comps["tokenizer"])).to_dict(), "num_hidden_layers": 6,
                            "intermediate_size": 2048, "layer_types": None})

    def build():
        dit = ZImageTransformer2DModel(**{**tiny_zimage.transformer_config(), "n_layers": 4, "n_refiner_layers": 2})
        return dit, Qwen3Model(config)

    return parts_from_components(replace_deeper(comps, 1, build), name="tiny-zimage-packed")


def _engine(monkeypatch, packed: bool, slots: int = 1):
    fraction = SLOT_FRACTION if packed else 0.0
    monkeypatch.setenv("LEANDIFFUSION_PACKED_SLOTS", str(slots))
    monkeypatch.setattr(planner, "slot_fraction", lambda device, dtype: fraction if dtype == torch.bfloat16 else 0.0)
    parts = _parts()
    # the working minimum in bf16 plus 40% (60% with two slots) of the DiT: the DiT's and the text's packed slots
    # fit, some DiT blocks stay resident, the rest and the text stream
    minimum = stream_working_minimum_gb(parts, "cpu", dtype=torch.bfloat16, working_shape=WORKING_SHAPE)
    budget = minimum + (0.2 + 0.2 * slots) * module_bytes(parts.unet, torch.bfloat16) / GiB
    return build_engine(parts, "stream", budget, weight_dtype="bf16", vae_dtype="fp32", device="cpu",
                        working_shape=WORKING_SHAPE)


@pytest.mark.parametrize("slots", [1, 2])
def test_packed_streaming_gives_the_latent_of_plain_streaming(monkeypatch, slots):
    plain = _engine(monkeypatch, packed=False)
    assert plain.placement.plan.packed_slot_bytes == 0
    want = sample_flow(plain, SETTINGS, quiet=True)["samples"]

    engine = _engine(monkeypatch, packed=True, slots=slots)
    plan, placement = engine.placement.plan, engine.placement
    assert plan.unet_mode == "stream" and plan.text_mode == "stream"
    assert plan.packed_slot_bytes == placement.schedule.slot_bytes > 0 and placement.schedule.slots == slots
    assert plan.text_packed_slot_bytes == placement.text_schedule.slot_bytes > 0
    assert max(plan.peaks.values()) <= plan.budget_bytes
    assert "cross packed losslessly" in engine.plan
    dit_streamer = placement.streamer
    assert dit_streamer.packed_units == len(placement.schedule.streamed) > 0
    assert len(placement.schedule.streamed) < plan.total_units  # some blocks stay resident
    for _ in range(2):  # the second run reuses the ring and the slot
        assert torch.equal(sample_flow(engine, SETTINGS, quiet=True)["samples"], want)
    packed_text = [s.packed_units for s in placement._swaps["text"]]
    assert packed_text and max(packed_text) > 0  # the text encoder's layers crossed packed too
    removed_to_plain(engine)


def test_the_schedule_reserves_the_slot_after_the_ring_or_goes_plain(monkeypatch):
    monkeypatch.delenv("LEANDIFFUSION_PACKED_SLOTS", raising=False)
    units = [Unit(f"b{i}", 1024 * 512, 1e9) for i in range(8)]
    slot = slot_bytes_for(1024 * 512, SLOT_FRACTION)
    sched = plan_schedule(units, 7 * 1024 * 512, SLOT_FRACTION)
    assert sched.slot_bytes == slot and sched.arena_bytes == sched.ring_bytes + slot
    assert all(off + 1024 * 512 <= sched.ring_bytes for off in sched.offsets)  # no unit lands in the slot
    assert sched.resident_unit_bytes + sched.arena_bytes <= 7 * 1024 * 512
    tight = plan_schedule(units, 3 * 1024 * 512, SLOT_FRACTION)  # room for the minimum ring only
    assert tight.slot_bytes == 0 and tight.arena_bytes == 3 * 1024 * 512


def test_packing_is_for_bf16_on_cuda_and_can_be_turned_off(monkeypatch):
    monkeypatch.delenv("LEANDIFFUSION_PACKED_STREAMING", raising=False)
    assert slot_fraction(torch.device("cuda"), torch.bfloat16) == SLOT_FRACTION
    assert slot_fraction(torch.device("cuda"), torch.float16) == 0.0
    assert slot_fraction(torch.device("cpu"), torch.bfloat16) == 0.0
    monkeypatch.setenv("LEANDIFFUSION_PACKED_STREAMING", "off")
    assert slot_fraction(torch.device("cuda"), torch.bfloat16) == 0.0
    monkeypatch.setenv("LEANDIFFUSION_PACKED_STREAMING", "maybe")
    with pytest.raises(ValueError, match="LEANDIFFUSION_PACKED_STREAMING='maybe'"):
        slot_fraction(torch.device("cuda"), torch.bfloat16)
    monkeypatch.setenv("LEANDIFFUSION_PACKED_SLOTS", "3")
    with pytest.raises(ValueError, match="LEANDIFFUSION_PACKED_SLOTS='3': expected 1 or 2"):
        slot_count()


def test_only_stages_that_wait_on_their_copies_pack():
    """A stage's compute per streamed byte decides (``stream_schedule.copy_bound``): Qwen-Image-Edit's DiT at 12 GB
    is compute-bound (plain copies, more of it resident), its text encoder and Z-Image's DiT are not."""
    from leandiffusion.memory.stream_schedule import PACK_BELOW_FLOPS_PER_BYTE, copy_bound

    light = [Unit("a", 1000, 0.5 * PACK_BELOW_FLOPS_PER_BYTE * 1000)]
    heavy = [Unit("a", 1000, 2 * PACK_BELOW_FLOPS_PER_BYTE * 1000)]
    assert copy_bound(light) and not copy_bound(heavy) and not copy_bound([])
    assert copy_bound(heavy, rows_scale=0.25) and not copy_bound(light, rows_scale=4.0)  # FLOPs scale with the rows


def test_packing_that_runs_out_of_memory_leaves_plain_copies_and_the_same_latent(monkeypatch):
    """The device (or host) had no room to pack in at load: the engine still loads, every block crosses plain."""
    from leandiffusion.memory import streaming

    plain = sample_flow(_engine(monkeypatch, packed=False), SETTINGS, quiet=True)["samples"]

    def no_room(*args, **kwargs):
        raise torch.OutOfMemoryError("no room to pack")

    monkeypatch.setattr(streaming, "pack_words", no_room)
    engine = _engine(monkeypatch, packed=True)
    assert engine.placement.schedule.slot_bytes > 0 and engine.placement.streamer.packed_units == 0
    assert torch.equal(sample_flow(engine, SETTINGS, quiet=True)["samples"], plain)


def test_held_blocks_give_the_same_latent_and_really_replace_the_host_copies(monkeypatch):
    """Held units cross once, in the first forward after ``hold`` (packed, into their held slices), and are computed
    from there: spoiling every host copy after that first run leaves the latent unchanged until they are released."""
    engine = _engine(monkeypatch, packed=True, slots=2)
    want = sample_flow(engine, SETTINGS, quiet=True)["samples"]
    streamer = engine.placement.streamer
    smallest = min(lay.nbytes for lay in streamer._layouts)
    assert streamer.hold(0) == 0 and streamer.hold(smallest - 1) == 0  # nothing fits
    held = streamer.hold(10 * 2 ** 30)
    assert held >= sum(lay.nbytes for lay in streamer._layouts)
    issued = streamer.copies_issued
    assert torch.equal(sample_flow(engine, SETTINGS, quiet=True)["samples"], want)  # the fill: each unit once
    assert streamer.copies_issued - issued == len(streamer._layouts)
    # the host copies (plain and packed) of every held unit are spoiled: only the held copies can give the latent
    spoiled = [(src.clone(), src) for src in streamer._src]
    packed = [(p.host.tensor.clone(), p.host.tensor) for p in streamer._packed if p is not None]
    assert packed
    for _, src in spoiled + packed:
        src.fill_(0x7f)
    try:
        issued = streamer.copies_issued
        assert torch.equal(sample_flow(engine, SETTINGS, quiet=True)["samples"], want)
        assert streamer.copies_issued == issued  # nothing crossed
        streamer.release_held()
        assert not torch.equal(sample_flow(engine, SETTINGS, quiet=True)["samples"], want)  # the spoil is real
    finally:
        for saved, src in spoiled + packed:
            src.copy_(saved)
    assert torch.equal(sample_flow(engine, SETTINGS, quiet=True)["samples"], want)
    removed_to_plain(engine)


def test_a_hold_released_midway_points_its_units_back_at_the_ring(monkeypatch):
    """Holding some units, running, releasing, holding again: every run gives the latent (the parameters of a
    released unit are its ring slice again, a new hold fills its slices again)."""
    engine = _engine(monkeypatch, packed=True, slots=2)
    want = sample_flow(engine, SETTINGS, quiet=True)["samples"]
    streamer = engine.placement.streamer
    first = streamer._layouts[0].nbytes
    for room in (first, 10 * 2 ** 30, first):
        assert streamer.hold(room) > 0
        assert torch.equal(sample_flow(engine, SETTINGS, quiet=True)["samples"], want)
        streamer.release_held()
        ring = streamer.arena.untyped_storage().data_ptr()
        assert all(p.untyped_storage().data_ptr() == ring for params in streamer._streamed for p in params)
        assert torch.equal(sample_flow(engine, SETTINGS, quiet=True)["samples"], want)
    removed_to_plain(engine)

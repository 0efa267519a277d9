"""The VRAM plan of the full-size Z-Image-Turbo (the 6.15B DiT at diffusers' defaults, the Qwen3-4B text encoder, the
Flux VAE; built on the ``meta`` device: architecture only, no memory) under every policy on CUDA, bf16.

Guards issue 42's memory promise on the plan side: at a 6 GB budget every stage's estimated peak (the 4B text
encoder's included) is within the budget, the text encoder streams block by block with its embedding table on the
host, the DiT's resident set fills what the stages leave, and the estimates behind it are the documented ones
(worked by hand here: a plan that dropped the caption tokens, the text stage or the CUDA workspace would pass a
peaks-only check). The pure parts (the all-streamed schedule, the text units) are checked on stand-ins.
"""
import pytest
import torch

from leandiffusion.memory.engine import ModelParts
from leandiffusion.memory.hostmem import FlatLayout
from leandiffusion.memory.plan import GiB
from leandiffusion.memory.planner import plan_placement, working_minimum_bytes
from leandiffusion.memory.policy_config import PolicyConfig, VramPolicy
from leandiffusion.memory.vram_budget import StageMode

MiB = 2 ** 20
CUDA = torch.device("cuda", 0)
SHAPE = (2, 128, 128)  # batch 2 (guidance) at 1024 px
QWEN = dict(hidden=2560, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=9728, vocab=151936)


@pytest.fixture(scope="module")
def parts():
    from diffusers import AutoencoderKL, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    from leandiffusion.bench.zimage_models import FLUX_VAE, QWEN3_4B

    assert (QWEN3_4B["hidden_size"], QWEN3_4B["num_hidden_layers"], QWEN3_4B["num_attention_heads"],
            QWEN3_4B["num_key_value_heads"], QWEN3_4B["head_dim"], QWEN3_4B["intermediate_size"],
            QWEN3_4B["vocab_size"]) == tuple(QWEN.values())
    with torch.device("meta"):
        dit = ZImageTransformer2DModel()
        text = Qwen3Model(Qwen3Config(**QWEN3_4B))
        vae = AutoencoderKL(**FLUX_VAE)
    return ModelParts(family="zimage", unet=dit, vae=vae, text_encoder=text, tokenizer=None, scheduler_config={},
                      name="z-image-turbo")


def _plan(parts, policy, budget_gb=6.0, free=None):
    req = VramPolicy(policy)
    config = PolicyConfig(VramPolicy.FULL if req == VramPolicy.AUTO else req, req, CUDA, torch.bfloat16,
                          torch.bfloat16, torch.bfloat16, int(budget_gb * GiB), SHAPE)
    return plan_placement(parts, config, free, "z-image-turbo")


def test_the_dit_and_text_activation_estimates_by_hand(parts):
    """DiT: a main block over 4096 image + 512 caption tokens (the largest bucket), transient factor 16, x 1.3
    fragmentation, bf16, + 576 MiB CUDA workspace. Text: 512 tokens x batch 2, 37 kept hidden states + 36 layers'
    key/value cache (2 x 8 heads x 128) + the MLP's 3 x 9728 + 2 x 2560, x 1.3, bf16, + 576 MiB."""
    plan = _plan(parts, "stream").plan
    assert plan.unet_activation_bytes == int(1.3 * 20 * (2 * 4608 * 3840) * 2) + 576 * MiB
    per_token = 37 * 2560 + 36 * 2 * 1024 + 3 * 9728 + 2 * 2560
    assert plan.text_activation_bytes == int(1.3 * 2 * 512 * per_token * 2) + 256 * MiB
    assert plan.text_tokens == 512


def test_at_6_gb_every_stage_fits_and_the_text_encoder_streams(parts):
    planned = _plan(parts, "stream")
    plan, budget = planned.plan, planned.budget
    assert max(plan.peaks.values()) <= 6 * GiB
    assert plan.text_mode == "stream" and plan.text_streamed_units == plan.text_total_units == QWEN["layers"]
    layer = max(u.nbytes for u in planned.text_schedule.order)
    assert layer > 200e6 and plan.text_arena_bytes >= 3 * layer
    assert plan.text_host_bytes == FlatLayout.of([parts.text_encoder.embed_tokens.weight], torch.bfloat16).nbytes
    assert plan.text_host_bytes >= QWEN["vocab"] * QWEN["hidden"] * 2  # 0.78 GB that never reaches the device
    assert plan.text_fixed_bytes == FlatLayout.of([parts.text_encoder.norm.weight], torch.bfloat16).nbytes
    dit_block = max(u.nbytes for u in planned.schedule.order)
    assert 0 < plan.streamed_units < plan.total_units == 34 and plan.unet_resident_bytes > 2 * dit_block
    assert 6 * GiB - max(plan.peaks.values()) < dit_block  # the DiT's resident set fills what the stages leave
    # both stages wait on their copies at this budget: their rings carry packed slots (3/4 of a block each)
    assert plan.packed_slot_bytes >= 2 * 0.75 * dit_block and plan.text_packed_slot_bytes >= 2 * 0.75 * layer
    assert plan.arena_bytes >= 3 * dit_block + plan.packed_slot_bytes
    # the typed budget the placement enforces says the same
    assert budget.text is StageMode.STREAM and budget.text_on_device and budget.limit_bytes == 6 * GiB
    assert budget.resident_bytes == (plan.unet_fixed_bytes + plan.unet_resident_bytes + plan.arena_bytes
                                     + plan.text_fixed_bytes)
    assert plan.peaks == {"text": budget.resident_bytes + budget.text_arena_bytes + budget.text_activation_bytes,
                          "unet": budget.resident_bytes + plan.unet_activation_bytes,
                          "vae": budget.resident_bytes + plan.vae_bytes}
    assert budget.entering_bytes("text") == plan.text_arena_bytes + plan.text_activation_bytes
    report = plan.render()
    assert "cross packed losslessly" in report
    assert "streamed 36 of 36 blocks" in report and "embedding table 0.72 GB on the host" in report
    assert "activations+workspace estimate 0.75 GB at 512 tokens" in report


def test_every_budget_from_the_working_minimum_up_keeps_every_stage_within_it(parts):
    minimum = working_minimum_bytes(parts, CUDA, torch.bfloat16, SHAPE)
    modes = set()
    for budget in (minimum / GiB, 3.0, 4.0, 6.0, 8.0, 12.0, 20.0, 24.0):
        if budget < minimum / GiB:
            continue
        planned = _plan(parts, "stream", budget)
        plan = planned.plan
        assert max(plan.peaks.values()) <= plan.budget_bytes, budget
        modes.add(plan.text_mode)
        if plan.text_mode == "while used":  # what the text stage brings in: the whole encoder and its activations
            assert planned.budget.entering_bytes("text") == plan.text_bytes + plan.text_activation_bytes
    assert modes == {"stream", "while used"}  # a roomy budget keeps the encoder whole, visiting while used
    with pytest.raises(ValueError, match=r"working minimum of [0-9.]+ GB .*text stage: staging") as info:
        _plan(parts, "stream", minimum / GiB * 0.95)
    quoted = float(str(info.value).split("working minimum of ")[1].split(" GB")[0])
    assert minimum / GiB <= quoted <= minimum / GiB * 1.001


def test_resident_policies_and_auto(parts):
    """``full`` holds all 20 GB; ``balanced`` brings the 8 GB encoder in for its stage; ``lowvram`` runs it on the
    CPU; ``auto`` picks full with room for it, else stream at 90% of the free memory."""
    sizes = _plan(parts, "full").plan
    T, U, V, ta = sizes.text_bytes, sizes.unet_bytes, sizes.vae_bytes, sizes.text_activation_bytes
    assert sizes.peaks["text"] == T + U + V + ta and sizes.peaks["unet"] == T + U + V + sizes.unet_activation_bytes
    assert _plan(parts, "balanced").plan.peaks["text"] == U + T + ta
    lowvram = _plan(parts, "lowvram").plan
    assert lowvram.text_mode == "cpu" and lowvram.text_dtype == "fp32" and lowvram.peaks["text"] == U
    assert _plan(parts, "auto", free=40 * GiB).plan.policy == "full"
    small = _plan(parts, "auto", budget_gb=12.0, free=8 * GiB).plan
    assert small.policy == "stream" and small.budget_bytes == int(8 * GiB * 0.9)
    assert max(small.peaks.values()) <= small.budget_bytes


def test_plan_all_streamed_streams_every_unit_within_the_room():
    from leandiffusion.memory.stream_schedule import plan_all_streamed
    from leandiffusion.memory.unet_units import Unit

    units = [Unit(f"layers.{i}", 1024, 1e9) for i in range(10)]
    sched = plan_all_streamed(units, 5 * 1024)
    assert sched.streamed == tuple(range(10)) and 3 * 1024 <= sched.arena_bytes <= 5 * 1024
    assert sched.resident_unit_bytes == 0
    small = plan_all_streamed(units[:2], 100 * 1024)  # never a ring bigger than every unit needs
    assert small.arena_bytes == 3 * 1024
    with pytest.raises(ValueError, match="minimum staging arena"):
        plan_all_streamed(units, 3 * 1024 - 1)


def test_text_units_of_a_qwen3_encoder_and_none_for_clip():
    """One unit per decoder layer with its exact flat size and ``2 x tokens x weights`` plus attention FLOPs; an SD
    model's CLIP encoders do not stream (the plan keeps them whole or on the CPU as before)."""
    from transformers import Qwen3Config, Qwen3Model

    from leandiffusion.memory.engine import modules_of_stage
    from leandiffusion.memory.text_units import text_stream
    from leandiffusion.tests.kit import tiny_parts

    config = Qwen3Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    encoder = Qwen3Model(config)
    info = text_stream([encoder], torch.float32, batch=2, device_type="cpu", tokens=10)
    assert [u.name for u in info.units] == ["layers.0", "layers.1", "layers.2"]
    params = list(encoder.layers[1].parameters())
    weights = sum(p.numel() for p in params)
    assert info.units[1].nbytes == FlatLayout.of(params, torch.float32).nbytes
    assert info.units[1].flops == 2 * (2.0 * 10 * weights + 4.0 * 10 ** 2 * 32)
    assert info.host_bytes == FlatLayout.of([encoder.embed_tokens.weight], torch.float32).nbytes
    assert info.activation_bytes == int(1.3 * 2 * 10 * (4 * 32 + 3 * 2 * 16 + 3 * 64 + 2 * 32) * 4)
    for family in ("sd1", "sdxl"):
        assert text_stream(modules_of_stage(tiny_parts(family), "text"), torch.float32, 2, "cpu") is None


def test_the_plans_token_counts_are_the_samplers_limits():
    """The activation estimates hold for every prompt the flow sampler accepts only while the plan's token counts
    are its limits: the largest caption bucket and the longest prompt it encodes."""
    from leandiffusion.memory.dit_units import CAPTION_TOKENS
    from leandiffusion.memory.text_units import TEXT_TOKENS
    from leandiffusion.sampling.flow.dit_forward import CAPTION_BUCKETS
    from leandiffusion.sampling.flow.text import MAX_TOKENS

    assert CAPTION_TOKENS == CAPTION_BUCKETS[-1] and TEXT_TOKENS == MAX_TOKENS


def test_the_dit_packs_at_the_rows_its_sampler_runs(parts, monkeypatch):
    """Z-Image-Turbo samples at cfg 1, one row a call (families.json ``default_rows``): ~5k FLOPs per streamed byte,
    copy-bound, so its DiT crosses packed; counted at the working shape's two rows (~10k) it would stay plain."""
    from leandiffusion.memory import planner

    assert planner.family_defaults("zimage")["default_rows"] == 1
    assert _plan(parts, "stream").plan.packed_slot_bytes > 0
    row = planner.family_defaults("zimage")
    del row["default_rows"]
    monkeypatch.setattr(planner, "family_defaults", lambda family: dict(row))
    two_rows = _plan(parts, "stream").plan
    assert two_rows.packed_slot_bytes == 0 and two_rows.text_packed_slot_bytes > 0

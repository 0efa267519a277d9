"""The VRAM plan of the full-size Qwen-Image (the 20.4B MMDiT at diffusers' defaults: 60 joint blocks of 339.8M
parameters, dim 3072; the Qwen2.5-VL-7B language model; the Qwen-Image VAE; built on the ``meta`` device:
architecture only, no memory) under ``stream`` on CUDA, bf16, and ``auto``'s choice.

Guards issue 44's "stream keeps every stage within vram_budget_gb" on the plan side: at 12 GB (bf16) and 8 GB
(fp8-stored blocks) every stage's estimated peak, the 7B language model's included, is within the budget, the
language model streams decoder layer by decoder layer with its embedding table on the host, and the DiT's resident
set fills what the stages leave; the estimates behind it are worked by hand (a plan that dropped the text tokens,
the CFG rows, an edit's reference tokens or the CUDA workspace would pass a peaks-only check).
"""
import pytest
import torch

from leandiffusion.memory.hostmem import FlatLayout
from leandiffusion.memory.plan import GiB
from leandiffusion.memory.planner import plan_placement, working_minimum_bytes
from leandiffusion.memory.policy_config import PolicyConfig, VramPolicy
from leandiffusion.memory.vram_budget import StageMode
from leandiffusion.tests.kit.qwen_image_full import meta_qwen_image_parts

MiB = 2 ** 20
CUDA = torch.device("cuda", 0)
SHAPE = (2, 128, 128)  # one guided image at 1024 px: the prompt's and the negative's rows in one call


@pytest.fixture(scope="module")
def parts():
    return meta_qwen_image_parts()


def _plan(parts, policy, budget_gb=12.0, free=None, shape=SHAPE):
    req = VramPolicy(policy)
    config = PolicyConfig(VramPolicy.FULL if req == VramPolicy.AUTO else req, req, CUDA, torch.bfloat16,
                          torch.bfloat16, torch.bfloat16, int(budget_gb * GiB), shape)
    return plan_placement(parts, config, free, "qwen-image")


def test_the_sizes_are_qwen_images(parts):
    assert sum(p.numel() for p in parts.unet.parameters()) == 20_430_401_088
    assert len(parts.unet.transformer_blocks) == 60
    assert sum(p.numel() for p in parts.unet.transformer_blocks[0].parameters()) == 339_831_296


def test_the_dit_and_text_activation_estimates_by_hand(parts, monkeypatch):
    """DiT: a joint block over 4096 image + 512 text tokens per row, 2 rows (the guided batch), dim 3072, transient
    factor 20, x 1.3 fragmentation, bf16, + 576 MiB CUDA workspace; an edit family's reference latent adds 4096
    tokens per row. Text: 1058 tokens (34 template + 1024) x 2 prompts, 29 hidden states + 28 layers' key/value
    cache (2 x 4 heads x 128) + the MLP's 3 x 18944 + 2 x 3584, x 1.3, bf16, + 256 MiB."""
    from leandiffusion.memory import planner

    plan = _plan(parts, "stream").plan
    assert plan.unet_activation_bytes == int(1.3 * 20 * (2 * 4608 * 3072) * 2) + 576 * MiB
    per_token = 29 * 3584 + 28 * 2 * 512 + 3 * 18944 + 2 * 3584
    assert plan.text_activation_bytes == int(1.3 * 2 * 1058 * per_token * 2) + 256 * MiB
    assert plan.text_tokens == 1058
    edit = dict(planner.family_defaults("qwen_image"), reference_images=1)
    monkeypatch.setattr(planner, "family_defaults", lambda family: dict(edit))
    assert _plan(parts, "stream").plan.unet_activation_bytes == int(1.3 * 20 * (2 * 8704 * 3072) * 2) + 576 * MiB


def test_at_12_gb_every_stage_fits_and_both_stream(parts):
    planned = _plan(parts, "stream")
    plan, budget = planned.plan, planned.budget
    assert max(plan.peaks.values()) <= 12 * GiB
    assert plan.text_mode == "stream" and plan.text_streamed_units == plan.text_total_units == 28
    layer = max(u.nbytes for u in planned.text_schedule.order)
    assert layer > 400e6 and plan.text_arena_bytes >= 3 * layer
    assert plan.text_host_bytes == FlatLayout.of([parts.text_encoder.embed_tokens.weight], torch.bfloat16).nbytes
    assert plan.text_host_bytes >= 152064 * 3584 * 2  # 1.09 GB that never reaches the device
    assert plan.text_fixed_bytes == FlatLayout.of([parts.text_encoder.norm.weight], torch.bfloat16).nbytes
    block = max(u.nbytes for u in planned.schedule.order)
    assert block >= 339_831_296 * 2
    assert 0 < plan.streamed_units < plan.total_units == 60 and plan.unet_resident_bytes >= 8 * block
    # text-to-image steps wait on their copies: both rings carry packed slots (the DiT's two, of 3/4 block each)
    assert plan.packed_slot_bytes == planned.schedule.slot_bytes >= 1.5 * block and plan.text_packed_slot_bytes > 0
    assert 12 * GiB - max(plan.peaks.values()) < block  # the DiT's resident set fills what the stages leave
    assert plan.arena_bytes >= 3 * block
    assert budget.text is StageMode.STREAM and budget.limit_bytes == 12 * GiB
    assert budget.resident_bytes == (plan.unet_fixed_bytes + plan.unet_resident_bytes + plan.arena_bytes
                                     + plan.text_fixed_bytes)
    assert plan.peaks == {"text": budget.resident_bytes + budget.text_arena_bytes + budget.text_activation_bytes,
                          "unet": budget.resident_bytes + plan.unet_activation_bytes,
                          "vae": budget.resident_bytes + plan.vae_bytes}
    assert "streamed 28 of 28 blocks" in plan.render()


def test_at_8_gb_with_fp8_blocks_every_stage_fits_and_fewer_bytes_stream(parts):
    fp8 = _plan(meta_qwen_image_parts(fp8_blocks=True), "stream", 8.0).plan
    assert max(fp8.peaks.values()) <= 8 * GiB
    assert fp8.text_mode == "stream" and 0 < fp8.streamed_units < 60
    bf16 = _plan(parts, "stream", 8.0).plan
    assert fp8.unet_streamed_bytes < 0.6 * bf16.unet_streamed_bytes  # half the bytes per block, more resident


def test_every_budget_from_the_working_minimum_up_keeps_every_stage_within_it(parts):
    minimum = working_minimum_bytes(parts, CUDA, torch.bfloat16, SHAPE)
    for budget in (minimum / GiB, 6.0, 8.0, 12.0, 16.0, 24.0, 40.0):
        plan = _plan(parts, "stream", budget).plan
        assert max(plan.peaks.values()) <= plan.budget_bytes, budget
    with pytest.raises(ValueError, match=r"vram_budget_gb=[0-9.]+ is below the working minimum of [0-9.]+ GB .*"
                                         r"text stage: staging [0-9.]+ GB \+ activations [0-9.]+ GB at 1058 tokens"):
        _plan(parts, "stream", minimum / GiB * 0.95)


def test_auto_picks_stream_when_the_free_memory_requires_it(parts):
    """``full`` needs the 38 GiB DiT, the 13 GiB language model and the VAE at once: with 80 GiB free auto keeps it;
    with 24 GiB free only ``stream`` fits (the DiT alone does not), at 90% of the free memory (below vram_budget_gb)."""
    full = _plan(parts, "full").plan
    assert full.peaks["unet"] > 53 * GiB
    assert _plan(parts, "auto", free=80 * GiB).plan.policy == "full"
    small = _plan(parts, "auto", budget_gb=40.0, free=24 * GiB).plan
    assert small.policy == "stream" and small.requested == "auto"
    assert small.budget_bytes == int(24 * GiB * 0.9) and max(small.peaks.values()) <= small.budget_bytes


def test_a_family_listing_its_policies_refuses_the_others(parts, monkeypatch):
    """The families.json ``vram_policies`` gate (a family whose stages cannot all stream yet lists the others)."""
    from leandiffusion.memory import planner

    row = dict(planner.family_defaults("qwen_image"), vram_policies=["full", "balanced", "lowvram"])
    monkeypatch.setattr(planner, "family_defaults", lambda family: dict(row))
    with pytest.raises(ValueError, match=r"vram_policy='stream': 'stream' is not supported yet for qwen_image; use "
                                         r"one of 'full', 'balanced', 'lowvram'"):
        _plan(parts, "stream")
    with pytest.raises(ValueError, match=r"vram_policy='auto': 'auto' chose 'stream' \(too little free VRAM"):
        _plan(parts, "auto", free=24 * GiB)


def test_the_plans_token_counts_are_the_samplers_limits():
    """The estimates hold for every prompt the Qwen-Image loop accepts only while the plan's token counts are its
    limits: the pipeline's template plus its longest prompt, and its longest embedding kept per prompt."""
    from leandiffusion.memory.families import family_defaults
    from leandiffusion.memory.qwen_units import TEXT_TOKENS
    from leandiffusion.sampling.qwen.text import MAX_SEQUENCE_LENGTH, MAX_TOKENS, TEMPLATE_TOKENS

    assert family_defaults("qwen_image")["text_tokens"] == TEMPLATE_TOKENS + MAX_TOKENS
    assert TEXT_TOKENS == MAX_SEQUENCE_LENGTH


def test_a_blocks_flops_count_each_stream_against_its_own_tokens(parts):
    """By hand, one joint block (dim 3072, MLP 12288): an image token meets the image stream's q/k/v/out and MLP,
    a text token the text stream's, each modulation linear (3072 -> 6 x 3072) one vector a row, and the joint
    attention 4 x N^2 x 3072. Counting all 339.8M weights against every token overstates the step ~2.6x here."""
    from leandiffusion.memory.qwen_units import dual_stream_block_unit

    dim, mlp = 3072, 12288
    stream = 4 * (dim * dim + dim) + 2 * 128 + (dim * mlp + mlp) + (mlp * dim + dim)
    modulation = 2 * (6 * dim * dim + 6 * dim)
    assert 2 * stream + modulation == 339_831_296
    image, text = 4096, 512
    unit = dual_stream_block_unit("b", parts.unet.transformer_blocks[0], torch.bfloat16, 2, image, text, dim)
    assert unit.flops == 2 * (2 * (image + text) * stream + 2 * modulation + 4 * (image + text) ** 2 * dim)
    assert unit.nbytes >= 339_831_296 * 2 and unit.out_numel == 2 * (image + text) * dim


def test_the_dit_crosses_packed_at_the_native_size_and_the_edit_stays_plain(parts):
    """The loader plans at the family's native 1328 px (two rows): a text-to-image step is ~6.9k FLOPs per streamed
    byte, copy-bound on an H200's ~52 GB/s, so its DiT crosses packed; the edit's step (reference tokens too, ~10k)
    hides its copies and keeps them plain (stream_schedule.PACK_BELOW_FLOPS_PER_BYTE)."""
    from leandiffusion.tests.kit.qwen_image_full import meta_qwen_image_edit_parts

    native = _plan(parts, "stream", shape=(2, 166, 166))
    assert native.plan.packed_slot_bytes == native.schedule.slot_bytes >= 1.5 * max(
        u.nbytes for u in native.schedule.order)
    config = PolicyConfig(VramPolicy.STREAM, VramPolicy.STREAM, CUDA, torch.bfloat16, torch.bfloat16, torch.bfloat16,
                          12 * GiB, SHAPE)
    edit = plan_placement(meta_qwen_image_edit_parts(), config, None, "qwen-image-edit")
    assert edit.plan.packed_slot_bytes == 0 and edit.plan.text_packed_slot_bytes > 0

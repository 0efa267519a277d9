"""The VRAM plan of the full-size Qwen-Image-Edit (the 20.4B MMDiT; the whole Qwen2.5-VL-7B: its 0.68B vision tower of
32 blocks and its language model; the Qwen-Image VAE; built on the ``meta`` device: architecture only, no memory)
under ``stream`` on CUDA.

Guards issue 44's "stream keeps every stage (the 7B vision-language encoder included) within vram_budget_gb" for the
edit on the plan side: at 12 GB (bf16) and 8 GB (fp8-stored blocks) every stage's estimated peak is within the
budget, the vision tower streams block by block through a ring of its own beside the language model's, and the DiT
step is sized for the edit (noise + reference tokens, prompt rows carrying up to three pictures' vision tokens); the
estimates are worked by hand, and the family's token counts are tied to what the edit sampler really encodes.
"""
from types import SimpleNamespace

import pytest
import torch

from leandiffusion.memory.families import family_defaults
from leandiffusion.memory.plan import GiB
from leandiffusion.memory.planner import plan_placement, working_minimum_bytes
from leandiffusion.memory.policy_config import PolicyConfig, VramPolicy
from leandiffusion.memory.vision_units import PICTURE_TOKENS, PICTURES
from leandiffusion.tests.kit.qwen_image_full import meta_qwen_image_edit_parts

MiB = 2 ** 20
CUDA = torch.device("cuda", 0)
SHAPE = (2, 128, 128)  # one guided 1024 px edit: the instruction's and the negative's rows in one call


@pytest.fixture(scope="module")
def parts():
    return meta_qwen_image_edit_parts()


def _plan(parts, policy="stream", budget_gb=12.0, free=None):
    req = VramPolicy(policy)
    config = PolicyConfig(VramPolicy.FULL if req == VramPolicy.AUTO else req, req, CUDA, torch.bfloat16,
                          torch.bfloat16, torch.bfloat16, int(budget_gb * GiB), SHAPE)
    return plan_placement(parts, config, free, "qwen-image-edit")


def test_the_sizes_are_qwen_image_edits(parts):
    visual = parts.text_encoder.visual
    assert len(visual.blocks) == 32 and round(sum(p.numel() for p in visual.parameters()) / 1e9, 2) == 0.68
    assert len(parts.text_encoder.language_model.layers) == 28


def test_the_edit_estimates_by_hand(parts):
    """DiT: 4096 noise + 4096 reference + 1776 prompt tokens per row, 2 rows, dim 3072, factor 20, x 1.3, bf16,
    + 576 MiB. Text: the language model at 1840 tokens x 2 prompts (as Qwen-Image's formula) + the vision tower at
    3 pictures x 235 merged tokens x 4 patches: per patch 6 x 1280 + 3 x 3420 in bf16, one picture's 16 x 940^2
    float32 scores, x 1.3."""
    plan = _plan(parts).plan
    assert plan.unet_activation_bytes == int(1.3 * 20 * (2 * (8192 + 1776) * 3072) * 2) + 576 * MiB
    per_token = 29 * 3584 + 28 * 2 * 512 + 3 * 18944 + 2 * 3584
    language = int(1.3 * 2 * 1840 * per_token * 2) + 256 * MiB
    vision = int(1.3 * (3 * 940 * (6 * 1280 + 3 * 3420) * 2 + 16 * 940 ** 2 * 4))
    assert plan.text_tokens == 1840 and plan.text_activation_bytes == language + vision


@pytest.mark.parametrize("budget_gb, fp8", [(12.0, False), (8.0, True)])
def test_every_stage_fits_and_the_vision_tower_streams_in_its_own_ring(parts, budget_gb, fp8):
    planned = _plan(meta_qwen_image_edit_parts(fp8_blocks=True) if fp8 else parts, budget_gb=budget_gb)
    plan, budget = planned.plan, planned.budget
    assert plan.policy == "stream" and max(plan.peaks.values()) <= budget_gb * GiB
    assert plan.text_mode == "stream" and plan.text_streamed_units == plan.text_total_units == 28 + 32
    vision = planned.vision_schedule
    block = max(u.nbytes for u in vision.order)
    assert [u.name for u in vision.order] == [f"blocks.{i}" for i in range(32)] and len(vision.streamed) == 32
    assert 35e6 < block < 45e6 and vision.arena_bytes == 3 * block  # its smallest ring: 1/11 of a decoder layer's
    assert plan.text_arena_bytes == planned.text_schedule.arena_bytes + vision.arena_bytes
    assert budget.text_arena_bytes == plan.text_arena_bytes
    tower = parts.text_encoder.visual
    fixed = sum(p.numel() for m in (tower.patch_embed, tower.merger) for p in m.parameters()) * 2
    assert fixed <= plan.text_fixed_bytes <= fixed + 64 * 1024  # patch embedding + merger (+ the final norm)
    assert 0 < plan.streamed_units < plan.total_units == 60 and plan.unet_resident_bytes > 0
    assert plan.peaks["text"] == budget.resident_bytes + plan.text_arena_bytes + plan.text_activation_bytes
    # the edit's DiT step is compute-bound (bf16) or stored in fp8: plain copies; the bf16 language model's ring
    # packs; the vision tower's smallest ring has no room for a slot
    assert plan.packed_slot_bytes == 0 and vision.slot_bytes == 0 and plan.text_packed_slot_bytes > 0


def test_every_budget_from_the_working_minimum_up_keeps_every_stage_within_it(parts):
    minimum = working_minimum_bytes(parts, CUDA, torch.bfloat16, SHAPE)
    for budget in (minimum / GiB, 8.0, 12.0, 16.0, 24.0):
        plan = _plan(parts, budget_gb=budget).plan
        assert max(plan.peaks.values()) <= plan.budget_bytes, budget
    with pytest.raises(ValueError, match=r"vram_budget_gb=[0-9.]+ is below the working minimum of [0-9.]+ GB .*"
                                         r"text stage: staging [0-9.]+ GB \+ activations [0-9.]+ GB at 1840 tokens"):
        _plan(parts, budget_gb=minimum / GiB * 0.95)


def test_auto_picks_stream_for_the_edit_when_the_free_memory_requires_it(parts):
    small = _plan(parts, "auto", budget_gb=40.0, free=24 * GiB).plan
    assert small.policy == "stream" and max(small.peaks.values()) <= small.budget_bytes


def test_the_familys_token_counts_hold_the_samplers_longest_edit():
    """Three condition pictures at the aspect ratio with the most vision tokens and a 1024-token instruction (the
    text-to-image sampler's longest prompt) encode within ``text_tokens`` and give at most ``dit_text_tokens`` rows
    per DiT call; no aspect ratio gives a picture more than ``PICTURE_TOKENS``."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    from leandiffusion.memory.qwen_vision import edit_image_processor
    from leandiffusion.memory.tiny_qwen_image import TEMPLATE_WORDS, VISION_TOKENS
    from leandiffusion.memory.tiny_zimage import build_qwen_tokenizer
    from leandiffusion.sampling.qwen.edit_images import CONDITION_AREA, calculate_dimensions
    from leandiffusion.sampling.qwen.edit_text import DROP_TOKENS, tokenize_edit
    from leandiffusion.sampling.qwen.text import MAX_TOKENS

    def tokens(ratio):
        w, h = calculate_dimensions(CONDITION_AREA, ratio)
        rh, rw = smart_resize(h, w, factor=28, min_pixels=56 * 56, max_pixels=14 * 14 * 4 * 16384)
        return (rh // 28) * (rw // 28), (w, h)

    ratios = [r / 100 for r in range(1, 20001)]
    worst = max(ratios, key=lambda r: tokens(r)[0])
    assert 196 <= tokens(worst)[0] <= PICTURE_TOKENS and tokens(1.0)[0] == 196
    tokenizer = build_qwen_tokenizer(TEMPLATE_WORDS)
    tokenizer.add_tokens(list(VISION_TOKENS), special_tokens=True)
    engine = SimpleNamespace(parts=SimpleNamespace(image_processor=edit_image_processor(), tokenizer=tokenizer))
    instruction = "q" * MAX_TOKENS  # one token per byte
    assert len(tokenizer(instruction).input_ids) == MAX_TOKENS
    picture = Image.new("RGB", tokens(worst)[1])
    encoded = tokenize_edit(engine, instruction, [picture] * PICTURES)["input_ids"].shape[1]
    row = family_defaults("qwen_image_edit")
    assert encoded <= row["text_tokens"] and encoded - DROP_TOKENS <= row["dit_text_tokens"]
    assert row["text_tokens"] - encoded < 64  # the bound is tight, not a guess far above
    assert row["dit_text_tokens"] == row["text_tokens"] - DROP_TOKENS

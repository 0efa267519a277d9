"""Every VRAM policy runs Qwen-Image-Edit (CPU, fp32) with the result of ``full``, bit for bit, and ``stream`` really
streams a 6-block stand-in for the MMDiT, the Qwen2.5-VL language model and its vision tower (the CUDA path's
schedules, copies synchronous on the CPU); a budget below the working minimum is refused before anything is placed.

Guards issue 44's "stream keeps every stage (the 7B vision-language encoder included) within vram_budget_gb" for the
edit: the Fused Edit Sampler's LATENT (instruction and negative encoded with the pictures, references beside the
noise tokens) under ``stream`` equals ``full``'s; the vision tower's streamed blocks really come from its streamer's
host copy (zeroing it changes the prompt rows) and its ring exists only while the text stage runs; a text-only
prompt through the same encoder never enters the tower's ring (why the tower has a schedule of its own).
"""
import pytest
import torch

from leandiffusion.memory.engine import parts_from_components
from leandiffusion.memory.text_streaming import TextStreamer, VisionStreamer
from leandiffusion.sampling.qwen.edit import EditSettings, sample_qwen_edit
from leandiffusion.sampling.qwen.edit_images import condition_pictures, edit_sizes, to_picture
from leandiffusion.sampling.qwen.edit_text import encode_edit_prompt, tokenize_edit
from leandiffusion.sampling.qwen.text import encode_prompts
from leandiffusion.tests.kit.partial_stream import assert_refused_below_minimum, engine_under, removed_to_plain, \
    replace_deeper
from leandiffusion.tests.kit.qwen_edit import image_batch

POLICIES = ["full", "balanced", "lowvram", "stream", "auto"]
WORKING_SHAPE = (2, 8, 8)
TEXT_LAYERS, VISION_BLOCKS, DIT_BLOCKS = 12, 4, 6
IMAGE = image_batch(3, 1, 72, 96)
SETTINGS = EditSettings("make the sky red", "blurry", seed=5, steps=2, true_cfg=4.0, megapixels=0.0625)


def _components(seed: int = 0) -> dict:
    """The tiny Qwen-Image-Edit with a deeper DiT (6 joint blocks), a 12-layer language model and a 4-block vision
    tower (two of them full-attention), as the edit loader holds it (``Qwen2_5_VLModel`` without the LM head)."""
    from diffusers import QwenImageTransformer2DModel
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    from leandiffusion.memory import tiny_qwen_image
    from leandiffusion.memory.qwen_vision import edit_image_processor

    comps = tiny_qwen_image.build_tiny_qwen_image(seed)
    config = tiny_qwen_image.text_config(comps["tokenizer"])
    text = config.text_config
    text.num_hidden_layers, text.intermediate_size = TEXT_LAYERS, 1024
    text.layer_types = ["full_attention"] * TEXT_LAYERS
    config.vision_config.depth, config.vision_config.fullatt_block_indexes = VISION_BLOCKS, [1, 3]

    def build():
        dit = QwenImageTransformer2DModel(**{**tiny_qwen_image.transformer_config(), "num_layers": DIT_BLOCKS})
        with torch.no_grad():
            torch.nn.init.normal_(dit.proj_out.weight, std=0.2)
        return dit, Qwen2_5_VLModel(config)

    comps = replace_deeper(comps, seed + 1, build)
    return dict(comps, family="qwen_image_edit", image_processor=edit_image_processor())


def _parts():
    return parts_from_components(_components(), name="tiny-qwen-edit-deep")


def _engine(policy: str):
    return engine_under(_parts(), policy, WORKING_SHAPE)


def _inputs(engine, prompt="make the sky red"):
    sizes = edit_sizes([IMAGE], SETTINGS.megapixels)
    return tokenize_edit(engine, prompt, condition_pictures([to_picture(IMAGE, 0)], sizes))


def _edit_rows(engine):
    with engine.session("text"):
        return encode_edit_prompt(engine, _inputs(engine)).clone()


@pytest.fixture(scope="module")
def reference():
    engine = _engine("full")
    return dict(rows=_edit_rows(engine), text=encode_prompts(engine, ["a red cube"]),
                latent=sample_qwen_edit(engine, SETTINGS, IMAGE, quiet=True)["samples"])


@pytest.fixture(scope="module")
def streamed():
    return _engine("stream")


def _streamers(engine):
    swaps = engine.placement._swaps["text"]
    (text,) = [s for s in swaps if type(s) is TextStreamer]
    (vision,) = [s for s in swaps if type(s) is VisionStreamer]
    return text, vision


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_gives_the_edit_of_full(reference, policy):
    engine = _engine(policy)
    for _ in range(2):  # a second run reuses the staging rings
        latent = sample_qwen_edit(engine, SETTINGS, IMAGE, quiet=True)["samples"]
        assert torch.equal(latent, reference["latent"]), policy
    assert torch.equal(_edit_rows(engine), reference["rows"]), policy
    assert reference["latent"].abs().max().item() > 0.5  # a real latent, not one any output would match
    if policy == "auto":
        assert engine.placement.plan.policy == "full"  # auto on the CPU stays full


def test_the_stream_plan_streams_the_dit_the_language_model_and_the_vision_tower(streamed):
    plan = streamed.placement.plan
    assert plan.family == "qwen_image_edit" and plan.policy == "stream"
    assert plan.text_mode == "stream" and plan.unet_mode == "stream"
    assert plan.text_streamed_units == plan.text_total_units == TEXT_LAYERS + VISION_BLOCKS
    assert 0 < plan.streamed_units < plan.total_units == DIT_BLOCKS
    assert max(plan.peaks.values()) <= plan.budget_bytes
    assert plan.text_tokens == 1840  # the family's longest edit prompt: template, 3 pictures' tokens, instruction
    text, vision = _streamers(streamed)
    assert plan.text_arena_bytes == text.schedule.arena_bytes + vision.schedule.arena_bytes
    assert [u.name for u in vision.schedule.order] == [f"blocks.{i}" for i in range(VISION_BLOCKS)]
    assert len(vision.schedule.streamed) == VISION_BLOCKS


def test_the_vision_tower_streams_from_its_host_copy_only_while_the_text_stage_runs(streamed, reference):
    _, vision = _streamers(streamed)
    tower = streamed.parts.text_encoder.visual
    block_params = [p for block in tower.blocks for p in block.parameters()]

    def inside(buffer, p):
        return buffer.data_ptr() <= p.data_ptr() < buffer.data_ptr() + buffer.numel()

    assert vision.arena is None and all(inside(vision.host.tensor, p) for p in block_params)
    fixed = [p for m in (tower.patch_embed, tower.merger) for p in m.parameters()]
    assert all(inside(vision.resident, p) for p in fixed)  # patch embedding and merger stay resident
    issued = vision.copies_issued
    assert torch.equal(_edit_rows(streamed), reference["rows"])
    assert vision.copies_issued - issued == VISION_BLOCKS  # every block copied once per tower forward
    assert vision.arena is None
    saved = vision.host.tensor.clone()
    vision.host.tensor.zero_()  # the host copy is the only source of the streamed blocks' weights
    try:
        assert (_edit_rows(streamed) - reference["rows"]).abs().max().item() > 1e-3
    finally:
        vision.host.tensor.copy_(saved)
    assert torch.equal(_edit_rows(streamed), reference["rows"])


def test_a_text_only_prompt_streams_the_language_model_and_skips_the_tower(streamed, reference):
    text, vision = _streamers(streamed)
    issued_text, issued_vision = text.copies_issued, vision.copies_issued
    got = encode_prompts(streamed, ["a red cube"])
    assert torch.equal(got[0], reference["text"][0])
    assert text.copies_issued - issued_text == TEXT_LAYERS and vision.copies_issued == issued_vision


def test_a_budget_below_the_working_minimum_is_refused_before_anything_is_placed(monkeypatch):
    assert_refused_below_minimum(_parts(), WORKING_SHAPE, 1840, monkeypatch)


def test_remove_leaves_plain_modules_with_the_same_outputs(reference):
    plain = removed_to_plain(_engine("stream"))
    assert torch.equal(_edit_rows(plain), reference["rows"])

"""CONDITIONING in and out, and encode_for_sampler: what the samplers receive is what ComfyUI's samplers use."""
import pytest
import torch

from leandiffusion.sampling.conditioning import from_conditioning, match_lengths, repeat_to_batch, to_conditioning
from leandiffusion.sampling.prompt_encoder import PromptCache, encode_texts
from leandiffusion.sampling.prompts import encode_for_sampler
from leandiffusion.tests.kit import tiny_engine


def test_repeat_to_batch_tiles_and_cuts():
    t = torch.arange(2.0)[:, None]
    assert repeat_to_batch(t, 3)[:, 0].tolist() == [0.0, 1.0, 0.0]
    assert repeat_to_batch(t, 1)[:, 0].tolist() == [0.0]
    assert repeat_to_batch(t, 2) is not t


def test_lcm_repetition_does_not_change_the_unet_output(sd1):
    """ComfyUI batches a 154-token cond with a 77-token uncond by repetition; the UNet output must not change."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, 8, 8, generator=g)
    ctx = torch.randn(1, 77, 64, generator=g)
    with sd1.session("unet"), torch.no_grad():
        a = sd1.unet(x, 500, ctx)
        b = sd1.unet(x, 500, ctx.repeat(1, 2, 1))
    assert (a - b).abs().max().item() <= 1e-5


def test_string_prompts(sd1):
    cond, uncond = encode_for_sampler(sd1, "(red cube:1.2) " * 12, "blurry", 2, cache=PromptCache())
    assert cond.context.shape == uncond.context.shape == (2, 154, 64)
    ref = encode_texts(sd1, ["(red cube:1.2) " * 12, "blurry"], cache=None)
    assert torch.equal(cond.context[1], ref[0].context[0])
    assert torch.equal(uncond.context[0], ref[1].context[0].repeat(2, 1))
    assert cond.pooled is None and cond.time_ids is None


def test_conditioning_replaces_the_string(sd1):
    c = torch.randn(1, 77, 64)
    cond, uncond = encode_for_sampler(sd1, "ignored", "", 3, positive_cond=[[c, {"pooled_output": None}]],
                                      cache=PromptCache())
    assert torch.equal(cond.context, c.repeat(3, 1, 1))
    assert torch.equal(uncond.context, encode_texts(sd1, [""], cache=None)[0].context.repeat(3, 1, 1))


def test_sdxl_conditioning_sizes_and_pooled(sdxl):
    c, p = torch.randn(1, 77, 192), torch.randn(1, 128)
    info = {"pooled_output": p, "width": 1024, "height": 768, "crop_w": 16, "crop_h": 8, "target_width": 2048}
    cond, uncond = encode_for_sampler(sdxl, None, "", 2, positive_cond=[[c, info]], width=64, height=96,
                                      cache=PromptCache())
    assert torch.equal(cond.pooled, p.repeat(2, 1))
    # ComfyUI order: height, width, crop_h, crop_w, target_height (defaults to height), target_width
    assert cond.time_ids.tolist() == [[768, 1024, 8, 16, 768, 2048]] * 2
    assert uncond.time_ids.tolist() == [[96, 64, 0, 0, 96, 64]] * 2  # defaults: the image size
    plain = from_conditioning([[c, {"pooled_output": p}]], sdxl, 1)
    assert plain.time_ids is None  # neither the CONDITIONING nor the caller gave a size


def test_round_trip_through_conditioning(sdxl):
    emb = encode_texts(sdxl, ["a (red:1.3) cube"], cache=None)[0]
    back = from_conditioning(to_conditioning(emb), sdxl, 1)
    assert torch.equal(back.context, emb.context) and torch.equal(back.pooled, emb.pooled)


@pytest.mark.parametrize("value,match", [
    ("text", "CONDITIONING"),
    ([], "CONDITIONING"),
    ([[torch.zeros(1, 77, 64), {}], [torch.zeros(1, 77, 64), {}]], "2 entries"),
    ([[torch.zeros(1, 77, 64), {"area": (8, 8, 0, 0)}]], "'area'"),
    ([[torch.zeros(1, 77, 64), {"strength": 0.5}]], "'strength'"),
    ([[torch.zeros(1, 77, 768), {}]], "768 channels"),
    ([[torch.zeros(77, 64), {}]], "shape"),
    ([["a red cube", {}]], r"positive_cond: each CONDITIONING entry must be \[tensor, dict\], got \['a red cube'"),
    ([[torch.zeros(1, 77, 64)]], r"positive_cond: each CONDITIONING entry must be \[tensor, dict\]"),
])
def test_bad_conditioning_is_refused(sd1, value, match):
    with pytest.raises((TypeError, ValueError), match=match):
        encode_for_sampler(sd1, "", "", 1, positive_cond=value, cache=PromptCache())


def test_sdxl_needs_pooled(sdxl):
    with pytest.raises(ValueError, match="pooled_output"):
        from_conditioning([[torch.zeros(1, 77, 192), {}]], sdxl, 1)


def test_sdxl_pooled_output_of_another_width_is_refused(sdxl):
    """e.g. a pooled output from another model's CLIP."""
    with pytest.raises(ValueError, match=r"positive_cond: pooled_output has width 64, the SDXL model expects 128; "
                                         r"encode the text with this model's CLIP"):
        from_conditioning([[torch.zeros(1, 77, 192), {"pooled_output": torch.zeros(1, 64)}]], sdxl, 1)


def test_keys_at_their_neutral_values_are_accepted_and_change_nothing(sdxl):
    """ConditioningSetTimestepRange 0..1 and a strength of 1 mean a plain pair; ComfyUI samples them unchanged."""
    c, p = torch.randn(1, 77, 192), torch.randn(1, 128)
    neutral = {"pooled_output": p, "strength": 1.0, "start_percent": 0.0, "end_percent": 1.0,
               "clip_start_percent": 0.0, "clip_end_percent": 1.0}
    got = from_conditioning([[c, neutral]], sdxl, 2, width=64, height=64)
    plain = from_conditioning([[c, {"pooled_output": p}]], sdxl, 2, width=64, height=64)
    for a, b in ((got.context, plain.context), (got.pooled, plain.pooled), (got.time_ids, plain.time_ids)):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"'end_percent'=0.5"):
        from_conditioning([[c, dict(neutral, end_percent=0.5)]], sdxl, 2)


def test_argument_errors(sd1):
    with pytest.raises(ValueError, match="batch"):
        encode_for_sampler(sd1, "", "", 0)
    with pytest.raises(TypeError, match="negative"):
        encode_for_sampler(sd1, "", None, 1)
    with pytest.raises(ValueError, match="width"):
        encode_for_sampler(sd1, "", "", 1, width=-8)


def test_match_lengths_is_lcm():
    from leandiffusion.memory.engine import PromptEmbeds

    a, b = match_lengths(PromptEmbeds(torch.randn(1, 154, 4)), PromptEmbeds(torch.randn(1, 231, 4)))
    assert a.shape[1] == b.shape[1] == 462


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sdxl_time_ids_are_the_exact_sizes_at_half_precision(dtype):
    """Time ids built in the weight dtype would turn, under bf16, CLIPTextEncodeSDXL's width 3000 into 3008, height 1001
    into 1000 and crop_w 301 into 300 (fp16: crop_h 2049 into 2048), and condition a text prompt at 4104 x 2056 pixels
    as 4096 x 2048 (bf16): other sinusoids than ComfyUI's SDXL model embeds (it builds them from float32 values), so
    another picture. The UNet's time projection computes in float32 whatever the ids' dtype, so float32 ids cost
    nothing."""
    engine = tiny_engine("sdxl", dtype=dtype)
    sizes = {"width": 3000, "height": 1001, "crop_w": 301, "crop_h": 2049, "target_width": 4100,
             "target_height": 1080}
    info = {"pooled_output": torch.randn(1, 128), **sizes}
    cond, uncond = encode_for_sampler(engine, None, "", 2, positive_cond=[[torch.randn(1, 77, 192), info]],
                                      width=4104, height=2056, cache=PromptCache())
    assert cond.time_ids.tolist() == [[1001, 3000, 2049, 301, 1080, 4100]] * 2
    assert uncond.time_ids.tolist() == [[2056, 4104, 0, 0, 2056, 4104]] * 2  # the text side: the image size
    assert engine.time_ids(2056, 4104, 1).tolist() == [[2056, 4104, 0, 0, 2056, 4104]]  # the stream's text rows


# what ComfyUI 0.3.64's nodes write into a CONDITIONING's dict (nodes.py, comfy_extras/nodes_clip_sdxl.py,
# comfy/hooks.py); each must be refused naming the input, the node and the fix, never shown as a tensor dump
class ControlNet:  # stands for comfy.controlnet.ControlNet (only its type name reaches the message)
    pass


REFUSED_NODE_OUTPUTS = {
    "ConditioningSetArea": {"area": (8, 8, 0, 0), "strength": 1.0, "set_area_to_bounds": False},
    "ConditioningSetAreaPercentage": {"area": ("percentage", 1.0, 1.0, 0, 0), "strength": 1.0,
                                      "set_area_to_bounds": False},
    "ConditioningSetAreaStrength": {"strength": 0.5},
    "ConditioningSetMask": {"mask": torch.ones(1, 8, 8), "set_area_to_bounds": False, "mask_strength": 1.0},
    "ConditioningSetTimestepRange": {"start_percent": 0.2, "end_percent": 1.0},
    "ControlNetApplyAdvanced": {"control": ControlNet(), "control_apply_to_uncond": False},
    "GLIGENTextBoxApply": {"gligen": ("position", object(), [(torch.zeros(1, 64), 8, 8, 0, 0)])},
    "unCLIPConditioning": {"unclip_conditioning": [{"clip_vision_output": object(), "strength": 1.0,
                                                    "noise_augmentation": 0.0}]},
    "StyleModelApply": {"attention_mask": torch.zeros(1, 86, 86, dtype=torch.float16),
                        "attention_mask_img_shape": (1, 1)},
    "SetClipHooks": {"hooks": object()},
}


@pytest.mark.parametrize("node", list(REFUSED_NODE_OUTPUTS))
def test_refusal_names_the_node_and_the_fix(sdxl, node):
    """The message names the node to remove and the fix, not only the first key with a truncated repr (a mask or a
    style model's attention mask printed as ``tensor([[[1., 1., ...`` over several lines) and a generic list of
    features."""
    info = {"pooled_output": torch.randn(1, 128), **REFUSED_NODE_OUTPUTS[node]}
    with pytest.raises(ValueError) as err:
        from_conditioning([[torch.randn(1, 77, 192), info]], sdxl, 1, width=64, height=64, input_name="negative_cond")
    message = str(err.value)
    assert message.startswith("negative_cond: the CONDITIONING carries ")
    assert node in message and "Remove that node before negative_cond" in message and "KSampler" in message
    assert "tensor(" not in message and "\n" not in message and " at 0x" not in message


def test_refiner_aesthetic_score_is_refused_with_the_base_model_fix(sdxl):
    """CLIPTextEncodeSDXLRefiner's dict: ComfyUI's SDXL base model ignores aesthetic_score; the message must say so
    and name CLIPTextEncodeSDXL, not a list of unrelated features."""
    info = {"pooled_output": torch.randn(1, 128), "aesthetic_score": 6.0, "width": 1024, "height": 1024}
    with pytest.raises(ValueError, match=r"positive_cond: the CONDITIONING carries 'aesthetic_score'=6.0 \(from "
                                         r"CLIPTextEncodeSDXLRefiner\), an input of the SDXL refiner.*"
                                         r"Encode the prompt with CLIPTextEncodeSDXL"):
        from_conditioning([[torch.randn(1, 77, 192), info]], sdxl, 1)


def test_sd1_conditioning_on_sdxl_is_refused(sdxl):
    """A CLIP-L-only CONDITIONING (SD1: no pooled projection the SDXL UNet can use) on an SDXL engine."""
    with pytest.raises(ValueError, match=r"positive_cond: the conditioning has 64 channels but the sdxl model "
                                         r"expects 192; encode the text with this model's CLIP"):
        from_conditioning([[torch.randn(1, 77, 64), {"pooled_output": torch.randn(1, 64)}]], sdxl, 1)

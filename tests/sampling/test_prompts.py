"""``encode_for_sampler`` (``sampling/prompts.py``): argument checks, and each option reaching the prompt encoder.

Guards: a zero or boolean image size is refused; a CONDITIONING without size keys takes the image size; string sides'
pooled outputs are batched; ``missing_embedding`` and ``cache`` are passed on. The other checks (each side's own
pooled output and time ids, ``syntax``) are covered elsewhere too and stay as context.
"""
from __future__ import annotations

import pytest
import torch

from leandiffusion.sampling.prompt_encoder import PromptCache, encode_texts
from leandiffusion.sampling.prompts import encode_for_sampler


@pytest.mark.parametrize("name,value", [("width", 0), ("height", 0), ("width", True), ("height", 64.0)])
def test_an_image_size_that_is_not_a_positive_int_is_refused(sd1, name, value):
    with pytest.raises(ValueError, match=f"{name}={value!r}: expected the image size in pixels"):
        encode_for_sampler(sd1, "a", "b", 1, **{name: value})


def test_sdxl_string_sides_keep_their_own_pooled_output_and_the_image_sizes(sdxl):
    cond, uncond = encode_for_sampler(sdxl, "a red cube", "fog", 2, width=64, height=96, cache=None)
    ref = encode_texts(sdxl, ["a red cube", "fog"], syntax="extended", cache=None)
    assert torch.equal(cond.pooled, ref[0].pooled.repeat(2, 1))
    assert torch.equal(uncond.pooled, ref[1].pooled.repeat(2, 1))
    assert cond.time_ids.tolist() == uncond.time_ids.tolist() == [[96, 64, 0, 0, 96, 64]] * 2


def test_a_conditioning_side_keeps_its_own_time_ids_beside_a_string_side(sdxl):
    cfg = sdxl.parts.unet.config
    pooled = torch.randn(1, cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim)
    neg = [[torch.randn(1, 77, cfg.cross_attention_dim), {"pooled_output": pooled, "width": 256, "height": 320}]]
    cond, uncond = encode_for_sampler(sdxl, "a", None, 1, negative_cond=neg, width=64, height=96, cache=None)
    assert cond.time_ids.tolist() == [[96, 64, 0, 0, 96, 64]]
    assert uncond.time_ids.tolist() == [[320, 256, 0, 0, 320, 256]]
    assert torch.equal(uncond.pooled, pooled)


def test_a_conditioning_without_size_keys_takes_the_image_size(sdxl):
    cfg = sdxl.parts.unet.config
    pooled = torch.randn(1, cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim)
    pos = [[torch.randn(1, 77, cfg.cross_attention_dim), {"pooled_output": pooled}]]
    cond, _ = encode_for_sampler(sdxl, None, "b", 2, positive_cond=pos, width=64, height=96, cache=None)
    assert cond.time_ids.tolist() == [[96, 64, 0, 0, 96, 64]] * 2


def test_the_encoder_options_are_passed_on(sd1):
    """An unknown embedding is dropped under ``missing_embedding="ignore"``; ``syntax`` decides what ``BREAK``
    means (two chunks in "extended", a word in "comfyui"); ``cache`` is the cache used."""
    ignored, _ = encode_for_sampler(sd1, "a embedding:not_there_anywhere", "b", 1, missing_embedding="ignore",
                                    cache=None)
    assert torch.equal(ignored.context, encode_texts(sd1, ["a"], syntax="extended", cache=None)[0].context)
    comfy, _ = encode_for_sampler(sd1, "a BREAK b", "c", 1, syntax="comfyui", cache=None)
    extended, _ = encode_for_sampler(sd1, "a BREAK b", "c", 1, cache=None)
    assert comfy.context.shape[1] == 77 and extended.context.shape[1] == 154
    cache = PromptCache()
    encode_for_sampler(sd1, "a lighthouse", "fog", 1, cache=cache)
    assert len(cache) == 2

"""Qwen-Image-Edit prompt encoding: Qwen2.5-VL (vision tower and language model) over the instruction and images.

Invariant: ``encode_edit_prompt`` returns exactly the ``[L, C]`` rows ``QwenImageEditPlusPipeline.encode_prompt``
gives its transformer for one prompt and its condition pictures: the text ``"Picture N: <|vision_start|>
<|image_pad|><|vision_end|>"`` per picture followed by the prompt, put into the pipeline's edit template
(``EDIT_TEMPLATE``); Qwen2-VL's image processor (``parts.image_processor``) turns the pictures into patches and their
``(t, h, w)`` grid, and each ``<|image_pad|>`` becomes one pad token per merged patch (``t h w / merge^2``), as
``Qwen2VLProcessor`` expands it; the model's last hidden state over the tokenized text with the pictures' patches and
grid (its multimodal RoPE positions the image tokens), then the first ``DROP_TOKENS`` rows dropped. The pipeline
truncates nothing (no ``max_sequence_length`` cut).

Encoding runs inside the caller's ``engine.session("text")`` on the stage's device; pixels go in float32 (the vision
tower casts them to its dtype).
"""
from __future__ import annotations

from typing import Sequence

import torch

from ...memory.engine import LeanEngine

EDIT_TEMPLATE = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, "
                 "objects, background), then explain how the user's text instruction should alter or modify the "
                 "image. Generate a new image that meets the user's requirements while maintaining consistency with "
                 "the original input where appropriate.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
                 "<|im_start|>assistant\n")
DROP_TOKENS = 64  # the pipeline's prompt_template_encode_start_idx: the system turn in Qwen2.5's vocabulary
PICTURE_SLOT = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"
IMAGE_PAD = "<|image_pad|>"


def edit_text(prompt: str, pictures: int) -> str:
    """The templated text for ``prompt`` with ``pictures`` image slots (before the pads are expanded)."""
    slots = "".join(PICTURE_SLOT.format(i + 1) for i in range(pictures))
    return EDIT_TEMPLATE.format(slots + prompt)


def tokenize_edit(engine: LeanEngine, prompt: str, pictures: Sequence) -> dict:
    """``input_ids``, ``attention_mask`` ``[1, L]`` and ``pixel_values`` / ``image_grid_thw`` for ``prompt`` and the
    condition ``pictures`` (module docstring); CPU tensors."""
    processor = engine.parts.image_processor
    vision = processor(images=list(pictures), return_tensors="pt")
    grid = vision["image_grid_thw"]
    merge = int(processor.merge_size) ** 2
    pieces = edit_text(prompt, len(pictures)).split(IMAGE_PAD)
    text = pieces[0] + "".join(IMAGE_PAD * (int(g.prod()) // merge) + rest for g, rest in zip(grid, pieces[1:]))
    tokens = engine.parts.tokenizer([text], padding=True, return_tensors="pt")
    return {"input_ids": tokens.input_ids, "attention_mask": tokens.attention_mask,
            "pixel_values": vision["pixel_values"], "image_grid_thw": grid}


@torch.no_grad()
def encode_edit_prompt(engine: LeanEngine, inputs: dict) -> torch.Tensor:
    """The ``[L, C]`` rows (engine device and dtype) of one ``tokenize_edit`` result; call inside
    ``engine.session("text")``."""
    device = engine.stage_device("text")
    mask = inputs["attention_mask"].to(device)
    hidden = engine.parts.text_encoder(input_ids=inputs["input_ids"].to(device), attention_mask=mask,
                                       pixel_values=inputs["pixel_values"].to(device),
                                       image_grid_thw=inputs["image_grid_thw"].to(device),
                                       use_cache=False).last_hidden_state
    return hidden[0][mask[0].bool()][DROP_TOKENS:].to(engine.device, engine.dtype)


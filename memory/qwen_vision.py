"""Qwen2-VL's image processor for Qwen-Image-Edit, built in code where no diffusers folder provides one.

Invariant: ``edit_image_processor`` equals the ``processor/`` image processor of a Qwen-Image-Edit diffusers folder
(Qwen2.5-VL-7B-Instruct's ``preprocessor_config.json``): 14 px patches, 2 frames per temporal patch, 2x2 merge,
3136 .. 12845056 pixels, OpenAI CLIP mean / std, bicubic resize. The patch sizes can be read from a Qwen2.5-VL
vision tower's tensors (``vision_patching``); the rest no tensor records. transformers picks the backend (torchvision
where installed, else PIL), as it does for the folder's processor.

Why not ``Qwen2VLProcessor``: transformers 5 cannot build it without torchvision (its video-processor slot), and
the edit encoder only needs what it does for images: the image processor plus each ``<|image_pad|>`` expanded to
one token per merged patch (``sampling/qwen/edit_text.py``).
"""
from __future__ import annotations

from typing import Any

MIN_PIXELS = 56 * 56
MAX_PIXELS = 14 * 14 * 4 * 16384
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def edit_image_processor(patch_size: int = 14, temporal_patch_size: int = 2, merge_size: int = 2) -> Any:
    """A transformers ``Qwen2VLImageProcessor`` with Qwen-Image-Edit's settings (module docstring)."""
    from transformers import Qwen2VLImageProcessor

    return Qwen2VLImageProcessor(size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
                                 patch_size=patch_size, temporal_patch_size=temporal_patch_size,
                                 merge_size=merge_size, image_mean=list(CLIP_MEAN), image_std=list(CLIP_STD))


def vision_patching(shapes: dict, prefix: str = "visual.") -> dict:
    """``patch_size``, ``temporal_patch_size`` and ``merge_size`` from a Qwen2.5-VL vision tower's tensor shapes:
    the patch embedding ``[hidden, 3, temporal, patch, patch]`` and the merger's input width ``hidden * merge^2``."""
    hidden, _, temporal, patch, _ = shapes[prefix + "patch_embed.proj.weight"]
    merged = shapes[prefix + "merger.mlp.0.weight"][1]
    return dict(patch_size=int(patch), temporal_patch_size=int(temporal), merge_size=int(round((merged / hidden) ** 0.5)))

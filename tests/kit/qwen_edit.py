"""Test kit: the reference for the Fused Edit Sampler, diffusers' ``QwenImageEditPlusPipeline`` loaded from a tiny
Qwen-Image-Edit folder, and IMAGE inputs that survive the trip to 8-bit pictures exactly.

transformers 5 cannot build a ``Qwen2VLProcessor`` without torchvision (it type-checks the absent video processor
against a class that only exists with torchvision), so the pipeline's processor is transformers' own
``Qwen2VLProcessor`` with that one check skipped for the empty video slot (``bench.qwen_models.edit_processor``, which
the bench's edit peer uses too); its image and text handling (the part the pipeline uses) is unchanged, and it is
built from the folder's ``processor/`` files, not from the code under test.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def reference_processor(folder: Path):
    from transformers import AutoTokenizer, Qwen2VLImageProcessor

    from ...bench.qwen_models import edit_processor

    processor = Path(folder) / "processor"
    return edit_processor(Qwen2VLImageProcessor.from_pretrained(str(processor)),
                          AutoTokenizer.from_pretrained(str(processor)))


def load_edit_pipeline(folder: Path):
    from diffusers import QwenImageEditPlusPipeline

    return QwenImageEditPlusPipeline.from_pretrained(str(folder), processor=reference_processor(folder),
                                                     local_files_only=True)


def image_batch(seed: int, batch: int, height: int, width: int) -> torch.Tensor:
    """An IMAGE ``[batch, height, width, 3]`` of 8-bit values / 255 (smooth blobs plus noise, so a resize matters)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(height, width)
    rows = []
    for _ in range(batch):
        phase = rng.uniform(0, 6.28, size=3)
        base = np.stack([0.5 + 0.4 * np.sin(6 * x + 4 * y + p) for p in phase], -1)
        rows.append(np.clip(base + rng.normal(0, 0.08, base.shape), 0, 1))
    return torch.from_numpy(np.round(np.stack(rows) * 255) / 255).float()


def pictures(image: torch.Tensor) -> list:
    """The PIL pictures of an IMAGE's rows (what a user would hand diffusers)."""
    from PIL import Image

    return [Image.fromarray((row.numpy() * 255).round().astype(np.uint8)) for row in image]

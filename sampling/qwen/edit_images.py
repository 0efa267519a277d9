"""Qwen-Image-Edit's input images: IMAGE checks, and the three sizes ``QwenImageEditPlusPipeline`` derives from them.

Invariants (what makes the edit equal the pipeline called with the same images as PIL pictures):
- An IMAGE row becomes the 8-bit RGB picture ComfyUI saves (``255 x``, rounded, clamped), so an image that came from
  8-bit pixels is passed on exactly.
- Sizes, each ``calculate_dimensions(area, width / height)`` of diffusers' pipeline (``sqrt(area * ratio)``, both
  sides rounded to multiples of 32): the vision-language encoder sees each image at ``CONDITION_AREA`` (384 x 384),
  the VAE encodes each at ``VAE_AREA x megapixels``, and the output follows the *first* image (``image``) at
  ``VAE_AREA x megapixels``, floored to a multiple of 16. At ``megapixels`` 1 these are the pipeline's sizes (it
  takes the output size from the *last* picture of its list: the same when the images share an aspect ratio).
- Resizing is diffusers' ``VaeImageProcessor`` (Lanczos on the picture; ``preprocess`` scales to [-1, 1]), as the
  pipeline's ``image_processor`` does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

CONDITION_AREA = 384 * 384
VAE_AREA = 1024 * 1024
MIN_SIDE_PX = 64
MULTIPLE = 16  # VAE downsampling (8) x DiT patch (2)
INPUTS = ("image", "image2", "image3")


def check_images(image, image2=None, image3=None, names: Sequence[str] = INPUTS) -> list[torch.Tensor]:
    """The connected IMAGEs in order (``image`` first); ``ValueError``/``TypeError`` naming the input (``names``: the
    node's names of the three inputs) when one is missing, not an IMAGE, smaller than ``MIN_SIDE_PX`` or of a batch
    that is neither 1 nor ``image``'s."""
    if image is None:
        raise ValueError(f"{names[0]}: no image connected; connect the IMAGE to edit (a Load Image node)")
    found = []
    for name, value in zip(names, (image, image2, image3)):
        if value is None:
            continue
        if not isinstance(value, torch.Tensor) or value.ndim != 4 or value.shape[-1] not in (3, 4):
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise TypeError(f"{name}: expected an IMAGE (a [batch, height, width, 3] tensor), got {got}")
        if not value.is_floating_point() or value.shape[0] < 1:
            raise TypeError(f"{name}: expected a non-empty float IMAGE in 0..1, got {value.dtype} {tuple(value.shape)}")
        h, w = int(value.shape[1]), int(value.shape[2])
        if min(h, w) < MIN_SIDE_PX:
            raise ValueError(f"{name}: {w}x{h} px is smaller than {MIN_SIDE_PX} px on a side; upscale it or use a "
                             f"larger image")
        if found and value.shape[0] not in (1, found[0].shape[0]):
            raise ValueError(f"{name}: batch of {value.shape[0]} images, but {names[0]} has {found[0].shape[0]}; give "
                             f"it 1 image (shared by every edit) or {found[0].shape[0]} (one per edit)")
        found.append(value)
    return found


def calculate_dimensions(area: float, ratio: float) -> tuple[int, int]:
    """``(width, height)`` as diffusers' Qwen-Image-Edit pipelines compute them (module docstring)."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions as diffusers_dims

    return diffusers_dims(area, ratio)


@dataclass(frozen=True)
class EditSizes:
    """Pixel sizes ``(width, height)``: the output, and per reference image its VAE and its encoder size."""

    output: tuple[int, int]
    vae: tuple[tuple[int, int], ...]
    condition: tuple[tuple[int, int], ...]


def edit_sizes(images: Sequence[torch.Tensor], megapixels: float, names: Sequence[str] = INPUTS) -> EditSizes:
    """The run's sizes from the IMAGEs' shapes (module docstring); ``ValueError`` naming the input (``names[i]`` for
    image ``i``) when a size would be smaller than ``MULTIPLE`` pixels on a side (an extreme aspect ratio)."""
    ratios = [int(im.shape[2]) / int(im.shape[1]) for im in images]
    vae = tuple(calculate_dimensions(VAE_AREA * megapixels, r) for r in ratios)
    condition = tuple(calculate_dimensions(CONDITION_AREA, r) for r in ratios)
    width, height = calculate_dimensions(VAE_AREA * megapixels, ratios[0])
    output = (width // MULTIPLE * MULTIPLE, height // MULTIPLE * MULTIPLE)
    for name, size in [(names[0], output)] + [(names[i], s) for i, s in enumerate(vae)]:
        if min(size) < MULTIPLE:
            raise ValueError(f"{name}: at megapixels={megapixels:g} its aspect ratio gives a {size[0]}x{size[1]} px "
                             f"image; raise megapixels or crop it to a less extreme aspect ratio")
    return EditSizes(output, vae, condition)


def to_picture(image: torch.Tensor, row: int):
    """Row ``row`` of an IMAGE (row 0 when it holds one) as an 8-bit RGB ``PIL.Image``."""
    from PIL import Image

    pixels = image[row if image.shape[0] > 1 else 0, :, :, :3].float().mul(255.0).round().clamp(0, 255)
    return Image.fromarray(pixels.to(torch.uint8).cpu().numpy(), mode="RGB")


def image_processor():
    """diffusers' ``VaeImageProcessor`` as the pipelines build it (VAE factor 8 x patch 2)."""
    from diffusers.image_processor import VaeImageProcessor

    return VaeImageProcessor(vae_scale_factor=MULTIPLE)


def condition_pictures(pictures: Sequence, sizes: EditSizes) -> list:
    """Each picture resized to its encoder size (Lanczos), as the pipeline's ``condition_images``."""
    processor = image_processor()
    return [processor.resize(p, h, w) for p, (w, h) in zip(pictures, sizes.condition)]


def vae_pixels(pictures: Sequence, size: tuple[int, int]) -> torch.Tensor:
    """Pictures of one reference -> ``[n, 3, 1, height, width]`` float32 in [-1, 1] at ``size`` (the VAE's input)."""
    processor = image_processor()
    width, height = size
    return torch.cat([processor.preprocess(p, height, width) for p in pictures]).unsqueeze(2)


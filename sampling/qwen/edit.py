"""The Qwen-Image-Edit loop: images + instruction + seed -> LATENT, as ``QwenImageEditPlusPipeline``.

Invariants (what makes edit ``b`` of a batch equal ``QwenImageEditPlusPipeline(image=[pictures of row b], prompt,
negative_prompt, true_cfg_scale, num_inference_steps, generator=torch.Generator("cpu").manual_seed(seed),
output_type="latent")`` (given the noise row) unpacked and converted to raw VAE space; sizes in
``edit_images.py``, prompt rows in ``edit_text.py``):
- Prompts: the instruction (and, when ``true_cfg > 1``, the negative) encoded with row ``b``'s condition pictures,
  one text row per model row (``[instruction x B, negative x B]``).
- References: each reference's pictures at its VAE size through the VAE's encoder, the distribution's mode, then
  ``(z - latents_mean) / latents_std`` per channel and packed into 2x2 patches; the references' tokens concatenated
  in input order and put after the noise tokens in every transformer call, with ``img_shapes`` ``[(1, h/2, w/2),
  (1, rh/2, rw/2), ...]`` per row; the prediction is cut back to the noise tokens.
- Noise, schedule, true CFG with the norm rescale and the Euler steps: ``loop._denoise`` (the text-to-image loop's,
  with its accelerations; the references ride as ``forward.QwenReference``),
  the schedule's shift from the noise tokens alone; one CPU-generator draw of ``[B, 16, h, w]`` from ``seed`` for
  the whole batch (so a batch of one is the pipeline's noise).
- Stages run in the pipeline's order (text, vae, unet), each inside ``engine.session``; every input is checked
  before the first opens, and ``bridge.check_interrupted()`` runs before every step.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from ... import bridge
from ...memory.engine import LeanEngine
from ..flow.schedule import flow_sigmas
from ..flow.text import check_prompt
from ..settings import ACCELERATIONS, MAX_SEED, check_choice, check_float, check_int
from . import edit_images
from .latents import channel_stats, pack, to_raw, unpack
from ..graph_runner import GraphRunner
from .forward import QwenReference
from ..loop import vae_scale_factor
from .loop import _denoise
from .edit_text import encode_edit_prompt, tokenize_edit


FAMILIES = ("qwen_image_edit", "qwen_image")
MAX_MEGAPIXELS = 16.0


@dataclass(frozen=True)
class EditSettings:
    """What one run of the Fused Edit Sampler does (the node's inputs, minus the model and the images)."""

    instruction: str
    negative: str = ""
    seed: int = 0
    steps: int = 40
    true_cfg: float = 4.0
    megapixels: float = 1.0
    acceleration: str = "none"

    @property
    def cfg(self) -> float:
        """``true_cfg`` under the name ``loop._denoise`` reads."""
        return self.true_cfg

    @property
    def guided(self) -> bool:
        return self.true_cfg > 1.0

    def validated(self) -> "EditSettings":
        check_prompt("instruction", self.instruction)
        check_prompt("negative", self.negative)
        check_int("seed", self.seed, 0, MAX_SEED)
        check_int("steps", self.steps, 1, 1000)
        cfg = check_float("true_cfg", self.true_cfg, 0.0, 30.0)
        megapixels = check_float("megapixels", self.megapixels, 0.0, MAX_MEGAPIXELS)
        if megapixels <= 0.0:
            raise ValueError(f"megapixels={megapixels:g}: expected a positive size (1.0 is the model's 1024x1024)")
        check_choice("acceleration", self.acceleration, ACCELERATIONS)
        return replace(self, true_cfg=cfg, megapixels=megapixels)


def check_edit_model(engine: Any) -> LeanEngine:
    """The engine when it can edit: a Qwen-Image(-Edit) model whose text stage has Qwen2.5-VL's vision tower and an
    image processor; else ``ValueError`` naming ``lean_model`` and what to load instead."""
    if not isinstance(engine, LeanEngine) or engine.family not in FAMILIES:
        got = engine.family if isinstance(engine, LeanEngine) else type(engine).__name__
        raise ValueError(f"lean_model: expected a Qwen-Image-Edit model (family qwen_image_edit), got {got}; load a "
                         f"QwenImageEditPlusPipeline / QwenImageEditPipeline diffusers folder or Qwen-Image split "
                         f"files with the whole Qwen2.5-VL text encoder")
    if getattr(engine.parts.text_encoder, "visual", None) is None or engine.parts.image_processor is None:
        raise ValueError(f"lean_model: this {engine.family} model's text encoder has no vision tower, so it cannot "
                         f"see the images; load a Qwen-Image-Edit diffusers folder, or split files whose text "
                         f"encoder is the whole Qwen2.5-VL (qwen_2.5_vl_7b.safetensors, with its visual.* tensors)")
    return engine


def sample_qwen_edit(engine: LeanEngine, settings: EditSettings, image, image2=None, image3=None,
                     quiet: bool = False, runner: Optional[GraphRunner] = None) -> dict:
    """Run the edit; returns ``{"samples": raw latents [B, 16, H/8, W/8] float32 on the CPU}`` (module docstring).
    ``runner``: the CUDA-graph runner (the process-wide one when omitted)."""
    s = settings.validated()
    check_edit_model(engine)
    images = edit_images.check_images(image, image2, image3)
    sizes = edit_images.edit_sizes(images, s.megapixels)
    batch = int(images[0].shape[0])
    width, height = sizes.output
    factor = vae_scale_factor(engine)
    h, w = height // factor, width // factor
    sigmas = flow_sigmas(engine.parts.scheduler_config, s.steps, h, w)  # before any stage: it checks steps
    pictures = [[edit_images.to_picture(im, b) for im in images] for b in range(batch)]
    bridge.check_interrupted()
    text_rows = encode_edit_rows(engine, s, [edit_images.condition_pictures(p, sizes) for p in pictures])
    bridge.check_interrupted()
    reference = QwenReference(reference_tokens(engine, pictures, sizes), reference_shapes(sizes))
    noise = torch.randn((batch, engine.parts.latent_channels, h, w),
                        generator=torch.Generator("cpu").manual_seed(s.seed), dtype=torch.float32)
    with engine.session("unet"), torch.no_grad():
        x = _denoise(engine, text_rows, pack(noise), sigmas, (h, w), s, quiet, reference=reference, runner=runner)
    return {"samples": to_raw(unpack(x.cpu(), h, w), engine.parts.vae)}


def reference_shapes(sizes: edit_images.EditSizes) -> tuple:
    """``QwenReference.shapes``: one ``(1, h, w)`` token grid per reference, from its VAE size in pixels."""
    return tuple((1, rh // edit_images.MULTIPLE, rw // edit_images.MULTIPLE) for rw, rh in sizes.vae)


def encode_edit_rows(engine: LeanEngine, s: EditSettings, conditions: list) -> list:
    """One ``[L, C]`` text row per model row: the instruction's per edit, then (when guided) the negative's."""
    prompts = [s.instruction, s.negative] if s.guided else [s.instruction]
    inputs = [[tokenize_edit(engine, prompt, c) for c in conditions] for prompt in prompts]
    longest = max(int(i["input_ids"].shape[1]) for rows in inputs for i in rows)
    with engine.session("text", (1, longest)):
        return [encode_edit_prompt(engine, i) for rows in inputs for i in rows]


@torch.no_grad()
def reference_tokens(engine: LeanEngine, pictures: list, sizes: edit_images.EditSizes) -> torch.Tensor:
    """``[B, sum of reference tokens, 64]`` float32 on the CPU: each reference VAE-encoded (mode), normalised per
    channel and packed, in input order (module docstring)."""
    mean, std = channel_stats(engine.parts.vae)
    packed = []
    with engine.session("vae"):
        device, dtype = engine.stage_device("vae"), engine.dtype_for("vae")
        for index, size in enumerate(sizes.vae):
            pixels = edit_images.vae_pixels([row[index] for row in pictures], size)
            z = engine.parts.vae.encode(pixels.to(device, dtype)).latent_dist.mode()[:, :, 0].float().cpu()
            packed.append(pack((z - mean) / std))
    return torch.cat(packed, dim=1)

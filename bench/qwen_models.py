"""Full-size Qwen-Image architectures with random weights, and the qwen suite's workloads (ours and the peer).

Models: the 20.4B-parameter DiT (diffusers ``QwenImageTransformer2DModel`` defaults: 60 joint blocks, 24 heads of
128, joint attention dim 3584), Qwen2.5-VL-7B (``Qwen2_5_VLForConditionalGeneration``, text and vision, its config
written in code) and ``AutoencoderKLQwenImage`` (defaults), materialised on the device and filled as
``bench.models.randomize_`` does (N(0, 1/fan_in), norms 1, biases 0), so activations stay O(1). The tokenizer is
``memory.tiny_qwen_image``'s byte-level builder (its ids fall inside the real vocabulary; the pipeline's template is
the real 34 tokens). Valid for speed, memory and numerical distance between implementations, never for pictures.

Workloads: a ``Workload`` names the peer pipeline class, how the peer is called, how ours is called (the node
level: a LEAN_MODEL from ``memory.load.build_engine`` and the sampler node's inputs) and which modules our loader
would hold: ``TEXT_TO_IMAGE`` (``QwenImagePipeline`` against the Fused Flow Sampler; ours holds the language model
only) and ``EDIT`` (issue 44's acceptance: one ``size`` x ``size`` reference image, ``QwenImageEditPlusPipeline``
against the Fused Edit Sampler; ours holds the whole ``Qwen2_5_VLModel`` and Qwen2-VL's image processor built in
code, ``memory/qwen_vision.py``). Invariant: both sides of a workload get the same prompt (instruction), negative,
reference image, seed, size, steps and true CFG, and both latents come back in raw VAE space (``[B, 16, h, w]``,
``latent * latents_std + latents_mean``), the peer's unpacked with diffusers' own helper. Below 1024 px (the CPU
smoke run) the edit's area is scaled on both sides: ours through ``megapixels``, the pipeline's VAE area constant
for the call, its output size passed in.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Optional

import torch

from ..memory.tiny_qwen_image import QWEN_IMAGE_SCHEDULER, TEMPLATE_WORDS, VISION_TOKENS, build_qwen_tokenizer
from .models import _materialise

PROMPT = "a photograph of a lighthouse on a cliff at dusk, warm light in the windows, waves breaking below"
INSTRUCTION = "make the lighthouse red, turn the sky stormy and keep the cliff as it is"
NEGATIVE = "blurry, low quality, distorted"
EDIT_AREA = 1024 * 1024  # the edit pipelines' VAE and output area at megapixels 1
SEED = 0
# Qwen/Qwen2.5-VL-7B-Instruct's config.json (Qwen-Image's text_encoder), text and vision towers
QWEN25_VL_7B_TEXT = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                         num_attention_heads=28, num_key_value_heads=4, hidden_act="silu",
                         max_position_embeddings=128000, rms_norm_eps=1e-6, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                          "mrope_section": [16, 24, 24]})
QWEN25_VL_7B_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, in_channels=3,
                           out_hidden_size=3584, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                           window_size=112, fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2,
                           hidden_act="silu")


def qwen_tokenizer():
    """The byte-level Qwen tokenizer with the pipelines' template words and Qwen2.5-VL's vision markers."""
    tokenizer = build_qwen_tokenizer(TEMPLATE_WORDS)
    tokenizer.add_tokens(list(VISION_TOKENS), special_tokens=True)
    return tokenizer


def qwen25_vl_7b_config(tokenizer):
    """``Qwen2_5_VLConfig`` of the 7B model with the special-token ids of ``tokenizer`` (its own vocabulary; the
    vision markers' too when it has them)."""
    from transformers import Qwen2_5_VLConfig

    ids = dict(bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"), eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    marks = {}
    if all(t in tokenizer.get_vocab() for t in VISION_TOKENS):
        start, end, image, video = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
        marks = dict(vision_start_token_id=start, vision_end_token_id=end, image_token_id=image,
                     video_token_id=video)
    return Qwen2_5_VLConfig(text_config=dict(QWEN25_VL_7B_TEXT, **ids), vision_config=dict(QWEN25_VL_7B_VISION),
                            tie_word_embeddings=False, **ids, **marks)


def full_qwen_image_components(device="cuda", dtype=torch.bfloat16, vae_dtype=torch.bfloat16) -> dict:
    """A components dict (as ``memory.tiny_qwen_image.build_tiny_qwen_image`` returns: the whole Qwen2.5-VL as
    ``text_encoder``) of the full-size architecture, built on ``device``."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLForConditionalGeneration

    tokenizer = qwen_tokenizer()
    return {"family": "qwen_image", "tokenizer": tokenizer, "scheduler_config": dict(QWEN_IMAGE_SCHEDULER),
            "transformer": _materialise(QwenImageTransformer2DModel, {}, device, dtype, 0),
            "text_encoder": _materialise(Qwen2_5_VLForConditionalGeneration, qwen25_vl_7b_config(tokenizer),
                                         device, dtype, 1),
            "vae": _materialise(AutoencoderKLQwenImage, {}, device, vae_dtype, 2)}


def language_model(text_encoder: torch.nn.Module) -> torch.nn.Module:
    """The language model of a ``Qwen2_5_VLForConditionalGeneration``: what our text-to-image engine holds (the
    loaders drop the vision tower and the LM head, ``memory/folders.py``)."""
    return text_encoder.model.language_model


def peer_only_modules(text_encoder: torch.nn.Module) -> list:
    """The parts of the full text encoder that only the peer uses for text-to-image (its forward computes logits)."""
    return [text_encoder.model.visual, text_encoder.lm_head]


def ours_components(components: dict, transformer=None) -> dict:
    """The components our loader would hold: the language model as ``text_encoder``, the same modules otherwise
    (``transformer`` replaces the DiT, e.g. an fp8 copy)."""
    return dict(components, text_encoder=language_model(components["text_encoder"]),
                transformer=components["transformer"] if transformer is None else transformer)


def edit_components(components: dict, transformer=None) -> dict:
    """The components our edit loader would hold (``memory/folders.py``): family ``qwen_image_edit``, the whole
    ``Qwen2_5_VLModel`` (vision tower + language model, no LM head) as ``text_encoder``, Qwen2-VL's image processor
    built in code; the same modules otherwise (``transformer`` replaces the DiT)."""
    from ..memory.qwen_vision import edit_image_processor

    return dict(components, family="qwen_image_edit", text_encoder=components["text_encoder"].model,
                image_processor=edit_image_processor(),
                transformer=components["transformer"] if transformer is None else transformer)


def edit_peer_only_modules(text_encoder: torch.nn.Module) -> list:
    """What only the edit peer uses: the LM head (its text encoder's forward computes logits)."""
    return [text_encoder.lm_head]


def edit_processor(image_processor, tokenizer):
    """transformers' ``Qwen2VLProcessor`` over ``image_processor`` and ``tokenizer`` with no video processor:
    transformers 5 type-checks the empty video slot against a class that exists only with torchvision, so that one
    check is skipped; the image and text handling the edit pipelines use is transformers' own."""
    from transformers import Qwen2VLProcessor

    class _ImageTextProcessor(Qwen2VLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return _ImageTextProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=None)


def raw_from_packed(pipe, packed: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """A pipeline's packed model-space latent -> raw VAE latents ``[B, 16, h, w]`` float32 on the CPU (diffusers'
    unpacking, the VAE config's per-channel statistics)."""
    latents = type(pipe)._unpack_latents(packed, height, width, pipe.vae_scale_factor)[:, :, 0].float().cpu()
    mean = torch.tensor(pipe.vae.config.latents_mean).view(1, -1, 1, 1)
    std = torch.tensor(pipe.vae.config.latents_std).view(1, -1, 1, 1)
    return latents * std + mean


def _t2i_pipeline(components: dict):
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    return QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**components["scheduler_config"]),
                             vae=components["vae"], text_encoder=components["text_encoder"],
                             tokenizer=components["tokenizer"], transformer=components["transformer"])


def _t2i_peer(pipe, w: "Workload") -> torch.Tensor:
    return pipe(PROMPT, negative_prompt=NEGATIVE, true_cfg_scale=w.cfg, num_inference_steps=w.steps, width=w.size,
                height=w.size, generator=torch.Generator("cpu").manual_seed(SEED), output_type="latent").images


def _t2i_ours(engine, w: "Workload", acceleration: str) -> torch.Tensor:
    from ..nodes.flow import LeanFlowSampler

    return LeanFlowSampler().run(engine, PROMPT, NEGATIVE, SEED, w.steps, w.cfg, w.size, w.size, 1,
                                 acceleration)[0]["samples"]


def reference_image(size: int) -> torch.Tensor:
    """The edit's reference: an IMAGE ``[1, size, size, 3]`` of 8-bit values / 255 (smooth colour waves, so resizes
    matter), the same for both sides."""
    y, x = torch.meshgrid(torch.linspace(0, 1, size), torch.linspace(0, 1, size), indexing="ij")
    rgb = torch.stack([0.5 + 0.4 * torch.sin(6 * x + 4 * y + p) for p in (0.0, 2.1, 4.2)], dim=-1)
    return (rgb * 255).round().div(255).unsqueeze(0)


def _edit_pipeline(components: dict):
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageEditPlusPipeline

    from ..memory.qwen_vision import edit_image_processor

    tokenizer = components["tokenizer"]
    return QwenImageEditPlusPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**components["scheduler_config"]),
                                     vae=components["vae"], text_encoder=components["text_encoder"],
                                     tokenizer=tokenizer, processor=edit_processor(edit_image_processor(), tokenizer),
                                     transformer=components["transformer"])


@contextlib.contextmanager
def _edit_area(size: int) -> Iterator[dict]:
    """The pipeline's size arguments at ``size`` px: none at 1024 (its own area); below, its VAE area constant set
    to ``size^2`` for the call (restored after) and the output size passed in."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as edit_plus

    if size * size == EDIT_AREA:
        yield {}
        return
    saved = edit_plus.VAE_IMAGE_SIZE
    edit_plus.VAE_IMAGE_SIZE = size * size
    try:
        yield {"width": size, "height": size}
    finally:
        edit_plus.VAE_IMAGE_SIZE = saved


def _edit_peer(pipe, w: "Workload") -> torch.Tensor:
    from PIL import Image

    pixels = (reference_image(w.size)[0] * 255).round().to(torch.uint8).numpy()
    with _edit_area(w.size) as sizes:
        return pipe(image=[Image.fromarray(pixels)], prompt=INSTRUCTION, negative_prompt=NEGATIVE,
                    true_cfg_scale=w.cfg, num_inference_steps=w.steps,
                    generator=torch.Generator("cpu").manual_seed(SEED), output_type="latent", **sizes).images


def _edit_ours(engine, w: "Workload", acceleration: str) -> torch.Tensor:
    from ..nodes.edit import LeanEditSampler

    return LeanEditSampler().run(engine, reference_image(w.size), INSTRUCTION, NEGATIVE, SEED, w.steps, w.cfg,
                                 w.size * w.size / EDIT_AREA, acceleration)[0]["samples"]


@dataclass(frozen=True)
class Workload:
    """One prompt -> latent job, run by the peer pipeline and by our node on the same modules (module docstring)."""

    name: str
    size: int
    steps: int
    cfg: float
    make_pipeline: Callable[[dict], object]  # components (the whole Qwen2.5-VL) -> a diffusers pipeline
    peer: Callable[[object, "Workload"], torch.Tensor]  # (pipeline, workload) -> packed model-space latent
    ours: Callable[[object, "Workload", str], torch.Tensor]  # (engine, workload, acceleration) -> raw latent
    peer_name: str
    # (components, DiT or None) -> what our loader would hold; text encoder -> the modules only the peer uses
    ours_parts: Callable[[dict, Optional[torch.nn.Module]], dict] = ours_components
    peer_only: Callable[[torch.nn.Module], list] = peer_only_modules

    @property
    def case(self) -> str:
        return f"{self.name}_{self.size}_{self.steps}steps"

    def with_steps(self, steps: int, size: int) -> "Workload":
        return replace(self, steps=steps, size=size)

    def pipeline(self, components: dict):
        pipe = self.make_pipeline(components)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def peer_run(self, pipe) -> Callable[[], torch.Tensor]:
        return lambda: self.peer(pipe, self)

    def peer_raw(self, pipe, packed: torch.Tensor) -> torch.Tensor:
        return raw_from_packed(pipe, packed, self.size, self.size)

    def ours_run(self, engine, acceleration: str) -> Callable[[], torch.Tensor]:
        return lambda: self.ours(engine, self, acceleration)


# issue 44's workload: 1024x1024, 20 steps, true CFG 4; the edit adds one 1024x1024 reference image
TEXT_TO_IMAGE = Workload("t2i", 1024, 20, 4.0, _t2i_pipeline, _t2i_peer, _t2i_ours, "diffusers QwenImagePipeline")
EDIT = Workload("edit", 1024, 20, 4.0, _edit_pipeline, _edit_peer, _edit_ours, "diffusers QwenImageEditPlusPipeline",
                edit_components, edit_peer_only_modules)
WORKLOADS = {"edit": EDIT, "t2i": TEXT_TO_IMAGE}
DEFAULT_WORKLOAD = "edit"  # issue 44's GPU acceptance

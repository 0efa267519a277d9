"""A tiny random-weight Qwen-Image (text-to-image MMDiT), built in code from diffusers' / transformers' own classes.

Used by the test kit so every Qwen-Image path runs on the CPU without a download. It keeps the real model's
conventions wherever a loader or sampler depends on them: ``QwenImageTransformer2DModel`` taking 2x2-packed
16-channel latents (64 input features) with RoPE axes summing to the head size; a
``Qwen2_5_VLForConditionalGeneration`` text encoder (vision tower included, multimodal RoPE sections summing to half
the head size) whose last hidden state is the prompt; a byte-level BPE tokenizer with Qwen's chat markers in which
every word of ``QwenImagePipeline``'s system prompt is one token, so its prompt template is exactly
``TEMPLATE_TOKENS`` tokens long before the user's text, as with the real Qwen2.5 vocabulary (the pipeline drops
that many leading tokens; likewise Qwen-Image-Edit's template and its 64); Qwen2-VL's vision markers as single
tokens whose ids the text encoder's config names, so images expand and position as in the real model; an
``AutoencoderKLQwenImage`` with the real per-channel ``latents_mean`` /
``latents_std``; and Qwen-Image's ``FlowMatchEulerDiscreteScheduler`` config (dynamic, exponential shift with a
terminal stretch). Only widths and depths are small.

Why a builder: tests compare against ``QwenImagePipeline`` loaded from a folder, and nothing may be downloaded.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .tiny_zimage import build_qwen_tokenizer, save_flow_pipeline_folder

# Qwen/Qwen-Image's scheduler/scheduler_config.json (diffusers' FlowMatchEulerDiscreteScheduler).
QWEN_IMAGE_SCHEDULER: dict[str, Any] = {
    "num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 0.9,
    "base_image_seq_len": 256, "max_image_seq_len": 8192, "shift_terminal": 0.02, "time_shift_type": "exponential",
    "invert_sigmas": False, "stochastic_sampling": False, "use_karras_sigmas": False,
    "use_exponential_sigmas": False, "use_beta_sigmas": False}
# The text ``QwenImagePipeline.prompt_template_encode`` puts before and after the prompt.
SYSTEM_PROMPT = ("Describe the image by detailing the color, shape, size, texture, quantity, text, spatial "
                 "relationships of the objects and background:")
# The system prompt of ``QwenImageEditPipeline`` / ``QwenImageEditPlusPipeline`` and the words of their image slots.
EDIT_SYSTEM_PROMPT = ("Describe the key features of the input image (color, shape, size, texture, objects, "
                      "background), then explain how the user's text instruction should alter or modify the image. "
                      "Generate a new image that meets the user's requirements while maintaining consistency with "
                      "the original input where appropriate.")
TEMPLATE_WORDS = f"system\nuser\nassistant\n{SYSTEM_PROMPT} {EDIT_SYSTEM_PROMPT} Picture"
TEMPLATE_TOKENS = 34  # ``QwenImagePipeline.prompt_template_encode_start_idx``
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
TEXT_HIDDEN = 32


def transformer_config() -> dict[str, Any]:
    """``QwenImageTransformer2DModel`` config: 2 blocks, 2 heads of 32 with the real model's RoPE split of a head
    (1/8 frame, 7/16 per image axis: 4 + 14 + 14, as 16 + 56 + 56 of 128), which split files do not record."""
    return dict(patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=32,
                num_attention_heads=2, joint_attention_dim=TEXT_HIDDEN, guidance_embeds=False,
                axes_dims_rope=(4, 14, 14))


def vae_config() -> dict[str, Any]:
    """``AutoencoderKLQwenImage`` config: the real block structure (4 levels downsampling by 8, 2 resnets per level,
    widths x1 x2 x4 x4: the layout diffusers' Wan-VAE file converter is written for) at base width 8, 16 latent
    channels, the real latent normalisation (the class defaults)."""
    return dict(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                temperal_downsample=[False, True, True])


def text_config(tokenizer):
    """``Qwen2_5_VLConfig`` for ``tokenizer``'s vocabulary: 2 decoder layers of width ``TEXT_HIDDEN`` (2 heads of
    16, multimodal RoPE sections 2 + 3 + 3) and a 1-block vision tower with the real model's head size (80), window
    (112 px) and a full-attention last block, the vision markers' ids from ``tokenizer``."""
    from transformers import Qwen2_5_VLConfig

    ids = dict(bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"), eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    start, end, image, video = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
    marks = dict(vision_start_token_id=start, vision_end_token_id=end, image_token_id=image, video_token_id=video)
    text = dict(vocab_size=len(tokenizer), **ids, hidden_size=TEXT_HIDDEN, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
                tie_word_embeddings=False)
    vision = dict(depth=1, hidden_size=160, intermediate_size=64, num_heads=2, out_hidden_size=TEXT_HIDDEN,
                  fullatt_block_indexes=[0], window_size=112)
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids, **marks)


def build_tiny_qwen_image(seed: int = 0) -> dict:
    """The tiny Qwen-Image in fp32 on the CPU, eval mode, deterministic by ``seed``: a components dict with
    ``transformer``, ``text_encoder`` (the whole ``Qwen2_5_VLForConditionalGeneration``), ``tokenizer``, ``vae``,
    ``scheduler_config`` and ``family`` ("qwen_image")."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLForConditionalGeneration

    tokenizer = build_qwen_tokenizer(TEMPLATE_WORDS)
    tokenizer.add_tokens(list(VISION_TOKENS), special_tokens=True)
    rng_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        transformer = QwenImageTransformer2DModel(**transformer_config())
        with torch.no_grad():  # the output projection gets a voice, as in a trained model
            torch.nn.init.normal_(transformer.proj_out.weight, std=0.2)
        text_encoder = Qwen2_5_VLForConditionalGeneration(text_config(tokenizer))
        vae = AutoencoderKLQwenImage(**vae_config())
    finally:
        torch.random.set_rng_state(rng_state)
    for module in (transformer, text_encoder, vae):
        module.eval().requires_grad_(False)
    return {"family": "qwen_image", "transformer": transformer, "text_encoder": text_encoder,
            "tokenizer": tokenizer, "vae": vae, "scheduler_config": dict(QWEN_IMAGE_SCHEDULER)}


def save_qwen_image_folder(components: dict, folder: str | Path) -> Path:
    """Save ``components`` as a diffusers ``QwenImagePipeline`` folder (what ``from_pretrained`` reads back)."""
    from diffusers import QwenImagePipeline

    return save_flow_pipeline_folder(QwenImagePipeline, components, folder)


def save_qwen_image_edit_folder(components: dict, folder: str | Path, plus: bool = True) -> Path:
    """Save ``components`` as a diffusers ``QwenImageEditPlusPipeline`` (``plus``) or ``QwenImageEditPipeline``
    folder, with the ``processor/`` sub-folder a real one has (Qwen2-VL's image processor settings and the
    tokenizer; ``memory/qwen_vision.py``). The processor is written part by part: transformers 5 cannot build a
    ``Qwen2VLProcessor`` without torchvision."""
    import json

    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageEditPipeline, QwenImageEditPlusPipeline

    from .qwen_vision import edit_image_processor

    folder = Path(folder)
    cls = QwenImageEditPlusPipeline if plus else QwenImageEditPipeline
    pipe = cls(scheduler=FlowMatchEulerDiscreteScheduler(**components["scheduler_config"]), vae=components["vae"],
               text_encoder=components["text_encoder"], tokenizer=components["tokenizer"], processor=None,
               transformer=components["transformer"])
    pipe.save_pretrained(str(folder))
    edit_image_processor().save_pretrained(str(folder / "processor"))
    components["tokenizer"].save_pretrained(str(folder / "processor"))
    index = json.loads((folder / "model_index.json").read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    (folder / "model_index.json").write_text(json.dumps(index, indent=2))
    return folder

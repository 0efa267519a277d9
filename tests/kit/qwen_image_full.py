"""The full-size Qwen-Image architecture for tests: the 20.4B MMDiT (diffusers' ``QwenImageTransformer2DModel``
defaults: 60 joint blocks, dim 3072), the Qwen2.5-VL-7B language model (config written in code, no hub access) and
the Qwen-Image VAE (``AutoencoderKLQwenImage`` defaults), either on the ``meta`` device (plans: architecture only,
no memory) or materialised with random weights as ``bench.models.randomize_`` fills them (N(0, 1/fan_in), norms 1,
biases 0, so activations stay O(1)). Valid for memory, speed and distance between implementations, never for
picture quality. The tokenizer is the tiny kit's byte-level Qwen tokenizer (its ids fall inside the real vocabulary).
"""
from __future__ import annotations

import torch

from ...memory.engine import ModelParts

# Qwen/Qwen-Image text_encoder/config.json, the language model's part
QWEN25_VL_7B = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                    num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=128000, rms_norm_eps=1e-6,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]})


def _classes():
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLTextConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLTextModel

    return QwenImageTransformer2DModel, Qwen2_5_VLTextModel, Qwen2_5_VLTextConfig, AutoencoderKLQwenImage


def meta_qwen_image_parts(fp8_blocks: bool = False) -> ModelParts:
    """The architecture on the ``meta`` device; ``fp8_blocks``: the joint blocks' Linear weights stored one byte per
    element, as ``memory/fp8_weights.py`` keeps fp8 weights (what the planner counts)."""
    dit_cls, text_cls, text_config, vae_cls = _classes()
    with torch.device("meta"):
        dit, text, vae = dit_cls(), text_cls(text_config(**QWEN25_VL_7B)), vae_cls()
    if fp8_blocks:
        for module in dit.transformer_blocks.modules():
            if type(module) is torch.nn.Linear:
                module.weight = torch.nn.Parameter(torch.empty(module.weight.shape, dtype=torch.uint8,
                                                               device="meta"), requires_grad=False)
    return ModelParts(family="qwen_image", unet=dit, vae=vae, text_encoder=text, tokenizer=None,
                      scheduler_config={}, name="qwen-image")


def meta_qwen_image_edit_parts(fp8_blocks: bool = False) -> ModelParts:
    """The Qwen-Image-Edit architecture on the ``meta`` device: as :func:`meta_qwen_image_parts`, with the whole
    Qwen2.5-VL-7B as the text stage (``Qwen2_5_VLModel``: the 0.68B vision tower and the language model, as the edit
    loader keeps it), family ``qwen_image_edit``."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    from ...bench.qwen_models import qwen25_vl_7b_config
    from ...memory.tiny_qwen_image import TEMPLATE_WORDS
    from ...memory.tiny_zimage import build_qwen_tokenizer

    base = meta_qwen_image_parts(fp8_blocks)
    with torch.device("meta"):
        text = Qwen2_5_VLModel(qwen25_vl_7b_config(build_qwen_tokenizer(TEMPLATE_WORDS)))
    return ModelParts(family="qwen_image_edit", unet=base.unet, vae=base.vae, text_encoder=text, tokenizer=None,
                      scheduler_config={}, name="qwen-image-edit")


def full_qwen_image_components(device="cuda", dtype=torch.bfloat16) -> dict:
    """A components dict (as ``memory.tiny_qwen_image.build_tiny_qwen_image`` returns, with the language model as
    ``text_encoder``, as the folder loader keeps it) of the full-size architecture with random weights."""
    from ...bench.models import _materialise
    from ...memory.tiny_qwen_image import QWEN_IMAGE_SCHEDULER, TEMPLATE_WORDS
    from ...memory.tiny_zimage import build_qwen_tokenizer

    dit_cls, text_cls, text_config, vae_cls = _classes()
    return {"family": "qwen_image", "transformer": _materialise(dit_cls, {}, device, dtype, 0),
            "text_encoder": _materialise(text_cls, text_config(**QWEN25_VL_7B), device, dtype, 1),
            "vae": _materialise(vae_cls, {}, device, dtype, 2), "tokenizer": build_qwen_tokenizer(TEMPLATE_WORDS),
            "scheduler_config": dict(QWEN_IMAGE_SCHEDULER)}

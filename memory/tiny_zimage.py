"""A tiny random-weight Z-Image (flow-matching DiT), built in code from diffusers' / transformers' own classes.

Used by the test kit and by the loader's ``tiny-random (test)`` choices, so every Z-Image path runs on the CPU
without a download. It keeps the real model's conventions wherever a loader or sampler depends on them:
``ZImageTransformer2DModel`` with patch 2, caption and image tokens padded to multiples of 32 with learned pad
tokens, RoPE axes summing to the head size; a ``Qwen3Model`` text encoder whose second-to-last hidden state is
the caption; a byte-level BPE tokenizer with Qwen's chat markers and the chat template ``ZImagePipeline`` applies;
a 16-channel ``AutoencoderKL`` with the Flux VAE's scaling and shift factors and no quant convolutions; and
Z-Image-Turbo's ``FlowMatchEulerDiscreteScheduler`` config (static shift 3). Only widths and depths are small.

The pad tokens and the final layer are drawn at random (the real ones are learned, never zero) so a sampler that
drops or masks the pad tokens fails the parity tests instead of passing by accident.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# Z-Image-Turbo's scheduler_config.json (diffusers' FlowMatchEulerDiscreteScheduler, static shift).
ZIMAGE_SCHEDULER: dict[str, Any] = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False}
# The Flux VAE's latent normalisation (Z-Image ships the same VAE).
FLUX_VAE_SCALING = 0.3611
FLUX_VAE_SHIFT = 0.1159

# What ``tokenizer.apply_chat_template([{"role": "user", ...}], add_generation_prompt=True, enable_thinking=True)``
# renders with Qwen3's template for one user turn.
QWEN_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}")
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TEXT_HIDDEN = 32


def transformer_config() -> dict[str, Any]:
    """``ZImageTransformer2DModel`` config: 2 main + 1 refiner layers, dim 64, 2 heads of 32 = 8 + 12 + 12."""
    return dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=64, n_layers=2,
                n_refiner_layers=1, n_heads=2, n_kv_heads=2, norm_eps=1e-5, qk_norm=True, cap_feat_dim=TEXT_HIDDEN,
                rope_theta=256.0, t_scale=1000.0, axes_dims=[8, 12, 12], axes_lens=[1024, 512, 512])


def vae_config() -> dict[str, Any]:
    """16-channel ``AutoencoderKL`` (4 levels: downsamples by 8) with the Flux VAE's factors."""
    return dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(32, 32, 64, 64),
                layers_per_block=1, norm_num_groups=32, sample_size=64,
                down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                scaling_factor=FLUX_VAE_SCALING, shift_factor=FLUX_VAE_SHIFT, use_quant_conv=False,
                use_post_quant_conv=False)


def text_config(vocab_size: int):
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=vocab_size, hidden_size=TEXT_HIDDEN, intermediate_size=64, num_hidden_layers=3,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=1024,
                       rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False)


def build_qwen_tokenizer(whole_words: str = ""):
    """A byte-level BPE tokenizer plus Qwen's special tokens and chat template, as a ``PreTrainedTokenizerFast``
    (what ``AutoTokenizer`` loads back from its saved folder). Every byte is one token, except the pre-tokenized
    words of ``whole_words``, each merged into one token (as a real Qwen vocabulary holds common words whole)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    merges = []
    for word, _ in pre.pre_tokenize_str(whole_words):
        for end in range(2, len(word) + 1):  # left to right: (w[:1], w[1]), (w[:2], w[2]), ...
            if word[:end] not in vocab:
                vocab[word[:end]] = len(vocab)
                merges.append((word[:end - 1], word[end - 1]))
    core = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    core.pre_tokenizer = pre
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<|endoftext|>",
                                        eos_token="<|im_end|>", model_max_length=1024)
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIALS[1:])})
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    return tokenizer


def build_tiny_zimage(seed: int = 0) -> dict:
    """The tiny Z-Image in fp32 on the CPU, eval mode, deterministic by ``seed``: a components dict with
    ``transformer``, ``text_encoder``, ``tokenizer``, ``vae``, ``scheduler_config`` and ``family`` ("zimage")."""
    from diffusers import AutoencoderKL, ZImageTransformer2DModel
    from transformers import Qwen3Model

    tokenizer = build_qwen_tokenizer()
    rng_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        transformer = ZImageTransformer2DModel(**transformer_config())
        with torch.no_grad():
            transformer.x_pad_token.normal_(0.0, 1.0)
            transformer.cap_pad_token.normal_(0.0, 1.0)
            for final in transformer.all_final_layer.values():  # zero-initialised in diffusers: give it a voice
                torch.nn.init.normal_(final.linear.weight, std=0.1)
                torch.nn.init.normal_(final.adaLN_modulation[1].weight, std=0.1)
            for block in list(transformer.layers) + list(transformer.noise_refiner):
                torch.nn.init.normal_(block.adaLN_modulation[0].weight, std=0.05)
        text_encoder = Qwen3Model(text_config(len(tokenizer)))
        vae = AutoencoderKL(**vae_config())
    finally:
        torch.random.set_rng_state(rng_state)
    for module in (transformer, text_encoder, vae):
        module.eval().requires_grad_(False)
    return {"family": "zimage", "transformer": transformer, "text_encoder": text_encoder, "tokenizer": tokenizer,
            "vae": vae, "scheduler_config": dict(ZIMAGE_SCHEDULER)}


def save_zimage_folder(components: dict, folder: str | Path) -> Path:
    """Save ``components`` as a diffusers ``ZImagePipeline`` folder (what ``from_pretrained`` reads back)."""
    from diffusers import ZImagePipeline

    return save_flow_pipeline_folder(ZImagePipeline, components, folder)


def save_flow_pipeline_folder(pipeline_class, components: dict, folder: str | Path) -> Path:
    """Save a DiT components dict (``transformer``, ``text_encoder``, ``tokenizer``, ``vae``, a
    ``FlowMatchEulerDiscreteScheduler`` config) as a diffusers folder of ``pipeline_class``."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    folder = Path(folder)
    scheduler = FlowMatchEulerDiscreteScheduler(**components["scheduler_config"])
    pipe = pipeline_class(scheduler=scheduler, vae=components["vae"], text_encoder=components["text_encoder"],
                          tokenizer=components["tokenizer"], transformer=components["transformer"])
    pipe.save_pretrained(str(folder))
    return folder

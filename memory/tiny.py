"""Tiny random-weight SD1.x / SD2.x / SDXL-like models, built in code, deterministic by seed.

Used by the loader's ``tiny-random (test)`` choice (so every workflow runs anywhere) and by the test kit.

Invariant: each tiny model follows its family's real conventions wherever a loader must infer a config from
tensor shapes (GroupNorm of 32 groups in UNet and VAE; SD1 UNet attention of 8 heads; SD2 / SDXL UNet heads of
64 channels; CLIP heads of 64 channels; VAE downsampling by 8; SDXL's concatenated two-encoder context and
``text_time`` added conditioning), so a single-file checkpoint written from these models can be detected and
converted exactly like a real one. Only widths and depths are small.

Weights are PyTorch's default initialisation, with the UNet's output convolution rescaled so the predicted noise
has roughly unit variance (activations stay O(1), so sampling math is exercised at realistic magnitudes).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

FAMILIES = ("sd1", "sd2", "sd2-v", "sdxl")

# The scheduler configs of the real models (diffusers' scheduler_config.json for SD1.5, SD2.1 and SDXL base).
SCHEDULER_CONFIGS: dict[str, dict[str, Any]] = {
    "sd1": dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                steps_offset=1, set_alpha_to_one=False, clip_sample=False, prediction_type="epsilon",
                timestep_spacing="leading"),
    "sd2": dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                steps_offset=1, set_alpha_to_one=False, clip_sample=False, prediction_type="epsilon",
                timestep_spacing="leading"),
    "sd2-v": dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                  steps_offset=1, set_alpha_to_one=False, clip_sample=False, prediction_type="v_prediction",
                  timestep_spacing="leading"),
    "sdxl": dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                 steps_offset=1, set_alpha_to_one=False, clip_sample=False, prediction_type="epsilon",
                 timestep_spacing="leading"),
}
VAE_SCALING = {"sd1": 0.18215, "sd2": 0.18215, "sd2-v": 0.18215, "sdxl": 0.13025}


def _check_family(family: str) -> str:
    if family not in FAMILIES:
        raise ValueError(f"family={family!r} is not a tiny-model family; use one of {', '.join(FAMILIES)}")
    return family


# --------------------------------------------------------------------------------------------- tokenizer
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP byte -> printable unicode table (Radford et al. 2019), as CLIP's BPE vocabulary spells bytes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def write_tiny_clip_tokenizer(folder: str | Path) -> Path:
    """Write a byte-level CLIP BPE tokenizer (514 tokens, no merges) loadable by ``CLIPTokenizer``.

    Token ids: every byte, every byte + ``</w>``, then ``<|startoftext|>`` and ``<|endoftext|>``.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    chars = list(_bytes_to_unicode().values())
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": i + len(chars) for i, c in enumerate(chars)})
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    (folder / "special_tokens_map.json").write_text(json.dumps({
        "bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "model_max_length": 77, "do_lower_case": True, "bos_token": "<|startoftext|>",
        "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
        "tokenizer_class": "CLIPTokenizer"}))
    return folder


def tiny_tokenizer(folder: str | Path, pad_token: str | None = None):
    """Load the tiny tokenizer written by :func:`write_tiny_clip_tokenizer` (writing it if absent)."""
    from transformers import CLIPTokenizer

    folder = Path(folder)
    if not (folder / "vocab.json").is_file():
        write_tiny_clip_tokenizer(folder)
    kwargs = {"pad_token": pad_token} if pad_token else {}
    return CLIPTokenizer.from_pretrained(str(folder), **kwargs)


TINY_VOCAB_SIZE = 514


# --------------------------------------------------------------------------------------------- modules
def _clip_config(hidden: int, layers: int, act: str, projection_dim: int | None = None):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=TINY_VOCAB_SIZE, hidden_size=hidden, intermediate_size=hidden * 4,
        num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64), max_position_embeddings=77,
        hidden_act=act, projection_dim=projection_dim or hidden, bos_token_id=512, eos_token_id=513,
        pad_token_id=513,
    )


def unet_config(family: str) -> dict[str, Any]:
    """diffusers ``UNet2DConditionModel`` config of the tiny model of ``family``."""
    family = _check_family(family)
    if family == "sd1":
        return dict(sample_size=8, in_channels=4, out_channels=4, block_out_channels=(32, 64), layers_per_block=1,
                    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
                    cross_attention_dim=64, attention_head_dim=8, norm_num_groups=32)
    if family in ("sd2", "sd2-v"):
        return dict(sample_size=8, in_channels=4, out_channels=4, block_out_channels=(64, 128), layers_per_block=1,
                    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
                    cross_attention_dim=128, attention_head_dim=(1, 2), use_linear_projection=True,
                    norm_num_groups=32)
    return dict(sample_size=8, in_channels=4, out_channels=4, block_out_channels=(64, 128), layers_per_block=1,
                down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
                cross_attention_dim=64 + 128, attention_head_dim=(1, 2), transformer_layers_per_block=(1, 2),
                use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=16,
                projection_class_embeddings_input_dim=6 * 16 + 128, norm_num_groups=32)


def vae_config(family: str) -> dict[str, Any]:
    """diffusers ``AutoencoderKL`` config of the tiny VAE (4 levels: downsamples by 8, like the real one)."""
    family = _check_family(family)
    return dict(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(32, 32, 64, 64),
                layers_per_block=1, norm_num_groups=32, sample_size=64,
                down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                scaling_factor=VAE_SCALING[family])


def build_tiny_components(family: str = "sd1", seed: int = 0, tokenizer_dir: str | Path | None = None) -> dict:
    """Build the tiny model of ``family`` in fp32 on the CPU, in eval mode, deterministic by ``seed``.

    Returns a dict with diffusers/transformers modules: ``unet``, ``vae``, ``text_encoder``, ``tokenizer``,
    for SDXL also ``text_encoder_2`` (with projection) and ``tokenizer_2``; plus ``scheduler_config`` (dict) and
    ``family``. ``tokenizer_dir`` is where the tiny tokenizer files are written; when None they go to a temporary
    folder that is removed once the tokenizers are loaded (they keep their vocabulary in memory), so a process that
    builds the tiny model (the loader's ``tiny-random (test)`` choice in a ComfyUI server) leaves nothing in the
    system's temporary folder.
    """
    import tempfile

    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    family = _check_family(family)
    if tokenizer_dir is None:
        with tempfile.TemporaryDirectory(prefix="leandiffusion-tok-") as scratch:
            return build_tiny_components(family, seed, tokenizer_dir=scratch)
    gen_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        unet = UNet2DConditionModel(**unet_config(family))
        with torch.no_grad():
            unet.conv_out.weight.mul_(3.0)
        vae = AutoencoderKL(**vae_config(family))
        parts: dict[str, Any] = {"family": family, "unet": unet, "vae": vae,
                                 "scheduler_config": dict(SCHEDULER_CONFIGS[family])}
        if family == "sd1":
            parts["text_encoder"] = CLIPTextModel(_clip_config(64, 2, "quick_gelu"))
        elif family in ("sd2", "sd2-v"):
            parts["text_encoder"] = CLIPTextModel(_clip_config(128, 2, "gelu"))
        else:
            parts["text_encoder"] = CLIPTextModel(_clip_config(64, 2, "quick_gelu"))
            parts["text_encoder_2"] = CLIPTextModelWithProjection(_clip_config(128, 2, "gelu", projection_dim=128))
    finally:
        torch.random.set_rng_state(gen_state)
    parts["tokenizer"] = tiny_tokenizer(tokenizer_dir)
    if family == "sdxl":
        parts["tokenizer_2"] = tiny_tokenizer(tokenizer_dir, pad_token="!")
    for key in ("unet", "vae", "text_encoder", "text_encoder_2"):
        if key in parts:
            parts[key].eval().requires_grad_(False)
    return parts

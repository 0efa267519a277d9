"""Model files for tests that run ComfyUI's own CLIP next to the pack: a random full-size CLIP-L and an SD1
checkpoint holding the same CLIP-L that ComfyUI's ``CheckpointLoaderSimple`` accepts.

ComfyUI builds CLIP from fixed full-size configs and detects a checkpoint's family from its UNet (SD1.5 = model
channels 320, context 768, conv projections, 8 heads) and builds the SD VAE from a fixed config (128 base channels,
[1, 2, 4, 4], 2 resnets per level), so a tiny model cannot go through its loaders. The checkpoint therefore holds:
the random CLIP-L (12 layers, 768 wide, 49408 tokens), a full-size random SD VAE (83.7M parameters) and a reduced
UNet of two 320-channel levels with one resnet each and 768-wide cross-attention (36.7M parameters), which ComfyUI
detects as SD1.5 and the pack's loader reads from its shapes. Files are fp16 (~490 MB and ~250 MB), as real
checkpoints are; fp16 values are exact in fp32, so ComfyUI (whatever its text-encoder storage dtype) and the pack
at ``weight_dtype`` fp32 compute with identical weights. No tokenizer files: inside ComfyUI both sides use
ComfyUI's bundled CLIP tokenizer, as for any real single-file checkpoint.
"""
from __future__ import annotations

from pathlib import Path

import torch

CLIP_L_FILE = "clip_l_random.safetensors"
SD1_CLIP_L_CHECKPOINT = "sd1_clip_l_unet320.safetensors"


def clip_l_config():
    from transformers import CLIPTextConfig

    return CLIPTextConfig(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                          num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu",
                          projection_dim=768, bos_token_id=49406, eos_token_id=49407, pad_token_id=49407)


def sd1_clip_l_components(seed: int = 0) -> dict:
    """The tiny SD1 components with the random CLIP-L, a full-size SD VAE and the 320-channel UNet (docstring)."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel

    from ...memory.tiny import unet_config
    from . import tiny_components

    components = tiny_components("sd1", seed)
    torch.manual_seed(seed)  # the random initialisation below
    components["unet"] = UNet2DConditionModel(**{**unet_config("sd1"), "block_out_channels": (320, 320),
                                                 "cross_attention_dim": 768}).eval()
    components["vae"] = AutoencoderKL(block_out_channels=(128, 256, 512, 512), layers_per_block=2,
                                      down_block_types=("DownEncoderBlock2D",) * 4,
                                      up_block_types=("UpDecoderBlock2D",) * 4, latent_channels=4,
                                      norm_num_groups=32, sample_size=512, scaling_factor=0.18215).eval()
    components["text_encoder"] = CLIPTextModel(clip_l_config()).eval()
    return components


def write_clip_l_pair(checkpoint_path: str | Path, clip_path: str | Path, seed: int = 0) -> None:
    """Write the SD1 checkpoint to ``checkpoint_path``, then its CLIP-L alone to ``clip_path``."""
    from safetensors.torch import load_file, save_file

    from .ldm import save_ldm_checkpoint

    checkpoint = save_ldm_checkpoint(sd1_clip_l_components(seed), checkpoint_path, tokenizer=False,
                                     dtype=torch.float16)
    prefix = "cond_stage_model.transformer."
    clip_l = {k[len(prefix):]: v for k, v in load_file(str(checkpoint)).items() if k.startswith(prefix)}
    Path(clip_path).parent.mkdir(parents=True, exist_ok=True)
    save_file(clip_l, str(clip_path))


def write_clip_l_model_files(models_dir: str | Path, seed: int = 0) -> Path:
    """Write ``checkpoints/SD1_CLIP_L_CHECKPOINT`` and ``text_encoders/CLIP_L_FILE`` (the checkpoint's CLIP-L)."""
    models_dir = Path(models_dir)
    write_clip_l_pair(models_dir / "checkpoints" / SD1_CLIP_L_CHECKPOINT, models_dir / "text_encoders" / CLIP_L_FILE,
                      seed)
    return models_dir

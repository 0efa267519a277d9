"""A tiny random ``AutoencoderKLQwenImage`` for the VAE tests (``memory.tiny_qwen_image.vae_config``: the real block
structure at base width 8), with its output convolutions scaled so decoded images and latents spread over O(1) (at
initialisation they are ~0.09 and ~0.2 wide): a tiling error of the order of the image then shows far above any
rounding tolerance."""
import torch
from diffusers import AutoencoderKLQwenImage

from leandiffusion.memory.tiny_qwen_image import vae_config


def voice(vae: AutoencoderKLQwenImage) -> AutoencoderKLQwenImage:
    """Scale ``vae``'s decoder and encoder output convolutions in place (module docstring); eval mode, no grad."""
    with torch.no_grad():
        vae.decoder.conv_out.weight.mul_(6.0)
        vae.encoder.conv_out.weight.mul_(4.0)
    return vae.eval().requires_grad_(False)


def tiny_qwen_vae(seed: int = 0, **overrides) -> AutoencoderKLQwenImage:
    """The voiced tiny VAE, deterministic by ``seed`` (the global RNG is restored); ``overrides`` change the config."""
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        return voice(AutoencoderKLQwenImage(**{**vae_config(), **overrides}))
    finally:
        torch.random.set_rng_state(state)

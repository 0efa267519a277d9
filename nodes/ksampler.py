"""Fused KSampler node (``LeanKSampler``): argument plumbing over ``sampling.ksampler.loop.sample_k``; its inputs are
core KSampler's (same names, same meaning) with ``lean_model`` for ``model``, so a user can swap the node."""
from __future__ import annotations

from ..sampling.ksampler.loop import sample_k
from ..sampling.ksampler.settings import SAMPLER_NAMES, SCHEDULER_NAMES, KSamplerSettings
from ..sampling.settings import ACCELERATIONS, MAX_SEED


class LeanKSampler:
    DESCRIPTION = ("ComfyUI's KSampler on the LeanDiffusion engine: the same samplers and schedulers with the same "
                   "meaning, so the same CONDITIONING, seed, steps, cfg and denoise give the same latent as core "
                   "KSampler, with the model call replayed as a CUDA graph. Works on every family the Memory Pool "
                   "Loaders load (SD1.x, SD2.x, SDXL, Z-Image; Qwen-Image eager, sampled as ComfyUI samples it) "
                   "and every VRAM policy.")
    CATEGORY = "LeanDiffusion/sampling"
    FUNCTION = "run"
    RETURN_TYPES = ("LATENT",)
    RETURN_NAMES = ("LATENT",)
    OUTPUT_TOOLTIPS = ("The denoised latent (raw VAE latent space, as core KSampler returns it); decode it with "
                       "Tiled VAE Decode or core VAE Decode.",)

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "lean_model": ("LEAN_MODEL", {"tooltip": "The model from a Memory Pool Loader (in place of core "
                                                         "KSampler's MODEL)."}),
                "seed": ("INT", {"default": 0, "min": 0, "max": MAX_SEED, "control_after_generate": True,
                                 "tooltip": "The random seed used for creating the noise (drawn on the CPU as "
                                            "ComfyUI does, so a seed gives core KSampler's noise)."}),
                "steps": ("INT", {"default": 20, "min": 1, "max": 10000,
                                  "tooltip": "The number of steps used in the denoising process."}),
                "cfg": ("FLOAT", {"default": 8.0, "min": 0.0, "max": 100.0, "step": 0.1, "round": 0.01,
                                  "tooltip": "Classifier-free guidance (u + cfg * (c - u)); 1.0 skips the negative "
                                             "pass. Z-Image-Turbo runs at 1.0."}),
                "sampler_name": (list(SAMPLER_NAMES), {"default": "euler",
                                                       "tooltip": "The sampling algorithm, with ComfyUI's meaning."}),
                "scheduler": (list(SCHEDULER_NAMES), {"default": "simple",
                                                      "tooltip": "How the noise levels are spaced over the steps, "
                                                                 "with ComfyUI's meaning."}),
                "latent_image": ("LATENT", {"tooltip": "The latent to denoise: Empty Latent Image (Empty SD3 "
                                                       "Latent Image for Z-Image's 16 channels) for text-to-image, "
                                                       "a VAE-encoded image for image-to-image."}),
                "denoise": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 1.0, "step": 0.01,
                                      "tooltip": "The amount of denoising applied; lower values keep more of the "
                                                 "input latent's structure."}),
                "acceleration": (list(ACCELERATIONS), {"default": "cuda_graph",
                                                       "tooltip": "none: eager; cuda_graph: the model call is "
                                                                  "captured once per size and replayed; "
                                                                  "compile+cuda_graph: torch.compile first (slow "
                                                                  "first run). Eager on the CPU and while a DiT "
                                                                  "streams under a VRAM budget."}),
            },
            "optional": {
                "positive": ("CONDITIONING", {"tooltip": "The conditioning describing what to include (core "
                                                         "CLIPTextEncode, or any node giving this model's text "
                                                         "encoder output). Replaces positive_prompt."}),
                "negative": ("CONDITIONING", {"tooltip": "The conditioning describing what to exclude; used when "
                                                         "cfg is not 1. Replaces negative_prompt."}),
                "positive_prompt": ("STRING", {"multiline": True, "default": "",
                                               "tooltip": "The positive prompt as text, encoded by the lean_model's "
                                                          "own text encoder; ignored when positive is connected."}),
                "negative_prompt": ("STRING", {"multiline": True, "default": "",
                                               "tooltip": "The negative prompt as text; ignored when negative is "
                                                          "connected or cfg is 1."}),
            },
        }

    def run(self, lean_model, seed, steps, cfg, sampler_name, scheduler, latent_image, denoise, acceleration,
            positive=None, negative=None, positive_prompt="", negative_prompt=""):
        settings = KSamplerSettings(seed=seed, steps=steps, cfg=cfg, sampler_name=sampler_name, scheduler=scheduler,
                                    denoise=denoise, acceleration=acceleration, positive_prompt=positive_prompt,
                                    negative_prompt=negative_prompt)
        return (sample_k(lean_model, settings, latent_image, positive=positive, negative=negative),)


NODE_CLASS_MAPPINGS = {"LeanKSampler": LeanKSampler}
NODE_DISPLAY_NAME_MAPPINGS = {"LeanKSampler": "Fused KSampler"}

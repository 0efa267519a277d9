"""Fused DDIM Sampler node (``LeanFusedDDIMSampler``): argument plumbing over ``sampling.loop.sample``."""
from __future__ import annotations

from ..sampling.ddim import SPACINGS
from ..sampling.loop import sample
from ..sampling.settings import ACCELERATIONS, CFG_MODES, MAX_SEED, SamplerSettings


class LeanFusedDDIMSampler:
    DESCRIPTION = ("DDIM sampling that reproduces diffusers' DDIMScheduler pipelines exactly (same seed, same "
                   "latent), with classifier-free guidance and the DDIM update fused into one kernel and the whole "
                   "step replayed as a CUDA graph (optionally torch.compile'd). Connect a latent for img2img, and "
                   "CONDITIONING from any text-encode node to replace the prompt strings.")
    CATEGORY = "LeanDiffusion/sampling"
    FUNCTION = "run"
    RETURN_TYPES = ("LATENT",)
    RETURN_NAMES = ("LATENT",)
    OUTPUT_TOOLTIPS = ("The sampled latents (raw VAE latent space, [batch, 4, height/8, width/8]); decode them with "
                       "Tiled VAE Decode or ComfyUI's VAE Decode.",)

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "lean_model": ("LEAN_MODEL", {"tooltip": "The model from the Memory Pool Loader."}),
                "positive": ("STRING", {"multiline": True, "default": "",
                                        "tooltip": "What the image should show. ComfyUI weights (red cube:1.3), "
                                                   "((x)), plus [x] = weaker and BREAK (new 77-token chunk); "
                                                   "embedding:NAME. Ignored when positive_cond is connected."}),
                "negative": ("STRING", {"multiline": True, "default": "",
                                        "tooltip": "What the image should avoid (the unconditional prompt of CFG), "
                                                   "same syntax. Ignored when negative_cond is connected."}),
                "seed": ("INT", {"default": 0, "min": 0, "max": MAX_SEED, "control_after_generate": True,
                                 "tooltip": "Noise seed; noise is drawn on the CPU for the whole batch, as ComfyUI "
                                            "and diffusers do, so a seed gives the same latent everywhere."}),
                "steps": ("INT", {"default": 30, "min": 1, "max": 1000,
                                  "tooltip": "Number of DDIM steps (img2img runs int(steps * denoise) of them)."}),
                "cfg": ("FLOAT", {"default": 7.5, "min": 0.0, "max": 30.0, "step": 0.1, "round": 0.01,
                                  "tooltip": "Classifier-free guidance scale; 1.0 skips the negative prompt pass."}),
                "eta": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 1.0, "step": 0.01,
                                  "tooltip": "DDIM eta: 0 is deterministic DDIM, 1 adds DDPM-like noise each step "
                                             "(drawn from the seed)."}),
                "width": ("INT", {"default": 512, "min": 64, "max": 8192, "step": 8,
                                  "tooltip": "Image width in pixels (multiple of 8); ignored when a latent_image "
                                             "is connected."}),
                "height": ("INT", {"default": 512, "min": 64, "max": 8192, "step": 8,
                                   "tooltip": "Image height in pixels (multiple of 8); ignored when a latent_image "
                                              "is connected."}),
                "batch_size": ("INT", {"default": 1, "min": 1, "max": 64,
                                       "tooltip": "Images per run. With a latent_image: 1 samples each of its rows once; a larger "
                                                  "value repeats its rows and must be a multiple of its batch."}),
                "timestep_spacing": (list(SPACINGS), {"default": "leading",
                                                      "tooltip": "How the steps are spread over the 1000 training "
                                                                 "timesteps (diffusers' timestep_spacing)."}),
                "cfg_mode": (list(CFG_MODES), {"default": "batched",
                                               "tooltip": "batched: one UNet call on the negative/positive pair "
                                                          "(fastest); sequential: two calls (lower peak VRAM)."}),
                "acceleration": (list(ACCELERATIONS), {"default": "cuda_graph",
                                                       "tooltip": "none: eager; cuda_graph: the step is captured "
                                                                  "once and replayed; compile+cuda_graph: "
                                                                  "torch.compile the UNet first (slow first run). "
                                                                  "Falls back to eager on the CPU."}),
            },
            "optional": {
                "latent_image": ("LATENT", {"tooltip": "Optional input latent for image-to-image and edits."}),
                "denoise": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 1.0, "step": 0.01,
                                      "tooltip": "img2img strength: how much of the schedule runs (1.0 = all). "
                                                 "Below 1 without a latent_image, starts from an empty latent."}),
                "positive_cond": ("CONDITIONING", {"tooltip": "Optional CONDITIONING (e.g. from CLIPTextEncode); "
                                                              "when connected it REPLACES the positive text."}),
                "negative_cond": ("CONDITIONING", {"tooltip": "Optional CONDITIONING (e.g. from CLIPTextEncode); "
                                                              "when connected it REPLACES the negative text."}),
            },
        }

    def run(self, lean_model, positive, negative, seed, steps, cfg, eta, width, height, batch_size,
            timestep_spacing, cfg_mode, acceleration, latent_image=None, denoise=1.0, positive_cond=None,
            negative_cond=None):
        settings = SamplerSettings(positive=positive, negative=negative, seed=seed, steps=steps, cfg=cfg, eta=eta,
                                   width=width, height=height, batch_size=batch_size,
                                   timestep_spacing=timestep_spacing, cfg_mode=cfg_mode, acceleration=acceleration,
                                   denoise=denoise)
        return (sample(lean_model, settings, latent_image=latent_image, positive_cond=positive_cond,
                       negative_cond=negative_cond),)


NODE_CLASS_MAPPINGS = {"LeanFusedDDIMSampler": LeanFusedDDIMSampler}
NODE_DISPLAY_NAME_MAPPINGS = {"LeanFusedDDIMSampler": "Fused DDIM Sampler"}

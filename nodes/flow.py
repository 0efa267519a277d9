"""Fused Flow Sampler node (``LeanFlowSampler``): argument plumbing over ``sampling.flow.loop.sample_flow`` (Z-Image)
and ``sampling.qwen.loop.sample_qwen_image`` (a Qwen-Image model)."""
from __future__ import annotations

from ..sampling.flow.loop import sample_flow
from ..sampling.flow.settings import SIZE_MULTIPLE, FlowSettings
from ..sampling.qwen.loop import is_qwen_image, sample_qwen_image
from ..sampling.settings import ACCELERATIONS, MAX_SEED


class LeanFlowSampler:
    DESCRIPTION = ("Flow-matching sampling for Z-Image that reproduces diffusers' ZImagePipeline (same seed, same "
                   "latent), with the guidance combine and the Euler step fused into one kernel and the whole step "
                   "replayed as a CUDA graph (optionally torch.compile'd). Connect a latent for img2img, and Qwen3 "
                   "CONDITIONING to replace the prompt strings. A Qwen-Image model runs diffusers' QwenImagePipeline's "
                   "loop (cfg is its true_cfg_scale, prompt and negative in one batched call per step), with the "
                   "same CUDA-graph acceleration; latent_image, denoise and CONDITIONING (Qwen2.5-VL hidden "
                   "states) work for it as for Z-Image.")
    CATEGORY = "LeanDiffusion/sampling"
    FUNCTION = "run"
    RETURN_TYPES = ("LATENT",)
    RETURN_NAMES = ("LATENT",)
    OUTPUT_TOOLTIPS = ("The sampled latents (raw VAE latent space, [batch, 16, height/8, width/8]); decode them "
                       "with Tiled VAE Decode.",)

    @classmethod
    def INPUT_TYPES(cls):
        size = {"min": SIZE_MULTIPLE, "max": 8192, "step": SIZE_MULTIPLE}
        return {
            "required": {
                "lean_model": ("LEAN_MODEL", {"tooltip": "A Z-Image model from a Memory Pool Loader (split files "
                                                         "or a diffusers folder)."}),
                "positive": ("STRING", {"multiline": True, "default": "",
                                        "tooltip": "What the image should show, in plain language (Z-Image reads "
                                                   "long descriptive prompts; no weight syntax). Ignored when "
                                                   "positive_cond is connected."}),
                "negative": ("STRING", {"multiline": True, "default": "",
                                        "tooltip": "What to avoid; used only when cfg > 1. Ignored when "
                                                   "negative_cond is connected."}),
                "seed": ("INT", {"default": 0, "min": 0, "max": MAX_SEED, "control_after_generate": True,
                                 "tooltip": "Noise seed; noise is drawn on the CPU for the whole batch, as ComfyUI "
                                            "and diffusers do, so a seed gives the same latent everywhere."}),
                "steps": ("INT", {"default": 9, "min": 1, "max": 1000,
                                  "tooltip": "Sampling steps; Z-Image-Turbo is distilled for 8-9."}),
                "cfg": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 30.0, "step": 0.1, "round": 0.01,
                                  "tooltip": "Guidance as in ComfyUI (u + cfg * (c - u)). 1.0 (Turbo's setting) "
                                             "runs one pass per step without the negative; above 1 adds the "
                                             "negative pass."}),
                "width": ("INT", {"default": 1024, **size,
                                  "tooltip": "Image width in pixels (multiple of 16); ignored when a latent_image "
                                             "is connected."}),
                "height": ("INT", {"default": 1024, **size,
                                   "tooltip": "Image height in pixels (multiple of 16); ignored when a "
                                              "latent_image is connected."}),
                "batch_size": ("INT", {"default": 1, "min": 1, "max": 64,
                                       "tooltip": "Images per run. With a latent_image: 1 samples each of its rows "
                                                  "once; a larger value repeats its rows (a multiple of its batch)."}),
                "acceleration": (list(ACCELERATIONS), {"default": "cuda_graph",
                                                       "tooltip": "none: eager; cuda_graph: the step is captured "
                                                                  "once and replayed (any prompt of similar length "
                                                                  "replays it); compile+cuda_graph: torch.compile "
                                                                  "the DiT blocks first (slow first run). Eager "
                                                                  "on the CPU and while the DiT streams under a "
                                                                  "VRAM budget (its copies bound the step)."}),
            },
            "optional": {
                "latent_image": ("LATENT", {"tooltip": "Optional 16-channel input latent for image-to-image "
                                                       "(Qwen-Image: [B, 16, h, w] or ComfyUI's [B, 16, 1, h, w])."}),
                "denoise": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 1.0, "step": 0.01,
                                      "tooltip": "img2img strength: the share of the schedule that runs (1.0 = "
                                                 "all, from pure noise). Below 1 without a latent_image, starts "
                                                 "from an empty latent."}),
                "positive_cond": ("CONDITIONING", {"tooltip": "Optional hidden-state CONDITIONING (Qwen3 for "
                                                              "Z-Image, Qwen2.5-VL for Qwen-Image); when "
                                                              "connected it REPLACES the positive text."}),
                "negative_cond": ("CONDITIONING", {"tooltip": "Optional hidden-state CONDITIONING (Qwen3 for "
                                                              "Z-Image, Qwen2.5-VL for Qwen-Image); when "
                                                              "connected it REPLACES the negative text."}),
            },
        }

    def run(self, lean_model, positive, negative, seed, steps, cfg, width, height, batch_size, acceleration,
            latent_image=None, denoise=1.0, positive_cond=None, negative_cond=None):
        settings = FlowSettings(positive=positive, negative=negative, seed=seed, steps=steps, cfg=cfg, width=width,
                                height=height, batch_size=batch_size, acceleration=acceleration, denoise=denoise)
        sample = sample_qwen_image if is_qwen_image(lean_model) else sample_flow
        return (sample(lean_model, settings, latent_image=latent_image, positive_cond=positive_cond,
                       negative_cond=negative_cond),)


NODE_CLASS_MAPPINGS = {"LeanFlowSampler": LeanFlowSampler}
NODE_DISPLAY_NAME_MAPPINGS = {"LeanFlowSampler": "Fused Flow Sampler"}

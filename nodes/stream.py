"""Stream Scheduler Sampler node (``LeanStreamSampler``): argument plumbing over ``sampling.stream.scheduler``."""
from __future__ import annotations

from ..sampling.ddim import SPACINGS
from ..sampling.settings import ACCELERATIONS, MAX_SEED
from ..sampling.stream.scheduler import run_stream
from ..sampling.stream.settings import MAX_BATCH, MAX_IMAGES_PER_PROMPT, StreamSettings


class LeanStreamSampler:
    DESCRIPTION = ("Samples many prompts in one go: text encoding, denoising and VAE decoding of successive "
                   "batches overlap on separate CUDA streams. SD/SDXL run DDIM: image n (prompt-major order) is "
                   "exactly the Fused DDIM Sampler's image for its prompt with seed + n and batch size 1. Z-Image "
                   "runs the flow sampler: image n is the Fused Flow Sampler's image for its prompt with seed + n "
                   "and batch size 1 (use steps 9, cfg 1 for Z-Image-Turbo). Connect CONDITIONING to replace the "
                   "prompt lines (one prompt per batch row) and the negative text.")
    CATEGORY = "LeanDiffusion/sampling"
    FUNCTION = "run"
    RETURN_TYPES = ("IMAGE", "LATENT")
    RETURN_NAMES = ("IMAGE", "LATENT")
    OUTPUT_TOOLTIPS = ("Every image, prompt by prompt (all copies of prompt 1, then prompt 2, ...).",
                       "The same images' latents (raw VAE latent space: 4 channels for SD/SDXL, 16 for Z-Image), "
                       "in the same order.")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "lean_model": ("LEAN_MODEL", {"tooltip": "The model from a Memory Pool Loader: SD1.x/SD2.x/SDXL "
                                                     "(DDIM) or Z-Image (flow sampler)."}),
            "prompts": ("STRING", {"multiline": True, "default": "",
                                   "tooltip": "One prompt per line; empty lines are skipped. Ignored (may be "
                                              "empty) when positive_cond is connected. Z-Image reads plain "
                                              "language (no weight syntax)."}),
            "negative": ("STRING", {"multiline": True, "default": "",
                                    "tooltip": "Negative prompt shared by every image (the unconditional prompt "
                                               "of CFG; Z-Image uses it only when cfg > 1). Ignored when "
                                               "negative_cond is connected."}),
            "seed": ("INT", {"default": 0, "min": 0, "max": MAX_SEED, "control_after_generate": True,
                             "tooltip": "Image n (prompt-major order) is sampled with seed + n, its noise drawn "
                                        "on the CPU as the Fused DDIM / Flow Sampler draws it for batch size 1."}),
            "steps": ("INT", {"default": 30, "min": 1, "max": 1000,
                              "tooltip": "Number of sampling steps (DDIM for SD/SDXL; Z-Image-Turbo is distilled "
                                         "for 8-9 flow steps: use 9)."}),
            "cfg": ("FLOAT", {"default": 7.5, "min": 0.0, "max": 30.0, "step": 0.1, "round": 0.01,
                              "tooltip": "Classifier-free guidance scale (u + cfg * (c - u)). SD/SDXL: 1.0 skips "
                                         "the negative pass. Z-Image: cfg <= 1 runs one pass without the "
                                         "negative; Z-Image-Turbo wants 1.0."}),
            "width": ("INT", {"default": 512, "min": 64, "max": 8192, "step": 8,
                              "tooltip": "Image width in pixels (multiple of 8; 16 for Z-Image)."}),
            "height": ("INT", {"default": 512, "min": 64, "max": 8192, "step": 8,
                               "tooltip": "Image height in pixels (multiple of 8; 16 for Z-Image)."}),
            "timestep_spacing": (list(SPACINGS), {"default": "leading",
                                                  "tooltip": "How the DDIM steps are spread over the 1000 training "
                                                             "timesteps (diffusers' timestep_spacing); Z-Image "
                                                             "uses its own flow schedule and ignores it."}),
            "acceleration": (list(ACCELERATIONS), {"default": "cuda_graph",
                                                   "tooltip": "none: eager; cuda_graph: each batch size's step is "
                                                              "captured once and replayed; compile+cuda_graph: "
                                                              "torch.compile the UNet (Z-Image: the DiT blocks) "
                                                              "first (slow first run). Falls back to eager on "
                                                              "the CPU."}),
            "images_per_prompt": ("INT", {"default": 1, "min": 1, "max": MAX_IMAGES_PER_PROMPT,
                                          "tooltip": "Images per prompt (consecutive seeds)."}),
            "max_batch": ("INT", {"default": 0, "min": 0, "max": MAX_BATCH,
                                  "tooltip": "Images denoised together per UNet/DiT batch. 0 = automatic from the free "
                                             "VRAM and the loader's budget; halved automatically on out-of-memory."}),
            "decode_tile_size": ("INT", {"default": 0, "min": 0, "max": 4096, "step": 32,
                                         "tooltip": "0 = decode untiled when it fits, else in exact tiles (auto "
                                                    "size). 128-4096 = always decode in exact tiles of this many "
                                                    "pixels."}),
        }, "optional": {
            "positive_cond": ("CONDITIONING", {"tooltip": "Optional CONDITIONING (e.g. from CLIPTextEncode; for "
                                                          "Z-Image, Qwen3 hidden states); when connected it "
                                                          "REPLACES the prompts lines: each batch row is one "
                                                          "prompt, in row order (one CLIPTextEncode = one "
                                                          "prompt)."}),
            "negative_cond": ("CONDITIONING", {"tooltip": "Optional CONDITIONING; when connected it REPLACES the "
                                                          "negative text: 1 row = shared by every prompt, one row "
                                                          "per prompt = row i is prompt i's negative."}),
        }}

    def run(self, lean_model, prompts, negative, seed, steps, cfg, width, height, timestep_spacing, acceleration,
            images_per_prompt, max_batch, decode_tile_size, positive_cond=None, negative_cond=None):
        settings = StreamSettings.from_text(prompts, negative=negative, seed=seed, steps=steps, cfg=cfg,
                                            width=width, height=height, timestep_spacing=timestep_spacing,
                                            acceleration=acceleration, images_per_prompt=images_per_prompt,
                                            max_batch=max_batch, decode_tile_size=decode_tile_size)
        result = run_stream(lean_model, settings, positive_cond=positive_cond, negative_cond=negative_cond)
        return (result.images, {"samples": result.latents})


NODE_CLASS_MAPPINGS = {"LeanStreamSampler": LeanStreamSampler}
NODE_DISPLAY_NAME_MAPPINGS = {"LeanStreamSampler": "Stream Scheduler Sampler"}

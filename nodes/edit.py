"""Fused Edit Sampler node (``LeanEditSampler``): argument plumbing over ``sampling.qwen.edit.sample_qwen_edit``."""
from __future__ import annotations

from ..sampling.qwen.edit import MAX_MEGAPIXELS, EditSettings, sample_qwen_edit
from ..sampling.settings import ACCELERATIONS, MAX_SEED

_REFERENCE = ("Optional extra reference image (Qwen-Image-Edit Plus takes up to three; the instruction can name it "
              "as 'Picture {n}'). 1 image is shared by every edit, or as many as in image (one per edit).")

# inputs the Fused and the Stream Edit Sampler declare alike
EDIT_INPUTS = {
    "lean_model": ("LEAN_MODEL", {"tooltip": "A Qwen-Image-Edit model from a Memory Pool Loader (a "
                                             "QwenImageEdit(Plus)Pipeline diffusers folder, or split files with the "
                                             "whole Qwen2.5-VL text encoder)."}),
    "negative": ("STRING", {"multiline": True, "default": "", "tooltip": "What to avoid; used only when true_cfg > 1."}),
    "steps": ("INT", {"default": 40, "min": 1, "max": 1000, "tooltip": "Sampling steps."}),
    "true_cfg": ("FLOAT", {"default": 4.0, "min": 0.0, "max": 30.0, "step": 0.1, "round": 0.01,
                           "tooltip": "diffusers' true_cfg_scale: above 1 also runs the negative and rescales the "
                                      "guided prediction to the prompt's norm; 1 runs one pass per step."}),
}


class LeanEditSampler:
    DESCRIPTION = ("Instruction editing with Qwen-Image-Edit that reproduces diffusers' QwenImageEditPlusPipeline "
                   "(same seed, same latent): Qwen2.5-VL reads the instruction with the images, the images' VAE "
                   "latents join the DiT's tokens, and true CFG guides the flow-matching steps. A batch of images is "
                   "that many edits with one instruction. Decode the LATENT with the Qwen-Image VAE.")
    CATEGORY = "LeanDiffusion/sampling"
    FUNCTION = "run"
    RETURN_TYPES = ("LATENT",)
    RETURN_NAMES = ("LATENT",)
    OUTPUT_TOOLTIPS = ("The edited images' latents (raw VAE latent space, [batch, 16, height/8, width/8]); the size "
                       "follows image's aspect ratio at megapixels.",)

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "lean_model": EDIT_INPUTS["lean_model"],
                "image": ("IMAGE", {"tooltip": "The image(s) to edit (Picture 1). A batch of B images gives B "
                                               "edits with the same instruction. At least 64 px on a side."}),
                "instruction": ("STRING", {"multiline": True, "default": "",
                                           "tooltip": "What to change, in plain language (e.g. 'make the sky "
                                                      "stormy'); refer to extra references as Picture 2, 3."}),
                "negative": EDIT_INPUTS["negative"],
                "seed": ("INT", {"default": 0, "min": 0, "max": MAX_SEED, "control_after_generate": True,
                                 "tooltip": "Noise seed; noise is drawn on the CPU for the whole batch, as diffusers "
                                            "does, so a seed gives the same latent everywhere."}),
                "steps": EDIT_INPUTS["steps"],
                "true_cfg": EDIT_INPUTS["true_cfg"],
                "megapixels": ("FLOAT", {"default": 1.0, "min": 0.01, "max": MAX_MEGAPIXELS, "step": 0.01,
                                         "tooltip": "Output area relative to 1024x1024 (1.0 = the pipeline's); the "
                                                    "output keeps image's aspect ratio, sides multiples of 32. The "
                                                    "references are VAE-encoded at the same area."}),
                "acceleration": (list(ACCELERATIONS), {"default": "cuda_graph",
                                                       "tooltip": "none: eager; cuda_graph: the step (both CFG rows in "
                                                                  "one transformer call) is captured once and "
                                                                  "replayed; compile+cuda_graph: torch.compile the "
                                                                  "transformer blocks first (slow first run). Eager "
                                                                  "on the CPU and while the DiT streams under a "
                                                                  "VRAM budget."}),
            },
            "optional": {
                "image2": ("IMAGE", {"tooltip": _REFERENCE.format(n=2)}),
                "image3": ("IMAGE", {"tooltip": _REFERENCE.format(n=3)}),
            },
        }

    def run(self, lean_model, image, instruction, negative, seed, steps, true_cfg, megapixels, acceleration,
            image2=None, image3=None):
        settings = EditSettings(instruction=instruction, negative=negative, seed=seed, steps=steps,
                                true_cfg=true_cfg, megapixels=megapixels, acceleration=acceleration)
        return (sample_qwen_edit(lean_model, settings, image, image2, image3),)


NODE_CLASS_MAPPINGS = {"LeanEditSampler": LeanEditSampler}
NODE_DISPLAY_NAME_MAPPINGS = {"LeanEditSampler": "Fused Edit Sampler"}

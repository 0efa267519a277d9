"""Stream Edit Sampler node (``LeanEditStreamSampler``): argument plumbing over ``sampling.qwen.edit_stream``."""
from __future__ import annotations

from ..sampling.qwen.edit import MAX_MEGAPIXELS
from .edit import EDIT_INPUTS
from ..sampling.qwen.edit_inputs import folder_fingerprint
from ..sampling.qwen.edit_stream import EditStreamSettings, run_edit_stream
from ..sampling.settings import ACCELERATIONS, MAX_SEED
from ..sampling.stream.settings import MAX_BATCH


class LeanEditStreamSampler:
    DESCRIPTION = ("Edits many images with one instruction (Qwen-Image-Edit): the vision-language and VAE encoding "
                   "of the next batch and the decoding of the previous one run beside this batch's denoising on "
                   "separate CUDA streams. Edit n (the images rows, then the folder's files by name) is exactly the "
                   "Fused Edit Sampler's one-image edit of it with seed + n. Images of different output sizes are "
                   "grouped by size: one IMAGE / LATENT output per size.")
    CATEGORY = "LeanDiffusion/sampling"
    FUNCTION = "run"
    RETURN_TYPES = ("IMAGE", "LATENT")
    RETURN_NAMES = ("IMAGE", "LATENT")
    OUTPUT_IS_LIST = (True, True)
    OUTPUT_TOOLTIPS = ("The decoded edits (IMAGE, 0..1), one batch per output size, in the order of each size's first "
                       "image (one batch when every image has one aspect ratio); nodes after it run once per batch.",
                       "The same edits' latents (raw VAE latent space, [batch, 16, height/8, width/8]), one per "
                       "output size, matching IMAGE.")

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "lean_model": EDIT_INPUTS["lean_model"],
                "instruction": ("STRING", {"multiline": True, "default": "",
                                           "tooltip": "What to change in every image, in plain language (e.g. 'make "
                                                      "the background plain white')."}),
                "negative": EDIT_INPUTS["negative"],
                "seed": ("INT", {"default": 0, "min": 0, "max": MAX_SEED, "control_after_generate": True,
                                 "tooltip": "Edit n uses seed + n, its noise drawn on the CPU as the Fused Edit "
                                            "Sampler draws it for one image."}),
                "steps": EDIT_INPUTS["steps"],
                "true_cfg": EDIT_INPUTS["true_cfg"],
                "megapixels": ("FLOAT", {"default": 1.0, "min": 0.01, "max": MAX_MEGAPIXELS, "step": 0.01,
                                         "tooltip": "Output area relative to 1024x1024; each output keeps its "
                                                    "image's aspect ratio (sides multiples of 32)."}),
                "acceleration": (list(ACCELERATIONS), {"default": "cuda_graph",
                                                       "tooltip": "none: eager; cuda_graph: each batch shape's step "
                                                                  "is captured once and replayed; "
                                                                  "compile+cuda_graph: torch.compile the DiT blocks "
                                                                  "first (slow first run). Eager on the CPU and "
                                                                  "while the DiT streams under a VRAM budget."}),
                "max_batch": ("INT", {"default": 0, "min": 0, "max": MAX_BATCH,
                                      "tooltip": "Images denoised together per DiT call. 0 = automatic: as many as the "
                                                 "free VRAM and the loader's budget hold, up to what fills the "
                                                 "GPU (1024 px edits go one at a time, 512 px four at a time); "
                                                 "halved automatically on out-of-memory."}),
            },
            "optional": {
                "images": ("IMAGE", {"tooltip": "The images to edit (an IMAGE batch, e.g. from Load Image); edited "
                                                "first, in batch order. At least 64 px on a side."}),
                "folder": ("STRING", {"default": "",
                                      "tooltip": "Optional folder inside ComfyUI's input directory (e.g. 'to_edit' "
                                                 "for input/to_edit): its .png/.jpg/.webp/.bmp/.tif images are "
                                                 "edited after images, sorted by name. Empty: none."}),
            },
        }

    @classmethod
    def IS_CHANGED(cls, folder="", **_):
        """The folder's files (names, sizes, times): a changed folder re-runs the node (ComfyUI caches by input)."""
        return folder_fingerprint(folder) if isinstance(folder, str) and folder.strip() else ""

    def run(self, lean_model, instruction, negative, seed, steps, true_cfg, megapixels, acceleration, max_batch,
            images=None, folder=""):
        settings = EditStreamSettings(instruction=instruction, negative=negative, seed=seed, steps=steps,
                                      true_cfg=true_cfg, megapixels=megapixels, acceleration=acceleration,
                                      max_batch=max_batch)
        result = run_edit_stream(lean_model, settings, images=images, folder=folder)
        return (result.images, [{"samples": latents} for latents in result.latents])


NODE_CLASS_MAPPINGS = {"LeanEditStreamSampler": LeanEditStreamSampler}
NODE_DISPLAY_NAME_MAPPINGS = {"LeanEditStreamSampler": "Stream Edit Sampler"}

"""ESRGAN Upscale node: argument plumbing over ``upscale.loader``, ``upscale.options`` and ``upscale.runner``."""
from __future__ import annotations

from ..bridge import list_models, model_fingerprint, resolve_model
from ..upscale.loader import EXTENSIONS, load_upscaler
from ..upscale.options import DEVICES, MAX_OVERLAP, MAX_TILE, PRECISIONS, check_options
from ..upscale.runner import upscale_images


class LeanESRGANUpscale:
    CATEGORY = "LeanDiffusion/upscale"
    DESCRIPTION = ("Upscale images with an ESRGAN / Real-ESRGAN (RRDBNet or compact) model, or any model spandrel "
                   "knows, on the GPU or the CPU. Tiles see their surroundings as context and are feathered "
                   "together, so seams do not show; memory stays bounded for any image size.")
    RETURN_TYPES = ("IMAGE",)
    RETURN_NAMES = ("IMAGE",)
    OUTPUT_TOOLTIPS = ("The upscaled images (IMAGE, 0..1): each side times the model's scale, or times output_scale "
                       "when it is not 0; RGBA when the input image had an alpha channel.",)
    FUNCTION = "upscale"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "image": ("IMAGE", {"tooltip": "Images to upscale; a batch is upscaled one image at a time. An alpha "
                                           "channel (RGBA) is kept: resized alongside with bicubic filtering."}),
            "model_name": (list_models("upscale_models", EXTENSIONS),
                           {"tooltip": "Upscale model file from ComfyUI's models/upscale_models folder "
                                       "(.safetensors, .pth, .pt or .ckpt)."}),
            "output_scale": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 16.0, "step": 0.05,
                                       "tooltip": "0 = the model's native scale; otherwise 0.25-16, the model's "
                                                  "output resized with antialiased bicubic filtering."}),
            "device": (list(DEVICES), {"default": "auto",
                                       "tooltip": "auto: the GPU when it has room, else the CPU. cpu never "
                                                  "touches the GPU."}),
            "tile_size": ("INT", {"default": 0, "min": 0, "max": MAX_TILE, "step": 8,
                                  "tooltip": "Kept core of each tile in input pixels; 0 = the largest that fits "
                                             "the memory budget (the whole image when it fits), else 32-2048."}),
            "tile_overlap": ("INT", {"default": 32, "min": 0, "max": MAX_OVERLAP, "step": 4,
                                     "tooltip": "Context pixels each tile sees beyond its core; more context, "
                                                "fewer visible seams (0 shows them)."}),
            "precision": (list(PRECISIONS), {"default": "auto",
                                             "tooltip": "auto: fp16 on the GPU (bf16/fp32 where a model needs "
                                                        "it), fp32 on the CPU."}),
        }}

    @classmethod
    def IS_CHANGED(cls, model_name, **_):
        """The model file's identity: a file replaced on disk under the same name runs the node again."""
        return model_fingerprint("upscale_models", model_name)

    def upscale(self, image, model_name, output_scale, device, tile_size, tile_overlap, precision):
        check_options(image, output_scale, device, tile_size, tile_overlap, precision)  # before reading the file
        upscaler = load_upscaler(resolve_model("upscale_models", model_name))
        out = upscale_images(upscaler, image, output_scale=output_scale, device=device, tile_size=tile_size,
                             tile_overlap=tile_overlap, precision=precision)
        return (out,)


NODE_CLASS_MAPPINGS = {"LeanESRGANUpscale": LeanESRGANUpscale}
NODE_DISPLAY_NAME_MAPPINGS = {"LeanESRGANUpscale": "ESRGAN Upscale"}

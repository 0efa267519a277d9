"""Memory Pool Loader (split files) node: Z-Image's three split files -> LEAN_MODEL under a VRAM policy + plan.

Argument plumbing only; the work is in ``memory/split_files.py``. The policy, budget and dtype inputs are the Memory
Pool Loader's own declarations, so both loaders always offer the same choices.
"""
from __future__ import annotations

from .. import bridge
from ..memory.split_files import FOLDERS, load_split_engine, split_choices
from .loader import LeanModelLoader


def _shared(name: str) -> tuple:
    return LeanModelLoader.INPUT_TYPES()["required"][name]


class LeanSplitModelLoader:
    DESCRIPTION = ("Loads Z-Image(-Turbo) from ComfyUI's split files - a diffusion model, a Qwen3 text encoder and "
                   "the Flux VAE, bf16 or fp8 - into a LeanDiffusion engine under a VRAM policy, and reports the "
                   "memory plan. Each file's part and layout are read from its tensors, not its name. The Qwen "
                   "tokenizer comes from a Z-Image folder in models/diffusers or from ComfyUI's own files.")
    CATEGORY = "LeanDiffusion/loaders"
    RETURN_TYPES = ("LEAN_MODEL", "STRING")
    RETURN_NAMES = ("lean_model", "memory_plan")
    OUTPUT_TOOLTIPS = LeanModelLoader.OUTPUT_TOOLTIPS
    FUNCTION = "load"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "diffusion_model": (split_choices("transformer"), {"tooltip": (
                "The Z-Image diffusion model (DiT), a .safetensors file in models/diffusion_models (or the older "
                "models/unet): z_image_turbo_bf16.safetensors, an fp8_e4m3fn variant, Tongyi's original file or a "
                "diffusers-layout single file.")}),
            "text_encoder": (split_choices("text_encoder"), {"tooltip": (
                "The Qwen3-4B text encoder, a .safetensors file in models/text_encoders (or the older models/clip): "
                "qwen_3_4b.safetensors or an fp8 variant. CLIP, T5 and Qwen2.5-VL files do not work with Z-Image.")}),
            "vae": (split_choices("vae"), {"tooltip": (
                "The 16-channel Flux VAE, a .safetensors file in models/vae: ae.safetensors (original or diffusers "
                "layout). SD1.x/SDXL VAEs (4 channels) do not work with Z-Image.")}),
            "vram_policy": _shared("vram_policy"),
            "vram_budget_gb": _shared("vram_budget_gb"),
            "weight_dtype": _shared("weight_dtype"),
            "vae_dtype": _shared("vae_dtype"),
        }}

    @classmethod
    def IS_CHANGED(cls, diffusion_model, text_encoder, vae, **_):
        """The three files' identities: a file replaced on disk under the same name loads again."""
        names = {"transformer": diffusion_model, "text_encoder": text_encoder, "vae": vae}
        return "|".join(bridge.model_fingerprint(FOLDERS[role], name) for role, name in names.items())

    def load(self, diffusion_model, text_encoder, vae, vram_policy, vram_budget_gb, weight_dtype, vae_dtype):
        engine = load_split_engine(diffusion_model, text_encoder, vae, vram_policy, vram_budget_gb, weight_dtype,
                                   vae_dtype)  # checked there
        return (engine, engine.plan)


NODE_CLASS_MAPPINGS = {"LeanSplitModelLoader": LeanSplitModelLoader}
NODE_DISPLAY_NAME_MAPPINGS = {"LeanSplitModelLoader": "Memory Pool Loader (split files)"}

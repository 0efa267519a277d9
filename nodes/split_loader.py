"""Memory Pool Loader (split files) node: Z-Image's or Qwen-Image's three split files -> LEAN_MODEL + plan.

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
    DESCRIPTION = ("Loads Z-Image(-Turbo) or Qwen-Image from ComfyUI's split files - a diffusion model, a text "
                   "encoder (Qwen3-4B / Qwen2.5-VL-7B) and the VAE (Flux / Qwen-Image), bf16 or fp8 - into a "
                   "LeanDiffusion engine under a VRAM policy, and reports the memory plan. Each file's model, part "
                   "and layout are read from its tensors, not its name. The Qwen tokenizer comes from a diffusers "
                   "folder of the same model in models/diffusers or from ComfyUI's own files.")
    CATEGORY = "LeanDiffusion/loaders"
    RETURN_TYPES = ("LEAN_MODEL", "STRING")
    RETURN_NAMES = ("lean_model", "memory_plan")
    OUTPUT_TOOLTIPS = LeanModelLoader.OUTPUT_TOOLTIPS
    FUNCTION = "load"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "diffusion_model": (split_choices("transformer"), {"tooltip": (
                "The diffusion model (DiT), a .safetensors file in models/diffusion_models (or the older "
                "models/unet): z_image_turbo_bf16.safetensors, an fp8_e4m3fn variant, Tongyi's original file or a "
                "diffusers-layout single file; or qwen_image_bf16.safetensors / qwen_image_fp8_e4m3fn.")}),
            "text_encoder": (split_choices("text_encoder"), {"tooltip": (
                "The text encoder, a .safetensors file in models/text_encoders (or the older models/clip): Z-Image's "
                "Qwen3-4B (qwen_3_4b.safetensors) or Qwen-Image's Qwen2.5-VL-7B (qwen_2.5_vl_7b.safetensors), bf16 "
                "or fp8. CLIP and T5 files do not work with either.")}),
            "vae": (split_choices("vae"), {"tooltip": (
                "The VAE, a .safetensors file in models/vae: Z-Image's 16-channel Flux VAE (ae.safetensors) or "
                "qwen_image_vae.safetensors. SD1.x/SDXL VAEs (4 channels) do not work with either.")}),
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

"""Memory Pool Loader node: a checkpoint (or the tiny test model) -> LEAN_MODEL under a VRAM policy + memory plan.

Argument plumbing only; the work is in ``memory/load.py`` (loading) and ``memory/policies.py`` (placement).
"""
from __future__ import annotations

from .. import bridge
from ..memory.load import TINY_CHOICE, TINY_ZIMAGE_CHOICE, VAE_DTYPES, WEIGHT_DTYPES, load_engine, model_choices
from ..memory.policies import VramPolicy

POLICIES = [p.value for p in VramPolicy]


class LeanModelLoader:
    DESCRIPTION = ("Loads an SD1.x / SD2.x / SDXL checkpoint (single .safetensors file or diffusers folder) into a "
                   "LeanDiffusion engine under a VRAM policy, and reports the memory plan: what stays on the GPU, "
                   "what streams, estimated and measured peaks.")
    CATEGORY = "LeanDiffusion/loaders"
    RETURN_TYPES = ("LEAN_MODEL", "STRING")
    RETURN_NAMES = ("lean_model", "memory_plan")
    OUTPUT_TOOLTIPS = ("The loaded model (engine handle) for LeanDiffusion sampler, LoRA and VAE nodes.",
                       "The memory plan as text: per stage what is resident, what streams, the estimated peak.")
    FUNCTION = "load"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": (model_choices(), {"default": TINY_CHOICE, "tooltip": (
                "Checkpoint to load: a .safetensors file from models/checkpoints, a folder from models/diffusers, "
                "a Z-Image diffusers folder (ZImagePipeline), or 'tiny-random (test)' / 'tiny-random Z-Image (test)', "
                "tiny random SD1.x-like / Z-Image-like models that run anywhere (for testing graphs).")}),
            "vram_policy": (POLICIES, {"default": "auto", "tooltip": (
                "full: everything on the GPU. balanced: UNet on the GPU, text encoders and VAE only while used. "
                "lowvram: text encoders on the CPU, VAE on the GPU only while decoding. stream: UNet weights split "
                "into a resident part and blocks streamed from pinned RAM within vram_budget_gb. auto: the fastest "
                "policy that fits the free VRAM.")}),
            "vram_budget_gb": ("FLOAT", {"default": 4.0, "min": 0.5, "max": 1024.0, "step": 0.5, "tooltip": (
                "GPU memory, in GB, that the 'stream' policy keeps every node using this model within (sampling, "
                "prompt encoding, VAE decode/encode): weights kept on the GPU plus working memory. Too small a "
                "budget gives an error stating the model's minimum.")}),
            "weight_dtype": (list(WEIGHT_DTYPES), {"default": "auto", "tooltip": (
                "Precision of the denoiser (UNet or DiT) and text encoder weights. auto: fp16 on the GPU (bf16 for "
                "Z-Image), fp32 on the CPU. fp8_e4m3fn: the denoiser's weights stored in fp8 (half of bf16's memory "
                "and streamed bytes; slightly lower quality), computed in bf16 on the GPU / fp32 on the CPU; text "
                "encoders and VAE keep that precision. fp8_e4m3fn_fast: the same storage with fp8 matrix "
                "multiplications on GPUs with fp8 tensor cores (RTX 40xx, H100/H200 and newer; elsewhere the same as "
                "fp8_e4m3fn).")}),
            "vae_dtype": (list(VAE_DTYPES), {"default": "auto", "tooltip": (
                "Precision of the VAE. auto keeps the VAE in fp32 where fp16 is known to overflow (SDXL), as "
                "ComfyUI's --no-half-vae does, and uses the weight precision otherwise.")}),
        }}

    @classmethod
    def IS_CHANGED(cls, model, **_):
        """The checkpoint file's (or diffusers folder's files') identity: a model replaced on disk under the same name
        loads again; the built-in tiny model never changes."""
        if model in (TINY_CHOICE, TINY_ZIMAGE_CHOICE):
            return model
        if str(model).lower().endswith(".safetensors"):
            return bridge.model_fingerprint("checkpoints", model)
        return bridge.model_fingerprint("diffusers", model)

    def load(self, model, vram_policy, vram_budget_gb, weight_dtype, vae_dtype):
        engine = load_engine(model, vram_policy, vram_budget_gb, weight_dtype, vae_dtype)  # checked there
        return (engine, engine.plan)


NODE_CLASS_MAPPINGS = {"LeanModelLoader": LeanModelLoader}
NODE_DISPLAY_NAME_MAPPINGS = {"LeanModelLoader": "Memory Pool Loader"}

"""Dynamic LoRA Injector node (``LeanLoraInjector``): argument plumbing over ``lora.inject_lora``."""
from __future__ import annotations

from .. import bridge
from ..lora import inject_lora

LORA_EXTENSIONS = (".safetensors", ".sft", ".pt", ".pth", ".ckpt", ".bin")


class LeanLoraInjector:
    DESCRIPTION = ("Adds a LoRA to a LEAN_MODEL without touching its weights: the output is a new view that shares "
                   "every base weight with the input (which stays valid). 'unmerged' computes the LoRA at run time "
                   "and keeps strength in device buffers, so changing strength re-runs only downstream nodes, with no "
                   "reload, weight copy or CUDA-graph recapture. 'merged' writes it into the weights for each run and "
                   "restores them bit-exactly afterwards.")
    CATEGORY = "LeanDiffusion/lora"
    FUNCTION = "inject"
    RETURN_TYPES = ("LEAN_MODEL",)
    RETURN_NAMES = ("lean_model",)
    OUTPUT_TOOLTIPS = ("A new view of the model with this LoRA; the input model is unchanged.",)

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "lean_model": ("LEAN_MODEL", {"tooltip": "The model to add the LoRA to (left unchanged)."}),
            "lora_name": (bridge.list_models("loras", LORA_EXTENSIONS), {
                "tooltip": "A LoRA file from ComfyUI's loras folder, made for the model's family. SD1.x / SD2.x / "
                           "SDXL: kohya (lora_unet_/lora_te_) or diffusers/PEFT (lora_A/lora_B), LoRA or LoCon; "
                           "LyCORIS LoHa, LoKr, Tucker LoCon and DoRA in the kohya layout. Z-Image: diffusers/PEFT "
                           "(transformer.*, as ZImagePipeline.save_lora_weights writes) or ComfyUI/kohya "
                           "(diffusion_model.* / lora_unet_*, fused qkv included). Qwen-Image: diffusers/PEFT "
                           "(transformer.*), ComfyUI (diffusion_model.*), kohya (lora_unet_*) or the bare names of "
                           "the few-step Lightning LoRAs (transformer_blocks.*)."}),
            "strength": ("FLOAT", {"default": 1.0, "min": -10.0, "max": 10.0, "step": 0.01,
                                   "tooltip": "Multiplier of the LoRA on the UNet (Z-Image, Qwen-Image: the DiT). 0 "
                                              "gives the base model (bit-exactly on the CPU; on the GPU up to "
                                              "rounding)."}),
            "strength_text_encoder": ("FLOAT", {"default": 1.0, "min": -10.0, "max": 10.0, "step": 0.01,
                                                "tooltip": "Multiplier of the LoRA on the text encoder(s)."}),
            "target_blocks": ("STRING", {"default": "", "multiline": False,
                                         "tooltip": "Empty: every layer the LoRA covers. Else comma-separated blocks: "
                                                    "diffusers names ('mid_block, up_blocks.2'), ComfyUI/LDM names "
                                                    "('middle_block, output_blocks.3') or LoRA Block Weight indices "
                                                    "('MID, OUT03'); Z-Image: module names ('layers.3, noise_refiner'); "
                                                    "Qwen-Image: 'transformer_blocks.12, proj_out'; "
                                                    "add 'text_encoder' (and 'text_encoder_2') to keep the "
                                                    "text-encoder part."}),
            "mode": (["unmerged", "merged"], {"default": "unmerged",
                                              "tooltip": "unmerged: LoRA computed at run time (free strength changes). "
                                                         "merged: written into the weights per run (fastest steps, "
                                                         "restored bit-exactly after)."}),
        }}

    @classmethod
    def IS_CHANGED(cls, lora_name, **_):
        """The LoRA file's identity: a file replaced on disk under the same name runs the node again (strength
        changes alone do not reload anything: the loaded LoRA is cached by path and file identity)."""
        return bridge.model_fingerprint("loras", lora_name)

    def inject(self, lean_model, lora_name, strength, strength_text_encoder, target_blocks, mode):
        path = bridge.resolve_model("loras", lora_name, "lora_name")
        view = inject_lora(lean_model, path, strength=strength, strength_text_encoder=strength_text_encoder,
                           target_blocks=target_blocks, mode=mode, name=lora_name)
        return (view,)


NODE_CLASS_MAPPINGS = {"LeanLoraInjector": LeanLoraInjector}
NODE_DISPLAY_NAME_MAPPINGS = {"LeanLoraInjector": "Dynamic LoRA Injector"}

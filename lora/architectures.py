"""Which model a LoRA file was made for, judged from its layer names and widths, and the guard against the model's.

Invariant: a LoRA whose layer names belong to exactly one architecture of ``ARCHES``, other than the model's, is
refused before anything is resolved or attached, by a ``ValueError`` naming the ``lora_name`` input, both families
and the fix; a file whose names match no architecture (or several) goes on to key resolution (``keymap.resolve``),
which lists every layer that matches no module. Why: a Z-Image LoRA on SDXL (or the reverse) would otherwise fail
with hundreds of unmatched keys and no word on the cause. The model's architecture is family data
(``lora_arch`` in ``memory/configs/families.json``), never a comparison of family names.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from ..memory.families import family_defaults
from .formats import ParsedLora


@dataclass(frozen=True)
class LoraArch:
    """Layer names (in either spelling, ``.`` or kohya's ``_``) that only this architecture's LoRAs hold."""

    name: str  # the ``lora_arch`` of the families that run these LoRAs
    display: str
    unet: re.Pattern  # denoiser layers (the engine's ``unet`` component: a UNet or a DiT)
    text: Optional[re.Pattern]  # text-encoder layers; a second text encoder marks SDXL
    # files may hold fused ``attention.qkv`` layers (split by ``zimage_names.split_fused``), and a fused or bare
    # ``out`` copy next to the split layers is redundant when it carries the same delta
    fused_qkv: bool = False

    def matches(self, layer) -> bool:
        if layer.component == "unet":
            return bool(self.unet.match(layer.name))
        if layer.component == "text_encoder_2":
            return self.name == "sd-unet"
        return bool(self.text and self.text.match(layer.name))


ARCHES = {
    "sd-unet": LoraArch("sd-unet", "SD1.x / SD2.x / SDXL",
                        re.compile(r"((down|up|input|output)_blocks[._]\d|(mid_block|middle_block)[._])"),
                        re.compile(r"(text_model[._])?encoder[._]layers[._]\d")),  # CLIP (Z-Image's Qwen3: layers.N)
    "zimage": LoraArch("zimage", "Z-Image",
                       re.compile(r"((layers|noise_refiner|context_refiner)[._]\d+[._]"
                                  r"(attention|feed_forward|adaLN_modulation)[._]"
                                  r"|(all_)?(x_embedder|final_layer)([._]|$)|(cap|t)_embedder[._])"),
                       None, fused_qkv=True),
    # Qwen-Image's MMDiT (joint blocks, embedders, output layer): ComfyUI's module names are diffusers' own, so every
    # layout of its LoRAs resolves on the model's names without an alias table (``keymap.UNET_ALIASES``)
    "qwen_image": LoraArch("qwen_image", "Qwen-Image",
                           re.compile(r"(transformer_blocks[._]\d+[._](attn|img_mod|txt_mod|img_mlp|txt_mlp)[._]"
                                      r"|(img_in|txt_in|proj_out)$|norm_out[._]linear$|time_text_embed[._])"),
                           None),
}


def lora_arch(parsed: ParsedLora) -> Optional[LoraArch]:
    """The one architecture whose names the file's layers use, else None (no such name, or names of several)."""
    found = {arch.name for layer in parsed.layers for arch in ARCHES.values() if arch.matches(layer)}
    return ARCHES[found.pop()] if len(found) == 1 else None


def model_arch(model_family: str) -> LoraArch:
    """The architecture of an engine family (``lora_arch`` of its ``families.json`` row)."""
    return ARCHES[family_defaults(model_family)["lora_arch"]]


def check_family(parsed: ParsedLora, model_family: str, lora_name: str) -> None:
    """Refuse a LoRA made for another architecture than ``model_family``'s (module docstring)."""
    arch, model = lora_arch(parsed), model_arch(model_family)
    if arch is None or arch is model:
        return
    example = next(layer.source for layer in parsed.layers if arch.matches(layer))
    made_for = family_hint(parsed) or arch.display
    shown = family_defaults(model_family)["display"]
    raise ValueError(f"lora_name={lora_name!r}: a {made_for} LoRA (layers such as {example}), but the model is "
                     f"{model_family} ({shown}); a LoRA only works on the model family it was trained for: pick a "
                     f"{model.display} LoRA for this model, or load a {arch.display} model for this LoRA")


def family_hint(parsed: ParsedLora) -> str:
    """A best guess of the SD family a LoRA was trained for, from tensor widths real models have ('' if none).

    Cross-attention key projections read the text context: 768 wide in SD1.x, 1024 in SD2.x, 2048 in SDXL.
    """
    if "text_encoder_2" in parsed.components():
        return "SDXL"
    widths = {768: "SD1.x", 1024: "SD2.x", 2048: "SDXL"}
    for layer in parsed.layers:
        if layer.component == "unet" and re.search(r"attn2[._]to_k$", layer.name):
            return widths.get(layer.in_dim, "")
    if any(re.match(r"(input_blocks[._][78][._]1|output_blocks[._][0-2][._]1)[._]transformer_blocks[._]9", layer.name)
           for layer in parsed.layers):
        return "SDXL"
    return ""

"""Tiny random Qwen-Image LoRA files in the layouts people have (test helper, not a test).

Names are written here by hand from diffusers' module names (independent of ``lora.keymap``):
- ``peft``: diffusers' own ``QwenImagePipeline.save_lora_weights`` from a copy of the transformer that peft's
  ``LoraConfig`` was injected into (``transformer.<module>.lora_A/lora_B.weight`` and diffusers'
  ``lora_adapter_metadata`` header with ``lora_alpha`` and ``alpha_pattern``);
- ``lightning``: the bare module names with ``lora_down`` / ``lora_up`` and an ``.alpha`` each, as lightx2v's
  few-step Qwen-Image-Lightning files hold them (what diffusers' ``_convert_non_diffusers_qwen_lora_to_diffusers``
  reads when a file has alphas and no prefix);
- ``comfy_down`` / ``comfy_A``: ComfyUI's ``diffusion_model.<module>`` with lora_down/lora_up or lora_A/lora_B and
  alphas (ai-toolkit and ComfyUI's own trainer);
- ``kohya``: kohya / musubi-tuner's ``lora_unet_<module with _ for .>`` with lora_down/lora_up and alphas;
- ``peft_default``: the bare names with PEFT's adapter name left in (``.lora_A.default.weight``, no alpha), as
  DiffSynth-Studio saves them.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch

from . import zimage_lora as zl
from .zimage_lora import peft_layers  # noqa: F401 (re-exported: what the reference applies)

# every Linear of the MMDiT: joint blocks (attention, modulation, MLPs), the embedders and the output layer
TARGETS = (r".*(attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)|(img|txt)_mod\.1"
           r"|(img|txt)_mlp\.net\.(0\.proj|2)|img_in|txt_in|proj_out|norm_out\.linear"
           r"|time_text_embed\.timestep_embedder\.linear_[12])")
PEFT_ALPHA_PATTERN = {"img_mlp.net.2": 7.0, "to_add_out": 1.0}
LAYOUTS = {"lightning": ("", "lora_down"), "comfy_down": ("diffusion_model.", "lora_down"),
           "comfy_A": ("diffusion_model.", "lora_A"), "kohya": ("lora_unet_", "lora_down"),
           "peft_default": ("", "lora_A.default")}
_SPELLINGS = {**zl.FACTOR_SPELLINGS, "lora_A.default": (".lora_A.default.weight", ".lora_B.default.weight")}


def target_names(transformer: torch.nn.Module) -> list[str]:
    return zl.target_names(transformer, TARGETS)


def factors(transformer: torch.nn.Module, rank: int = 4, seed: int = 0) -> dict[str, tuple]:
    """diffusers module name -> (down [r, in], up [out, r], alpha) for every ``TARGETS`` layer (the draws of
    ``zimage_lora.linear_factors``, as ``save_peft_lora`` makes them), alphas varying from layer to layer."""
    gen = torch.Generator().manual_seed(seed)
    return {name: (*zl.linear_factors(transformer.get_submodule(name), rank, gen), rank * (0.5, 1.0, 1.5)[i % 3])
            for i, name in enumerate(target_names(transformer))}


def state_dict(layers: dict[str, tuple], layout: str) -> dict[str, torch.Tensor]:
    """``layers`` (``factors``) in one of ``LAYOUTS``; ``peft_default`` holds no alphas (scale 1: alpha = rank)."""
    prefix, spelling = LAYOUTS[layout]
    d_suffix, u_suffix = _SPELLINGS[spelling]
    sd = {}
    for name, (down, up, alpha) in layers.items():
        key = prefix + (name.replace(".", "_") if prefix == "lora_unet_" else name)
        sd[key + d_suffix], sd[key + u_suffix] = down, up
        if layout != "peft_default":
            sd[key + ".alpha"] = torch.tensor(float(alpha))
    return sd


def write_layout(transformer: torch.nn.Module, layout: str, path: str | Path, seed: int = 0) -> Path:
    """A LoRA file for ``transformer`` in ``layout`` (``"peft"`` or a key of ``LAYOUTS``) at ``path``."""
    path = Path(path)
    if layout == "peft":  # copied whole: the header's alphas are part of the layout
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as folder:
            saved = zl.save_peft_lora(transformer, folder, seed=seed, pipeline="QwenImagePipeline", targets=TARGETS,
                                      alpha_pattern=PEFT_ALPHA_PATTERN)
            return Path(shutil.copyfile(saved, path))
    return zl.write(state_dict(factors(transformer, seed=seed), layout), path)


def diffusers_pipeline(folder: str | Path, lora: str | Path):
    """``QwenImagePipeline`` at ``folder`` with ``lora`` loaded by diffusers as adapter ``"ref"`` (the reference)."""
    return zl.diffusers_pipeline(folder, lora, "QwenImagePipeline")

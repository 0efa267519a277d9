"""Map the module names a LoRA file uses onto the model's Linear / Conv2d modules.

Invariant: every layer of a file resolves to exactly one module of one component, or the whole mapping fails
with a ``ValueError`` listing every key that matched nothing (never a silent skip), before any module is touched.
Two layers on one module are refused, except a Z-Image file's redundant copy whose delta equals the other's.

Names
- PEFT files use the module's dotted diffusers/transformers name: looked up directly.
- kohya files spell that name with ``_`` for ``.``: looked up in an index of ``name.replace(".", "_")`` of every
  Linear/Conv2d module (this is how kohya's trainers derive the names, so it is exact, not a heuristic).
- kohya SDXL files use the LDM (``sgm``) UNet names (``input_blocks.4.1.transformer_blocks.0.attn1.to_q``);
  ``ldm_unet_names`` derives the LDM name of every diffusers UNet module from the UNet's *structure* (blocks,
  resnets, attentions, samplers counted on the module itself), so it holds for SD1.x, SD2.x, SDXL and any
  block layout. LDM block numbering: ``input_blocks[0]`` = conv_in, then per down block one entry per resnet
  (``.0`` resnet, ``.1`` its attention) and one for the downsampler (``.0.op``); ``middle_block`` = resnet,
  attention, resnet; ``output_blocks`` one entry per up-block resnet (``.0`` resnet, ``.1`` attention, then the
  upsampler at ``.1`` or ``.2``). Inside a resnet: in_layers.2 = conv1, out_layers.3 = conv2, emb_layers.1 =
  time_emb_proj, skip_connection = conv_shortcut.
- ComfyUI's files (``diffusion_model.<LDM name>``) use the dotted LDM names: looked up in the dotted table, next
  to the diffusers names.
- Z-Image (a DiT in the ``unet`` slot): diffusers' names, plus the model's original names (``zimage_names``:
  ``attention.out``, ``x_embedder``, ``final_layer.*``) in both spellings; a fused ``attention.qkv`` layer is split
  onto ``to_q/to_k/to_v`` first, and a redundant copy of a layer (same delta) is dropped. Which alias table applies
  is the model family's ``lora_arch`` (``architectures``).
- Qwen-Image (its MMDiT in the ``unet`` slot): every layout spells diffusers' module names, which are also ComfyUI's
  (``transformer_blocks.N.attn.to_q``, ``img_mod.1``, ``img_mlp.net.0.proj``, ``norm_out.linear``...): PEFT
  ``transformer.<name>``, ComfyUI ``diffusion_model.<name>``, kohya ``lora_unet_<name with _>``, and the bare
  ``<name>`` of the few-step "Lightning" files (lora_down/lora_up with an ``.alpha`` each); no alias table.
- Text-encoder layers for modules the engine leaves out because no image depends on them (CLIP-L's
  ``text_projection``, SD2.x's last OpenCLIP layer; ComfyUI patches them to no effect) are skipped with a warning
  that names them (``_left_out``): the picture is what ComfyUI makes from the same file. Any other layer that
  matches no module is refused.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Optional

import torch

from .architectures import family_hint, model_arch
from ..memory.fp8_weights import weight_shape
from .dora import magnitude_problem
from .formats import LoraLayer, ParsedLora
from .zimage_names import original_aliases, same_delta, split_fused

logger = logging.getLogger(__name__)

TARGET_TYPES = (torch.nn.Linear, torch.nn.Conv2d)
_RESNET_LDM = {"conv1": "in_layers.2", "conv2": "out_layers.3", "time_emb_proj": "emb_layers.1",
               "conv_shortcut": "skip_connection"}
_TOP_LDM = {"conv_in": "input_blocks.0.0", "conv_out": "out.2", "time_embedding.linear_1": "time_embed.0",
            "time_embedding.linear_2": "time_embed.2", "add_embedding.linear_1": "label_emb.0.0",
            "add_embedding.linear_2": "label_emb.0.2"}


@dataclass(frozen=True, eq=False)
class Target:
    """A LoRA layer resolved onto one module."""

    component: str
    module_name: str  # dotted name inside the component
    module: torch.nn.Module
    layer: LoraLayer


def targetable_modules(root: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in root.named_modules() if name and isinstance(m, TARGET_TYPES)}


def _block_prefixes(unet: torch.nn.Module) -> dict[str, str]:
    """diffusers block prefix -> LDM block prefix, derived from the UNet's module structure."""
    out: dict[str, str] = {}
    idx = 1
    for b, block in enumerate(getattr(unet, "down_blocks", [])):
        n_res = len(block.resnets)
        has_attn = getattr(block, "attentions", None) is not None and len(block.attentions) > 0
        for j in range(n_res):
            out[f"down_blocks.{b}.resnets.{j}"] = f"input_blocks.{idx}.0"
            if has_attn:
                out[f"down_blocks.{b}.attentions.{j}"] = f"input_blocks.{idx}.1"
            idx += 1
        if getattr(block, "downsamplers", None):
            out[f"down_blocks.{b}.downsamplers.0"] = f"input_blocks.{idx}.0"
            idx += 1
    mid = getattr(unet, "mid_block", None)
    if mid is not None:
        out["mid_block.resnets.0"] = "middle_block.0"
        if getattr(mid, "attentions", None):
            out["mid_block.attentions.0"] = "middle_block.1"
            if len(mid.resnets) > 1:
                out["mid_block.resnets.1"] = "middle_block.2"
        elif len(mid.resnets) > 1:
            out["mid_block.resnets.1"] = "middle_block.1"
    idx = 0
    for b, block in enumerate(getattr(unet, "up_blocks", [])):
        n_res = len(block.resnets)
        has_attn = getattr(block, "attentions", None) is not None and len(block.attentions) > 0
        for j in range(n_res):
            out[f"up_blocks.{b}.resnets.{j}"] = f"output_blocks.{idx}.0"
            if has_attn:
                out[f"up_blocks.{b}.attentions.{j}"] = f"output_blocks.{idx}.1"
            if j == n_res - 1 and getattr(block, "upsamplers", None):
                out[f"up_blocks.{b}.upsamplers.0"] = f"output_blocks.{idx}.{2 if has_attn else 1}"
            idx += 1
    return out


def ldm_unet_names(unet: torch.nn.Module) -> dict[str, str]:
    """diffusers module name -> LDM module name, for every Linear/Conv2d of ``unet`` that has an LDM twin."""
    blocks = _block_prefixes(unet)
    out = {}
    for name in targetable_modules(unet):
        if name in _TOP_LDM:
            out[name] = _TOP_LDM[name]
            continue
        for prefix, ldm in blocks.items():
            if not name.startswith(prefix + "."):
                continue
            rest = name[len(prefix) + 1:]
            if ".resnets." in prefix:
                rest = _RESNET_LDM.get(rest, rest)
            elif ".downsamplers." in prefix and rest == "conv":
                rest = "op"
            out[name] = f"{ldm}.{rest}"
            break
    return out


def _ldm_aliases(root: torch.nn.Module, modules: dict) -> list[tuple[str, str]]:
    return [(ldm, n) for n, ldm in ldm_unet_names(root).items()]


# the denoiser's other spellings, per LoRA architecture (``architectures.ARCHES``): (alias, module name) pairs
UNET_ALIASES = {"sd-unet": _ldm_aliases, "zimage": lambda root, modules: original_aliases(modules),
                "qwen_image": lambda root, modules: []}


class ModuleIndex:
    """Lookup of one component's Linear/Conv2d modules by dotted and kohya names, and for the denoiser by the
    other names of its architecture (``UNET_ALIASES``: LDM names of a UNet, a DiT's original names)."""

    def __init__(self, component: str, root: torch.nn.Module, arch: str = "sd-unet"):
        self.component = component
        self.modules = targetable_modules(root)
        self.dotted: dict[str, Optional[str]] = {}
        self.kohya: dict[str, Optional[str]] = {}
        aliases = [(n, n) for n in self.modules]
        if component == "unet":
            aliases += UNET_ALIASES[arch](root, self.modules)
        else:
            aliases += [(alias, n) for n in self.modules if (alias := _text_model_alias(root, n))]
        for alias, name in aliases:
            for table, key in ((self.dotted, alias), (self.kohya, alias.replace(".", "_"))):
                if key in table and table[key] != name:
                    table[key] = None  # ambiguous spelling: refuse rather than guess
                else:
                    table[key] = name

    def lookup(self, layer: LoraLayer) -> Optional[str]:
        table = self.dotted if layer.naming == "dotted" else self.kohya
        return table.get(layer.name)


def _text_model_alias(root: torch.nn.Module, name: str) -> Optional[str]:
    """transformers 5 flattened CLIP text models (``encoder.layers.0...``); files (and transformers 4) spell
    ``text_model.encoder.layers.0...``. Each spelling is accepted on either version."""
    if hasattr(root, "text_model"):
        return name[len("text_model."):] if name.startswith("text_model.") else None
    return "text_model." + name


def resolve(parsed: ParsedLora, roots: dict[str, Optional[torch.nn.Module]], model_family: str) -> list[Target]:
    """Resolve every layer of ``parsed`` onto ``roots`` (component -> module or None). Raises ValueError listing
    every unmatched layer, and every shape mismatch, with a model-family hint."""
    hint = family_hint(parsed)
    about = f" (the file looks like a {hint} LoRA; the model is {model_family})" if hint else ""
    missing_components = sorted(c for c in parsed.components() if roots.get(c) is None)
    if missing_components:
        raise ValueError(f"lora {parsed.source}: has layers for {', '.join(missing_components)}, which the "
                         f"{model_family} model does not have{about}; use a LoRA made for this model family")
    arch = model_arch(model_family)
    indexes = {c: ModuleIndex(c, roots[c], arch.name) for c in parsed.components()}
    layers = split_fused(parsed.layers, parsed.source) if arch.fused_qkv else parsed.layers
    targets, unmatched, left_out, seen = [], [], [], {}
    for layer in layers:
        name = indexes[layer.component].lookup(layer)
        if name is None:
            dropped = _left_out(layer, roots[layer.component], model_family)
            (left_out if dropped else unmatched).append(layer.source)
            continue
        first = seen.get((layer.component, name))
        if first is not None:
            if arch.fused_qkv and same_delta(first, layer):
                continue  # a redundant copy (``zimage_names``: a fused qkv or bare out next to the split layers)
            differ = " with different deltas" if arch.fused_qkv else ""
            raise ValueError(f"lora {parsed.source}: layers {first.source} and {layer.source} both target "
                             f"{layer.component}.{name}{differ}; the file is inconsistent")
        seen[(layer.component, name)] = layer
        targets.append(Target(layer.component, name, indexes[layer.component].modules[name], layer))
    if left_out:
        logger.warning("lora %s: skipping %d layers for text-encoder modules that no image depends on, which the %s "
                       "model leaves out (CLIP-L's text_projection in SD1.x and SDXL; SD2.x's last OpenCLIP layer, "
                       "as SD2 conditions on the penultimate one); ComfyUI applies them without effect: %s",
                       parsed.source, len(left_out), model_family, ", ".join(left_out[:30]))
    if unmatched:
        shown = ", ".join(unmatched[:30]) + (f" (+{len(unmatched) - 30} more)" if len(unmatched) > 30 else "")
        raise ValueError(f"lora {parsed.source}: {len(unmatched)} of {len(parsed.layers)} layers match no module "
                         f"of the {model_family} model{about}; use a LoRA made for this model family: {shown}")
    bad = [msg for t in targets if (msg := shape_problem(t))]
    if bad:
        raise ValueError(f"lora {parsed.source}: {len(bad)} layers do not fit their modules{about}; use a LoRA made "
                         f"for this model family: " + "; ".join(bad[:10]))
    return targets


_TEXT_LAYER = re.compile(r"(?:text_model[._])?encoder[._]layers[._](\d+)[._]")


def _left_out(layer, root: torch.nn.Module, model_family: str) -> bool:
    """Whether an unmatched text-encoder layer names a module that the full CLIP model has (and ComfyUI patches) but
    the engine omits, as no image depends on it: the projection of a ``CLIPTextModel`` (only its pooled output,
    which SD1.x and SDXL's CLIP-L do not use, reads it) or SD2.x's last OpenCLIP layer (``memory/ldm.py``)."""
    if layer.component == "unet":
        return False
    if layer.name == "text_projection":
        return not hasattr(root, "text_projection")
    m = _TEXT_LAYER.match(layer.name)
    return model_family.startswith("sd2") and bool(m) and int(m[1]) == root.config.num_hidden_layers


def shape_problem(target: Target) -> str:
    """'' when the factors fit the module, else a description."""
    m, layer = target.module, target.layer
    where = f"{target.component}.{target.module_name}"
    if isinstance(m, torch.nn.Conv2d) and (m.groups != 1 or m.padding_mode != "zeros"):
        return f"{where} is a grouped or non-zero-padded conv, which the injector does not support"
    shape = tuple(weight_shape(m))  # an fp8-stored layer's without dequantizing it
    problem = magnitude_problem(layer.magnitude, shape)
    if not problem and not isinstance(layer, LoraLayer):
        problem = layer.fit_problem(shape)
    if problem:
        return f"{where} (file key {layer.source}, {layer.kind}): {problem}"
    if not isinstance(layer, LoraLayer):
        return ""
    down, up = layer.down, layer.up
    if isinstance(m, torch.nn.Linear):
        if down.ndim == 4 and tuple(down.shape[2:]) != (1, 1):
            return f"{where} is Linear but the LoRA down factor is a {tuple(down.shape[2:])} conv"
        if down.shape[1] != m.in_features or up.shape[0] != m.out_features:
            return (f"{where} maps {m.in_features}->{m.out_features} but the LoRA maps "
                    f"{down.shape[1]}->{up.shape[0]}")
        return ""
    kernel = tuple(m.kernel_size)
    if down.ndim == 2 and kernel != (1, 1):
        return f"{where} is a {kernel} conv but the LoRA down factor is linear"
    if down.ndim == 4 and tuple(down.shape[2:]) != kernel:
        return f"{where} is a {kernel} conv but the LoRA down factor has kernel {tuple(down.shape[2:])}"
    if down.shape[1] != m.in_channels or up.shape[0] != m.out_channels:
        return f"{where} maps {m.in_channels}->{m.out_channels} channels but the LoRA maps " \
               f"{down.shape[1]}->{up.shape[0]}"
    return ""

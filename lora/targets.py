"""``target_blocks``: restrict a LoRA to the modules under given selectors.

Grammar: comma-separated selectors, e.g. ``mid_block, up_blocks.2`` or ``input_blocks.4, OUT03``. A bare selector
names UNet modules; it may be qualified with its component (``unet.``, ``text_encoder.``, ``text_encoder_2.``), and
a component name alone (``text_encoder``) selects that whole component. Empty = every layer the LoRA covers.

A DiT (Z-Image, Qwen-Image) has only diffusers module prefixes: ``transformer_blocks.3``, ``layers.1``, ``proj_out``.
UNet selectors, in three spellings of the same modules:
- diffusers module prefixes: ``down_blocks.1``, ``mid_block``, ``up_blocks.2.attentions.0``, ``conv_in``;
- ComfyUI / LDM (``ldm``/``sgm``) prefixes, as ComfyUI's model keys spell them: ``input_blocks.4``,
  ``middle_block``, ``output_blocks.3.1``, ``time_embed``, ``label_emb``, ``out`` (optionally after
  ``diffusion_model.``); a module is selected iff its LDM name (``keymap.ldm_unet_names``, the mapping ComfyUI's
  ``comfy.utils.unet_to_diffusers`` defines) is the prefix or lies under it;
- LoRA Block Weight indices (case-insensitive): ``IN04`` = ``input_blocks.4``, ``MID`` / ``M00`` =
  ``middle_block``, ``OUT03`` = ``output_blocks.3`` (the numbering of the LoRA Block Weight extension for SD1.x
  and SDXL: ``INnn``/``OUTnn`` are the LDM block indices).
Text-encoder prefixes are CLIP module names, with or without ``text_model.`` (files and transformers 4 spell
``text_model.encoder.layers.0``; transformers 5 dropped the ``text_model`` attribute of ``CLIPTextModel`` but
not of ``CLIPTextModelWithProjection``): both spellings select the same modules on every version.

Invariant: with a non-empty list, a layer is kept iff its module is selected by some selector (``name == p`` or
``name.startswith(p + ".")`` in one of the spellings above); every other module is left exactly as it was. A
selector naming no module of the model, or covering no layer of the LoRA, is a ``ValueError`` naming the input,
the value and the valid blocks of this model (a silent no-op entry is almost always a typo).
"""
from __future__ import annotations

import re
from typing import Callable, Optional

import torch

from .formats import COMPONENTS
from .keymap import Target, ldm_unet_names

_LBW = re.compile(r"(?i)(?:(?P<io>in|out)(?P<n>\d{1,2})|(?P<mid>mid|m00))")
_LDM_ROOTS = ("model.diffusion_model.", "diffusion_model.")
_TEXT_MODEL = "text_model."


def parse_target_blocks(text: str) -> list[tuple[str, str]]:
    """``"mid_block, text_encoder.text_model"`` -> ``[("unet", "mid_block"), ("text_encoder", "text_model")]``."""
    if not isinstance(text, str):
        raise TypeError(f"target_blocks: expected a string of comma-separated prefixes, got {type(text).__name__}")
    out = []
    for raw in text.replace("\n", ",").split(","):
        item = raw.strip().strip(".")
        if not item:
            continue
        if any(ch.isspace() for ch in item):
            raise ValueError(f"target_blocks: {raw.strip()!r} contains spaces; separate prefixes with commas")
        comp, prefix = "unet", item
        for c in sorted(COMPONENTS, key=len, reverse=True):
            if item == c:
                comp, prefix = c, ""
                break
            if item.startswith(c + "."):
                comp, prefix = c, item[len(c) + 1:]
                break
        out.append((comp, prefix))
    return out


def _under(name: str, prefix: str) -> bool:
    return not prefix or name == prefix or name.startswith(prefix + ".")


def _ldm_spelling(prefix: str) -> str:
    """An LDM prefix for a LoRA Block Weight index (``IN04`` -> ``input_blocks.4``); other prefixes unchanged
    except for a leading ``diffusion_model.`` (ComfyUI's model keys)."""
    m = _LBW.fullmatch(prefix)
    if m:
        if m["mid"]:
            return "middle_block"
        return f"{'input' if m['io'].lower() == 'in' else 'output'}_blocks.{int(m['n'])}"
    for root in _LDM_ROOTS:
        if prefix.startswith(root):
            return prefix[len(root):]
    return prefix


def _ranges(names: list[str], head: str) -> str:
    """``head.0-3`` for the numbered children of ``head`` among ``names`` ('' when there are none)."""
    idx = sorted({int(n.split(".")[1]) for n in names if n.startswith(head + ".") and n.split(".")[1].isdigit()})
    if not idx:
        return ""
    return f"{head}.{idx[0]}-{idx[-1]}" if len(idx) > 1 else f"{head}.{idx[0]}"


def _choices(comp: str, root: torch.nn.Module, ldm: Optional[dict[str, str]]) -> str:
    """The valid blocks of ``root``, for error messages."""
    names = [n for n, _ in root.named_modules() if n]
    if comp != "unet":
        layers = [n for n in names if re.search(r"(^|\.)encoder\.layers\.\d+$", n)]
        enc = layers[0].rsplit(".", 1)[0] if layers else "encoder.layers"
        count = f".0-{len(layers) - 1}" if len(layers) > 1 else ".0"
        tops = sorted({n.split(".")[0] for n in names if "." not in n})
        return (f"{comp} alone, or {comp}.<module> with <module> one of {', '.join(tops)} or {enc}{count} "
                f"(with or without 'text_model.')")
    diffusers = [r for r in (_ranges(names, "down_blocks"), "mid_block" if "mid_block" in names else "",
                             _ranges(names, "up_blocks")) if r]
    ldm_names = list((ldm or {}).values())
    comfy = [r for r in (_ranges(ldm_names, "input_blocks"),
                         "middle_block" if any(_under(n, "middle_block") for n in ldm_names) else "",
                         _ranges(ldm_names, "output_blocks")) if r]
    if not diffusers and not comfy:  # a DiT (Z-Image, Qwen-Image): its top-level modules, numbered blocks as ranges
        tops = sorted({n.split(".")[0] for n in names})
        deeper = next((n for n in names if n.count(".") == 2 and n.split(".")[1].isdigit()), "")
        return ", ".join(_ranges(names, t) or t for t in tops) + (f" (or deeper, e.g. '{deeper}')" if deeper else "")
    lbw = []
    for r, tag in ((_ranges(ldm_names, "input_blocks"), "IN"), (_ranges(ldm_names, "output_blocks"), "OUT")):
        if r:
            lo, _, hi = r.split(".", 1)[1].partition("-")
            lbw.append(f"{tag}{int(lo):02d}-{tag}{int(hi or lo):02d}")
    if comfy:
        lbw.insert(1, "MID")
    return (f"diffusers blocks {', '.join(diffusers)} (or deeper, e.g. 'up_blocks.1.attentions.0'); ComfyUI/LDM "
            f"blocks {', '.join(comfy)}; LoRA Block Weight {', '.join(lbw)}")


def _selector(comp: str, prefix: str, root: torch.nn.Module, shown: str,
              ldm_cache: dict) -> Callable[[str], bool]:
    """A predicate over ``comp``'s module names (diffusers naming) selecting what ``prefix`` names; ValueError
    naming the valid blocks when it names no module."""
    if not prefix:
        return lambda name: True
    names = [n for n, _ in root.named_modules() if n]
    if any(_under(n, prefix) for n in names):
        return lambda name: _under(name, prefix)
    ldm = None
    if comp == "unet":
        if comp not in ldm_cache:
            ldm_cache[comp] = ldm_unet_names(root)
        ldm = ldm_cache[comp]
        spelled = _ldm_spelling(prefix)
        chosen = frozenset(n for n, ldm_name in ldm.items() if _under(ldm_name, spelled))
        if chosen:
            return chosen.__contains__
    else:
        alt = prefix[len(_TEXT_MODEL):] if prefix.startswith(_TEXT_MODEL) else _TEXT_MODEL + prefix
        if any(_under(n, alt) for n in names):
            return lambda name: _under(name, alt)
    raise ValueError(f"target_blocks: {shown!r} names no module of the {comp}; valid choices: "
                     f"{_choices(comp, root, ldm)}")


def filter_targets(targets: list[Target], text: str, roots: dict[str, Optional[torch.nn.Module]]) -> list[Target]:
    """Keep the targets under ``text``'s selectors (all when empty). Validates every selector against the model."""
    prefixes = parse_target_blocks(text)
    if not prefixes:
        return list(targets)
    selectors = []
    ldm_cache: dict = {}
    for comp, prefix in prefixes:
        shown = f"{comp}.{prefix}" if comp != "unet" else prefix
        root = roots.get(comp)
        if root is None:
            have = ", ".join(c for c in COMPONENTS if roots.get(c) is not None)
            raise ValueError(f"target_blocks: {shown!r} names the {comp}, which this model does not have "
                             f"(its components: {have})")
        chosen = _selector(comp, prefix, root, shown, ldm_cache)
        if not any(t.component == comp and chosen(t.module_name) for t in targets):
            covered = sorted({".".join(t.module_name.split(".")[:2]) for t in targets if t.component == comp})
            raise ValueError(f"target_blocks: {shown!r} covers no layer of this LoRA; the LoRA covers "
                             f"{comp} blocks {', '.join(covered[:12]) or '(none)'}")
        selectors.append((comp, chosen))
    return [t for t in targets if any(t.component == c and chosen(t.module_name) for c, chosen in selectors)]

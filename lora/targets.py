"""``target_blocks``: restrict a LoRA to modules under given prefixes (diffusers naming).

Grammar: comma-separated prefixes, e.g. ``mid_block, up_blocks.2``. A bare prefix names UNet modules; a prefix
may be qualified with its component (``unet.``, ``text_encoder.``, ``text_encoder_2.``), and a component name
alone (``text_encoder``) selects that whole component. Empty = every layer the LoRA covers.

Invariant: with a non-empty list, a layer is kept iff its module is the prefix or lies under it (``name == p`` or
``name.startswith(p + ".")``); every other module is left exactly as it was. A prefix naming no module of the
model, or covering no layer of the LoRA, is a ``ValueError`` (a silent no-op entry is almost always a typo).
"""
from __future__ import annotations

from typing import Optional

import torch

from .formats import COMPONENTS
from .keymap import Target


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


def filter_targets(targets: list[Target], text: str, roots: dict[str, Optional[torch.nn.Module]]) -> list[Target]:
    """Keep the targets under ``text``'s prefixes (all when empty). Validates every prefix against the model."""
    prefixes = parse_target_blocks(text)
    if not prefixes:
        return list(targets)
    for comp, prefix in prefixes:
        shown = f"{comp}.{prefix}" if comp != "unet" else prefix
        root = roots.get(comp)
        if root is None:
            raise ValueError(f"target_blocks: {shown!r} names the {comp}, which this model does not have")
        names = [n for n, _ in root.named_modules() if n]
        if prefix and not any(_under(n, prefix) for n in names):
            tops = sorted({n.split(".")[0] for n in names})
            raise ValueError(f"target_blocks: {shown!r} names no module of the {comp}; use diffusers module "
                             f"names such as {', '.join(tops[:8])} (e.g. 'mid_block, up_blocks.2')")
        if not any(t.component == comp and _under(t.module_name, prefix) for t in targets):
            covered = sorted({".".join(t.module_name.split(".")[:2]) for t in targets if t.component == comp})
            raise ValueError(f"target_blocks: {shown!r} covers no layer of this LoRA; the LoRA covers "
                             f"{comp} blocks {', '.join(covered[:12]) or '(none)'}")
    return [t for t in targets if any(t.component == c and _under(t.module_name, p) for c, p in prefixes)]

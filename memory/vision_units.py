"""Qwen2.5-VL's vision tower as streamable units and its working memory: the plan's side of streaming the tower of
an edit model's text stage (``memory/text_streaming.py`` is the run-time side).

Invariant: a text encoder with a vision tower is laid out as transformers' ``Qwen2_5_VLModel``: a ``visual`` tower
(``patch_embed``, a ``blocks`` list whose blocks each run once per tower forward in order, a ``merger``) and a
``language_model`` that streams as a decoder-only model (``memory/text_units.py``). A unit is one vision block
``blocks.N`` (~21M parameters at full size, 1/11 of a decoder layer); the patch embedding, the merger and the
rotary table stay on the device for the placement's life. The tower streams through a ring of its own, held only
while the text stage runs, because it runs only when a prompt carries pictures: a text-only prompt (text-to-image
on a model whose text encoder kept its tower) never enters it, so its blocks cannot share the language model's
schedule, whose forward must run every unit in order.

Working shape: ``PICTURES`` condition pictures of ``PICTURE_TOKENS`` merged tokens each (Qwen-Image-Edit shows the
encoder each picture at 384x384 area: 196 merged tokens for a square picture, 235 at the worst aspect ratio, a
1312x128 picture; every merged token is ``merge^2`` patches). Working memory per patch (run dtype): the block input, its normed copy, q, k,
v and the attention output (6 x hidden) and the MLP's three intermediate-wide tensors; plus one picture's
full-attention scores (``heads x patches^2``, float32: a math attention kernel materialises them), times
``plan.FRAGMENTATION``. The language model's workspace estimate covers the tower's (they run one after the other).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .dit_units import token_block_unit
from .hostmem import FlatLayout
from .plan import FRAGMENTATION
from .stream_schedule import minimum_arena_bytes

PICTURES = 3  # QwenImageEditPlusPipeline's references: image, image2, image3
PICTURE_TOKENS = 235  # merged tokens of one condition picture at 384x384 area, any aspect ratio (docstring)
MLP_TENSORS = 3
ATTENTION_ELEMENT_BYTES = 4


@dataclass(frozen=True)
class VisionStream:
    """The vision tower's numbers: units (execution order), activation estimate, always-resident bytes."""

    units: tuple
    activation_bytes: int
    fixed_bytes: int
    patches: int

    @property
    def minimum_arena_bytes(self) -> int:
        return minimum_arena_bytes(list(self.units))


def vision_tower(encoder: Optional[torch.nn.Module]) -> Optional[torch.nn.Module]:
    """``encoder``'s vision tower when it is laid out as Qwen2.5-VL's (module docstring), else ``None``."""
    visual = getattr(encoder, "visual", None)
    if visual is None or not isinstance(getattr(visual, "blocks", None), torch.nn.ModuleList) or not len(visual.blocks):
        return None
    return visual if all(hasattr(visual, a) for a in ("patch_embed", "merger")) else None


def _merge(visual: torch.nn.Module) -> int:
    return int(visual.config.spatial_merge_size) ** 2


def vision_activation_bytes(visual: torch.nn.Module, pictures: int, picture_tokens: int, elem_size: int) -> int:
    """Activations of one tower forward over ``pictures`` pictures of ``picture_tokens`` merged tokens."""
    cfg = visual.config
    per_picture = picture_tokens * _merge(visual)
    per_patch = 6 * int(cfg.hidden_size) + MLP_TENSORS * int(cfg.intermediate_size)
    scores = int(cfg.num_heads) * per_picture ** 2 * ATTENTION_ELEMENT_BYTES
    return int(FRAGMENTATION * (pictures * per_picture * per_patch * elem_size + scores))


def vision_stream(visual: torch.nn.Module, dtype: torch.dtype, pictures: int = PICTURES,
                  picture_tokens: int = PICTURE_TOKENS) -> VisionStream:
    """The tower's streaming numbers at ``pictures`` x ``picture_tokens`` (module docstring)."""
    cfg = visual.config
    patches = pictures * picture_tokens * _merge(visual)
    hidden = int(cfg.hidden_size)
    units = [token_block_unit(f"blocks.{i}", block, dtype, 1, patches, hidden, hidden, "text")
             for i, block in enumerate(visual.blocks)]
    in_units = {id(p) for block in visual.blocks for p in block.parameters()}
    fixed = [p for p in visual.parameters() if id(p) not in in_units]
    elem = torch.empty((), dtype=dtype).element_size()
    return VisionStream(units=tuple(units),
                        activation_bytes=vision_activation_bytes(visual, pictures, picture_tokens, elem),
                        fixed_bytes=FlatLayout.of(fixed, dtype).nbytes if fixed else 0, patches=patches)


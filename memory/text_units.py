"""A decoder-only text encoder's streamable units and its working memory: the plan's side of streaming a text
encoder block by block (``memory/text_streaming.py`` is the run-time side).

Invariant: a text encoder streams when it is laid out as a decoder-only language model (transformers' ``Qwen3Model``,
or Qwen2.5-VL's language model ``Qwen2_5_VLTextModel``, which builds its multimodal rotary positions on the
looked-up embeddings' device: an ``embed_tokens`` table, a ``layers`` list whose layers each run once per forward in
order and use their weights only inside their own ``forward``, a final ``norm``) and is the model's only text
encoder. A unit is one decoder
layer ``layers.N``. The embedding table stays on the host and its lookup runs there (only the prompt's rows move
to the device, values unchanged: a lookup is a copy); the final norm and the rotary tables stay on the device.
Why the host lookup: Qwen3-4B's table is 151936 x 2560 (0.78 GB in bf16), 13% of a 6 GB budget if resident, and
as a streamed unit it would set the staging ring's minimum (3 x the largest unit) to 2.3 GB.

Working memory at ``batch`` prompts of ``TEXT_TOKENS`` tokens (bytes in the run dtype): the caller keeps every
layer's hidden state (``output_hidden_states``: ``layers + 1`` of ``tokens x hidden``) and the key/value cache the
model fills by default (``2 x kv width`` per layer and token), plus the largest transient inside one layer (its
SwiGLU MLP's three intermediate-wide tensors beside the layer input and its normed copy), times
``plan.FRAGMENTATION``, plus ``TEXT_WORKSPACE_CUDA`` on CUDA (cuBLAS's workspace, 32 MiB on Hopper, SDPA's and the
allocator's rounding: an encoder forward runs no convolution algorithms, which make most of the UNet's
``plan.WORKSPACE_CUDA``). FLOPs per unit: ``2 x tokens x weights`` plus the
attention's two ``tokens^2 x width`` products.

A Qwen2.5-VL text encoder with its vision tower (``Qwen2_5_VLModel``: an edit model's text stage) streams its
``language_model`` as above and its ``visual`` tower block by block through a ring of its own
(``memory/vision_units.py``); the stage's numbers add the tower's: its fixed bytes (patch embedding, merger), its
minimum ring and its activations.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .dit_units import token_block_unit
from .hostmem import FlatLayout
from .plan import FRAGMENTATION
from .stream_schedule import minimum_arena_bytes
from .unet_units import Unit
from .vision_units import VisionStream, vision_stream, vision_tower

TEXT_TOKENS = 512  # the longest prompt the flow sampler encodes (``sampling/flow/text.py`` MAX_TOKENS)
HOST_MODULES = ("embed_tokens",)
TEXT_WORKSPACE_CUDA = 256 * 2 ** 20  # library workspaces + allocator slack of one encoder forward (docstring)
MLP_TENSORS = 3  # gate, act(gate) -> product, up: three intermediate-wide tensors live at once


@dataclass(frozen=True)
class TextStream:
    """A streamable text encoder's numbers at the working batch: units (execution order), activation + workspace
    estimate, bytes always on the device (norm), bytes kept on the host (embedding table)."""

    units: tuple
    activation_bytes: int  # the language model's and, with a vision tower, the tower's
    fixed_bytes: int  # the language model's and, with a vision tower, the tower's
    host_bytes: int
    tokens: int
    vision: Optional[VisionStream] = None  # a Qwen2.5-VL encoder's vision tower (streamed in a ring of its own)

    @property
    def minimum_stage_bytes(self) -> int:
        """What the text stage needs on the device beside the always-resident weights at the smallest rings."""
        vision = self.vision.minimum_arena_bytes if self.vision is not None else 0
        return minimum_arena_bytes(list(self.units)) + vision + self.activation_bytes


def language_model(module: Optional[torch.nn.Module]) -> Optional[torch.nn.Module]:
    """The decoder-only language model that streams in ``module``: itself, or a Qwen2.5-VL's ``language_model``
    beside its vision tower; ``None`` when there is none (module docstring)."""
    if streams_text(module):
        return module
    inner = getattr(module, "language_model", None)
    return inner if vision_tower(module) is not None and streams_text(inner) else None


def streams_text(module: Optional[torch.nn.Module]) -> bool:
    """Whether ``module`` is laid out as a decoder-only language model (module docstring)."""
    return module is not None and isinstance(getattr(module, "layers", None), torch.nn.ModuleList) and \
        all(hasattr(module, a) for a in ("embed_tokens", "norm")) and len(module.layers) > 0


def _width(config, name: str, default: int) -> int:
    value = getattr(config, name, None)
    return int(value) if value is not None else default


def text_units(encoder: torch.nn.Module, batch: int, tokens: int, dtype: torch.dtype) -> list[Unit]:
    """One unit per decoder layer, execution order, sized in ``dtype``, FLOPs at ``batch`` x ``tokens``."""
    cfg = encoder.config
    hidden = int(cfg.hidden_size)
    heads = int(cfg.num_attention_heads)
    width = heads * _width(cfg, "head_dim", hidden // heads)
    return [token_block_unit(f"layers.{index}", layer, dtype, batch, tokens, width, hidden, "text")
            for index, layer in enumerate(encoder.layers)]


def text_activation_bytes(encoder: torch.nn.Module, batch: int, tokens: int, elem_size: int,
                          device_type: str) -> int:
    """Activations + workspace of one encoder forward (module docstring)."""
    cfg = encoder.config
    hidden, layers = int(cfg.hidden_size), len(encoder.layers)
    heads = int(cfg.num_attention_heads)
    head_dim = _width(cfg, "head_dim", hidden // heads)
    kv = _width(cfg, "num_key_value_heads", heads) * head_dim
    per_token = (layers + 1) * hidden + layers * 2 * kv + MLP_TENSORS * int(cfg.intermediate_size) + 2 * hidden
    workspace = TEXT_WORKSPACE_CUDA if device_type == "cuda" else 0
    return int(FRAGMENTATION * batch * tokens * per_token * elem_size) + workspace


def stage_activation_bytes(module: torch.nn.Module, batch: int, tokens: int, dtype: torch.dtype,
                           device_type: str) -> Optional[int]:
    """Activations + workspace of one text-stage forward of ``module`` at ``batch`` x ``tokens`` (its vision tower's
    at its working shape included), or ``None`` when ``module`` does not stream."""
    encoder = language_model(module)
    if encoder is None:
        return None
    visual = vision_tower(module) if encoder is not module else None
    vision = vision_stream(visual, dtype).activation_bytes if visual is not None else 0
    elem = torch.empty((), dtype=dtype).element_size()
    return text_activation_bytes(encoder, batch, tokens, elem, device_type) + vision


def text_stream(encoders: Sequence[torch.nn.Module], dtype: torch.dtype, batch: int, device_type: str,
                tokens: int = TEXT_TOKENS) -> Optional[TextStream]:
    """The streaming numbers of the text stage, or ``None`` when it cannot stream (several encoders, or one that is
    not a decoder-only language model: SD's CLIP encoders, which the plan keeps whole)."""
    if len(encoders) != 1 or language_model(encoders[0]) is None:
        return None
    encoder = language_model(encoders[0])
    visual = vision_tower(encoders[0]) if encoder is not encoders[0] else None
    vision = vision_stream(visual, dtype) if visual is not None else None
    units = text_units(encoder, batch, tokens, dtype)
    in_units = {id(p) for layer in encoder.layers for p in layer.parameters()}
    on_host = {id(p) for name in HOST_MODULES for p in getattr(encoder, name).parameters()}
    fixed = [p for p in encoder.parameters() if id(p) not in in_units | on_host]
    host = [p for p in encoder.parameters() if id(p) in on_host]
    elem = torch.empty((), dtype=dtype).element_size()
    extra_act, extra_fixed = (vision.activation_bytes, vision.fixed_bytes) if vision is not None else (0, 0)
    return TextStream(units=tuple(units),
                      activation_bytes=text_activation_bytes(encoder, batch, tokens, elem, device_type) + extra_act,
                      fixed_bytes=(FlatLayout.of(fixed, dtype).nbytes if fixed else 0) + extra_fixed,
                      host_bytes=FlatLayout.of(host, dtype).nbytes if host else 0, tokens=tokens, vision=vision)

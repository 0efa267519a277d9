"""A text encoder streamed block by block while its stage runs: the run-time side of ``memory/text_units.py``.

Invariants
- The decoder layers stream through a staging ring as the denoiser's blocks do (``memory/streaming.py``; a forward
  is bounded by the encoder's own ``forward``, which the prompt encoders call); the ring exists only while the text
  stage runs (``onload`` on entering it, ``offload`` on leaving), so the denoiser's stage never holds it.
- The embedding table stays on the host in the run dtype: its lookup runs there and only the looked-up rows move to
  the device (the ids go to the host first), so no device memory holds the table and the values are the ones a
  device lookup gives. The final norm and the rotary tables stay on the device for the placement's life.
- It is a placement's stage swap: ``onload`` / ``offload`` / ``restore`` (``memory/placement.py``).
- A Qwen2.5-VL encoder's vision tower streams its ``blocks.N`` through a ring of its own, bounded by the tower's
  own forward (``VisionStreamer``; ``memory/vision_units.py`` says why not the language model's ring), held only
  while the text stage runs like the language model's; its patch embedding, merger and rotary table stay on the
  device.
"""
from __future__ import annotations

from typing import Optional

import torch

from .stream_schedule import StreamSchedule
from .streaming import BlockStreamer
from .text_units import HOST_MODULES, language_model
from .vision_units import vision_tower


def _ids_to_host(module, args):
    return tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in args)


class TextStreamer(BlockStreamer):
    """Streams ``encoder``'s ``layers.N`` under ``schedule`` (module docstring)."""

    arena_at_build = False

    def __init__(self, encoder: torch.nn.Module, schedule: StreamSchedule, device: torch.device,
                 dtype: torch.dtype):
        super().__init__(encoder, schedule, device, dtype, host_modules=HOST_MODULES)

    def _install_hooks(self, modules: dict) -> None:
        super()._install_hooks(modules)
        for name in self.host_modules:
            mod = modules[name]
            self.handles[f"{name}.to_host"] = mod.register_forward_pre_hook(_ids_to_host)
            self.handles[f"{name}.to_device"] = mod.register_forward_hook(lambda m, a, out: out.to(self.device))

    def restore(self) -> None:
        """Remove the hooks and put every weight back on the host (the placement is being removed)."""
        self.remove()


class VisionStreamer(BlockStreamer):
    """Streams a Qwen2.5-VL vision tower's ``blocks.N`` under ``schedule`` while the text stage runs (module
    docstring)."""

    arena_at_build = False

    def restore(self) -> None:
        """Remove the hooks and put every weight back on the host (the placement is being removed)."""
        self.remove()


def text_streamers(encoder: torch.nn.Module, schedule: StreamSchedule, vision_schedule: Optional[StreamSchedule],
                   device: torch.device, dtype: torch.dtype) -> list:
    """The streamers of a text encoder the plan streams: its language model's (``encoder`` itself, or a
    Qwen2.5-VL's ``language_model``) and, with ``vision_schedule``, its vision tower's."""
    model = language_model(encoder)
    streamers = [TextStreamer(model, schedule, device, dtype)]
    if vision_schedule is not None:
        try:
            streamers.append(VisionStreamer(vision_tower(encoder), vision_schedule, device, dtype))
        except BaseException:
            streamers[0].restore()
            raise
    return streamers

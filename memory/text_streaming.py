"""A text encoder streamed block by block while its stage runs: the run-time side of ``memory/text_units.py``.

Invariants
- The decoder layers stream through a staging ring as the denoiser's blocks do (``memory/streaming.py``; a forward
  is bounded by the encoder's own ``forward``, which the prompt encoders call); the ring exists only while the text
  stage runs (``onload`` on entering it, ``offload`` on leaving), so the denoiser's stage never holds it.
- The embedding table stays on the host in the run dtype: its lookup runs there and only the looked-up rows move to
  the device (the ids go to the host first), so no device memory holds the table and the values are the ones a
  device lookup gives. The final norm and the rotary tables stay on the device for the placement's life.
- It is a placement's stage swap: ``onload`` / ``offload`` / ``restore`` (``memory/placement.py``).
"""
from __future__ import annotations

import torch

from .stream_schedule import StreamSchedule
from .streaming import BlockStreamer
from .text_units import HOST_MODULES


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

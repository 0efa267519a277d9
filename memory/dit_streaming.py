"""Streaming a denoiser whose sampler calls its blocks itself: a forward's schedule opens at the first unit and
closes after the last one, never at the top-level module.

Invariant: for a DiT family (``ModelParts.is_flow``: the flow sampler runs the embedders, then every block through
``__call__``, then the final layer, so the top-level ``forward`` and its hooks never run) a forward of the
:class:`~memory.streaming.BlockStreamer` schedule begins in the first unit's forward pre-hook and ends in the last
unit's forward hook; calling the model's own ``forward`` runs the same blocks in the same order, so both callers
stream alike. A forward that stops early still closes: every unit's forward hook is ``always_call``, so a block
that raises (or is refused: blocks out of order) ends the schedule with its copies joined; a forward abandoned
between two blocks (an error in the glue its caller caught) is closed when the next forward begins; a
``KeyboardInterrupt`` skips ``always_call`` hooks and is closed by ``end_unfinished`` when the session exits.
A first block entered while another block runs (a nested call) is refused, the outer forward left running.
"""
from __future__ import annotations

import torch

from .engine import ModelParts
from .stream_schedule import StreamSchedule
from .streaming import BlockStreamer


class UnitBoundStreamer(BlockStreamer):
    """A :class:`BlockStreamer` whose forwards are bounded by its first and last units (module docstring).

    ``_depth`` counts the unit calls entered and not yet ended (> 1 only inside a nested call)."""

    def _install_hooks(self, modules: dict) -> None:
        for i, u in enumerate(self.schedule.order):
            mod = modules[u.name]
            self.handles[f"{u.name}.before"] = mod.register_forward_pre_hook(lambda m, a, i=i: self._unit_begin(i))
            self.handles[f"{u.name}.after"] = mod.register_forward_hook(
                lambda m, a, o, i=i: self._unit_end(i, o), always_call=True)

    def _unit_begin(self, i: int) -> None:
        self._depth += 1  # counted before any check: this unit's own end hook (always called) uncounts it
        if i == 0:
            if self._active and self._depth > 1:
                raise RuntimeError("the streamed model was entered twice without finishing (its first block ran "
                                   "inside one of its blocks: a re-entrant call)")
            if self._active:  # the previous forward stopped between two blocks: close it before this one opens
                self._prefetched = set()  # nothing copied ahead by an unfinished forward is relied on
                self._close()
            self._start()
        self._before(i)

    def _unit_end(self, i: int, output) -> None:
        self._depth -= 1
        if self._depth > 0 or not self._active:  # a refused nested call ended, or no forward is open
            return
        if output is None:  # the block raised, or its pre-hook refused it: close the forward
            self._prefetched = set()
            self._close()
            return
        self._after(i)
        if i == len(self.schedule.order) - 1:
            self._close()

    def _close(self) -> None:
        self._active = False
        self.copier.end()  # join the copy stream: the next forward orders after every copy this one issued


def denoiser_streamer(parts: ModelParts, schedule: StreamSchedule, device: torch.device,
                      dtype: torch.dtype) -> BlockStreamer:
    """The streamer of ``parts``' denoiser: bounded by its units for a DiT family (module docstring), by the
    top-level module's forward for a UNet (whose samplers call it)."""
    kind = UnitBoundStreamer if parts.is_flow else BlockStreamer
    return kind(parts.unet, schedule, device, dtype)

"""What the loops that run a batch one image at a time share (ESRGAN Upscale, the Tiled VAE nodes, the Stream
Scheduler's decode): one progress bar over the batch that an out-of-memory retry re-plans, and releasing what a
raised error's frames hold.

Invariants:
- ``BatchProgress``: the bar counts ``units`` per image. An image retried with smaller tiles restarts with the units
  of its new tile, which every later image keeps (they start from the tile that worked): the bar goes back to the
  finished images' units, out of a total that counts the new units for this and every later image, so it never
  passes its total and ends at it.
- ``release_frames``: after it, no finished frame of the error's traceback (or of any exception reachable through
  causes and contexts, both chains followed) keeps a local alive; the frame still running (the caller's) must drop
  its own locals.
"""
from __future__ import annotations

import traceback


class BatchProgress:
    """``bar`` (a ``bridge.ProgressBar``) over ``images`` images of ``units`` units each."""

    def __init__(self, bar, images: int, units: int):
        self.bar, self.images, self.units = bar, images, units
        self.image = self.finished = 0  # images done, and their units

    def tick(self) -> None:
        self.bar.update(1)

    def restart(self, units: int) -> None:
        """The current image starts again with ``units`` units, as will every later image."""
        self.units = units
        self.bar.set(self.finished, self.finished + units * (self.images - self.image))

    def image_done(self) -> None:
        self.image += 1
        self.finished += self.units


def release_frames(exc: BaseException) -> None:
    """Drop the locals of the finished frames of ``exc``'s traceback and of its causes / contexts (device tensors,
    half-filled outputs): they would stay alive for as long as the caller holds the exception."""
    seen, pending = set(), [exc]
    while pending:  # both chains: ``raise X from saved`` inside a handler gives a cause and a different context
        exc = pending.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        pending += [exc.__cause__, exc.__context__]

"""The copy engines of a streamed forward (``streaming.BlockStreamer``): where its weight copies and packed decodes
run, and how they order against the compute stream.

Invariant: ``SyncCopier`` (the CPU, or any synchronous device) does each copy at issue time; ``CudaCopier`` runs
them on side streams forked from and joined to the compute stream through events only (no host syncs, no
allocations), so a whole forward, copies included, can be captured into a CUDA graph. The schedule and the event
protocol are ``streaming.py``'s module docstring.
"""
from __future__ import annotations

from typing import Optional

import torch

from .packed_weights import PackedUnit


class SyncCopier:
    """CPU (or any synchronous) copy engine: the same schedule, copies happen at issue time."""

    def begin(self) -> None:
        return None

    def before(self, k: int) -> None:
        return None

    def after(self, j: int) -> None:
        return None

    def copy(self, dst: torch.Tensor, src: torch.Tensor, k: int, gate: Optional[int]) -> None:
        dst.copy_(src)

    def copy_packed(self, dst: torch.Tensor, packed: PackedUnit, slot: torch.Tensor, k: int,
                    slot_user: Optional[int], gate: Optional[int]) -> None:
        slot[: packed.nbytes].copy_(packed.host.tensor)
        packed.unpack_into(slot, dst)

    def issue(self, fn) -> None:
        fn()

    def end(self) -> None:
        return None


class CudaCopier:
    """Side-stream copy engine with fork/join events (capture-safe; see the module docstring)."""

    def __init__(self, device: torch.device, n_units: int, n_streamed: int):
        self.device = device
        self.side = torch.cuda.Stream(device=device)
        # packed units decode here, at the compute stream's priority: a high-priority decode, taking multiprocessors
        # from the step's GEMMs mid-wave, measured slower end to end
        self.decode = torch.cuda.Stream(device=device)
        self.fork = torch.cuda.Event()
        self.join = torch.cuda.Event()
        self.join_decode = torch.cuda.Event()
        self.last = torch.cuda.Event()
        self.done = [torch.cuda.Event() for _ in range(n_units)]
        self.ready = [torch.cuda.Event() for _ in range(n_streamed)]
        self.copied = [torch.cuda.Event() for _ in range(n_streamed)]
        self.cur = None
        self._last_recorded = False
        cur = torch.cuda.current_stream(device)
        for ev in [self.fork, self.join, self.join_decode, self.last, *self.done, *self.ready, *self.copied]:
            ev.record(cur)  # create every CUDA event now, never during a capture
        torch.cuda.current_stream(device).synchronize()

    def begin(self) -> None:
        self.cur = torch.cuda.current_stream(self.device)
        if self._last_recorded and not torch.cuda.is_current_stream_capturing():
            self.cur.wait_event(self.last)  # a forward issued on another stream waits for the previous one
        self.fork.record(self.cur)
        self.side.wait_event(self.fork)
        self.decode.wait_event(self.fork)

    def before(self, k: int) -> None:
        self.cur.wait_event(self.ready[k])

    def after(self, j: int) -> None:
        self.done[j].record(self.cur)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, k: int, gate: Optional[int]) -> None:
        """``gate``: the unit whose ``after`` must be reached before ``dst`` is written (None: the fork)."""
        with torch.cuda.stream(self.side):
            if gate is not None:
                self.side.wait_event(self.done[gate])
            dst.copy_(src, non_blocking=True)
            self.ready[k].record(self.side)

    def copy_packed(self, dst: torch.Tensor, packed: PackedUnit, slot: torch.Tensor, k: int,
                    slot_user: Optional[int], gate: Optional[int]) -> None:
        """``slot_user``: the unit that last decoded from ``slot`` in this forward (None: its first use); ``gate``
        as in :meth:`copy`, waited for by the decode only: the packed bytes cross before ``dst`` is free."""
        with torch.cuda.stream(self.side):
            if slot_user is not None:
                self.side.wait_event(self.ready[slot_user])
            slot[: packed.nbytes].copy_(packed.host.tensor, non_blocking=True)
            self.copied[k].record(self.side)
        with torch.cuda.stream(self.decode):
            self.decode.wait_event(self.copied[k])
            if gate is not None:
                self.decode.wait_event(self.done[gate])
            packed.unpack_into(slot, dst)
            self.ready[k].record(self.decode)

    def end(self) -> None:
        if self.cur is None:  # begin never ran (or raised before it had a stream): nothing was forked
            return
        self.join.record(self.side)
        self.join_decode.record(self.decode)
        self.cur.wait_event(self.join)
        self.cur.wait_event(self.join_decode)
        self.last.record(self.cur)
        # an event recorded during a capture is not a real record outside it: only eager forwards chain on it
        self._last_recorded = not torch.cuda.is_current_stream_capturing()
        self.cur = None

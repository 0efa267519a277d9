"""The pipeline's three CUDA streams, the events that order them, and the stage timeline.

Invariants
- ``text`` and ``vae`` work runs on their own streams (one per device and stage for the life of the process,
  ``shared_streams.py``: fresh streams on every run would strand the last run's cached blocks); denoising runs on the
  caller's current stream (``unet``), which is where the sampler's CUDA graphs replay (a higher-priority ``unet`` stream
  gains nothing). A consumer never reads a tensor before the producer's event: ``hand_over`` makes the consumer stream
  wait for the event and calls ``record_stream`` so the caching allocator does not recycle the producer's memory while
  the consumer may still read it.
- ``overlap=False`` (a run under the loader's ``stream`` policy, whose VRAM budget is a hard limit): the three
  stages share the caller's stream, so they run one after the other in the order they are enqueued and each
  stage's memory is free for the next -- the stage peaks of the loader's plan then hold for the run as well.
- Off CUDA (the CPU) every stream is ``None``, every event is ``None`` and every call here is a no-op, so the
  scheduler runs the same code path sequentially.
- ``synchronize`` waits for all three streams; the scheduler calls it before returning or raising, so no
  asynchronous copy can write into a host buffer after the run has ended.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch

from ... import bridge
from ..shared_streams import shared_stream

STAGES = ("text", "unet", "vae")


class StageStreams:
    """Streams per stage (``None`` off CUDA). See the module docstring."""

    def __init__(self, device: torch.device, overlap: bool = True):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.overlap = overlap
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            self._streams = {"text": shared_stream(self.device, "text") if overlap else current, "unet": current,
                             "vae": shared_stream(self.device, "vae") if overlap else current}
        else:
            self._streams = {s: None for s in STAGES}

    def stream(self, stage: str):
        return self._streams[stage]

    def use(self, stage: str):
        """Context in which ``stage``'s stream is current (a no-op off CUDA)."""
        s = self._streams[stage]
        return torch.cuda.stream(s) if s is not None else contextlib.nullcontext()

    def record(self, stage: str, timing: bool = False):
        """An event recorded on ``stage``'s stream now (``None`` off CUDA)."""
        s = self._streams[stage]
        if s is None:
            return None
        event = torch.cuda.Event(enable_timing=timing)
        event.record(s)
        return event

    def wait_stage(self, stage: str, other: str) -> None:
        """``stage``'s stream waits for all work enqueued so far on ``other``'s."""
        s = self._streams[stage]
        if s is not None:
            s.wait_stream(self._streams[other])

    def hand_over(self, event, tensors: Iterable[Optional[torch.Tensor]], to_stage: str) -> None:
        """``to_stage`` waits for ``event`` before touching ``tensors`` (produced on another stream)."""
        s = self._streams[to_stage]
        if s is None:
            return
        if event is not None:
            s.wait_event(event)
        for t in tensors:
            if t is not None and t.device.type == "cuda":
                t.record_stream(s)

    def release_cached(self) -> None:
        """Wait for every stream's work, then return the caching allocator's free blocks to the driver."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        bridge.soft_empty_cache()

    def synchronize(self) -> None:
        for s in self._streams.values():
            if s is not None:
                s.synchronize()


def pinned_empty(shape, dtype: torch.dtype, cuda: bool) -> torch.Tensor:
    """Host memory for device-to-host copies: page-locked on CUDA (asynchronous DMA), plain on the CPU."""
    return torch.empty(shape, dtype=dtype, pin_memory=cuda)


@dataclass
class _Span:
    stage: str
    label: str
    images: tuple
    start: object
    end: object = None


@dataclass
class Timeline:
    """Start/end of every stage operation (CUDA events on the stage's stream, host clock off CUDA).

    ``to_list()`` (after the run) gives ``{stage, label, images, start_ms, end_ms}`` relative to the run's start.
    """

    streams: Optional[StageStreams] = None
    spans: list = field(default_factory=list)
    _origin: object = None

    def begin(self, streams: StageStreams) -> None:
        self.streams = streams
        self._origin = streams.record("unet", timing=True) if streams.cuda else time.perf_counter()

    def _now(self, stage: str):
        return self.streams.record(stage, timing=True) if self.streams.cuda else time.perf_counter()

    @contextlib.contextmanager
    def span(self, stage: str, label: str, images: tuple):
        item = _Span(stage, label, tuple(images), self._now(stage))
        self.spans.append(item)
        yield
        item.end = self._now(stage)

    def to_list(self) -> list[dict]:
        if self.streams is not None and self.streams.cuda:
            self.streams.synchronize()

        def ms(mark) -> Optional[float]:
            if mark is None:
                return None
            if isinstance(mark, float):
                return (mark - self._origin) * 1e3
            return self._origin.elapsed_time(mark)

        return [{"stage": s.stage, "label": s.label, "images": list(s.images), "start_ms": ms(s.start),
                 "end_ms": ms(s.end)} for s in self.spans]

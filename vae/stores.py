"""Whole-image activation stores that bands of rows are read from and written to.

Invariant: a store holds one image's activation as ``[H, W, C]`` (row-major, channels last), so any band of rows
``[lo, hi)`` is one contiguous block: it moves between host and device in a single copy, and on the device it is
viewed as ``[1, C, rows, W]`` in ``channels_last`` format (what cuDNN's fast NHWC kernels take) without a copy.

- ``DeviceStore``: the tensor sits on the compute device; reading a band is a view, writing is a device copy.
- ``HostStore``: the tensor sits in pinned host memory (page-locked, so copies are asynchronous DMA). On CUDA,
  reads run on an upload stream (``prefetch`` starts band k+1 while band k computes) and writes on a download
  stream after an event on the compute stream; ``record_stream`` keeps the caching allocator from recycling a
  band's device memory before its copy has finished. Reads of a store wait for all of its earlier writes (event).
  On the CPU the same code runs with plain copies (so tests exercise it).

Pinned host memory comes from PyTorch's caching host allocator (reused across calls).
"""
from __future__ import annotations

from typing import Optional

import torch


def band_view(hwc: torch.Tensor) -> torch.Tensor:
    """[rows, W, C] contiguous -> [1, C, rows, W] channels_last view."""
    return hwc.permute(2, 0, 1).unsqueeze(0)


def to_hwc(x: torch.Tensor) -> torch.Tensor:
    """[1, C, rows, W] (any format) -> contiguous [rows, W, C]."""
    return x[0].permute(1, 2, 0).contiguous()


class Streams:
    """The copy streams of one tiled run (``None`` members off CUDA).

    ``side=True``: uploads and downloads get their own streams, so they overlap the compute. ``side=False``: both
    are the current (compute) stream, so every band's device memory is allocated and freed on one stream and the
    caching allocator can give a freed block to any later request (side streams keep their own cached blocks,
    which a hard VRAM budget cannot afford)."""

    def __init__(self, device: torch.device, side: bool = True):
        self.device = device
        self.cuda = device.type == "cuda"
        if not self.cuda:
            self.upload = self.download = None
        elif side:
            self.upload, self.download = torch.cuda.Stream(device), torch.cuda.Stream(device)
        else:
            self.upload = self.download = torch.cuda.current_stream(device)


class BandThrottle:
    """Keeps the host at most two bands ahead of the GPU: a band's upload and download buffers are held until the
    GPU has used them, so a host that ran ahead would allocate every band's at once. Call ``band_issued`` after
    each band's work is queued; off CUDA it does nothing."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.inflight: list = []

    def band_issued(self) -> None:
        if not self.cuda:
            return
        ev = torch.cuda.Event()
        ev.record()
        self.inflight.append(ev)
        if len(self.inflight) > 1:
            self.inflight.pop(0).synchronize()


class _Ready:
    def __init__(self, tensor: torch.Tensor, event=None, stream=None):
        self.tensor, self.event, self.stream = tensor, event, stream

    def wait(self) -> torch.Tensor:
        if self.event is not None:
            current = torch.cuda.current_stream(self.tensor.device)
            current.wait_event(self.event)
            self.tensor.record_stream(current)
        return band_view(self.tensor)


class DeviceStore:
    on_device = True

    def __init__(self, h: int, w: int, c: int, dtype: torch.dtype, device: torch.device, streams: Streams):
        self.shape = (h, w, c)
        self.data = torch.empty((h, w, c), dtype=dtype, device=device)
        self.nbytes = self.data.numel() * self.data.element_size()

    def prefetch(self, lo: int, hi: int) -> _Ready:
        return _Ready(self.data[lo:hi])

    def put(self, lo: int, x: torch.Tensor) -> None:
        self.data[lo:lo + x.shape[2]].copy_(x[0].permute(1, 2, 0))

    def finish(self) -> None:
        return None

    def host_tensor(self) -> torch.Tensor:
        return self.data.cpu()


class HostStore:
    on_device = False

    def __init__(self, h: int, w: int, c: int, dtype: torch.dtype, device: torch.device, streams: Streams,
                 data: Optional[torch.Tensor] = None):
        self.shape = (h, w, c)
        self.device = device
        self.streams = streams
        if data is not None:
            self.data = data
        else:
            self.data = torch.empty((h, w, c), dtype=dtype, pin_memory=streams.cuda)
        self.nbytes = 0  # device bytes
        self._written = None  # event: all writes issued so far have landed

    def prefetch(self, lo: int, hi: int) -> _Ready:
        src = self.data[lo:hi]
        if not self.streams.cuda:
            return _Ready(src.to(self.device, copy=True))
        up = self.streams.upload
        if self._written is not None:
            up.wait_event(self._written)
        with torch.cuda.stream(up):
            t = src.to(self.device, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(up)
        return _Ready(t, ev, up)

    def put(self, lo: int, x: torch.Tensor) -> None:
        rows = self.data[lo:lo + x.shape[2]]
        if not self.streams.cuda:
            rows.copy_(x[0].permute(1, 2, 0))
            return
        hwc = to_hwc(x)
        down = self.streams.download
        down.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(down):
            rows.copy_(hwc, non_blocking=True)
        hwc.record_stream(down)

    def finish(self) -> None:
        """Mark every write issued so far; later reads wait for them."""
        if self.streams.cuda:
            self._written = torch.cuda.Event()
            self._written.record(self.streams.download)

    def host_tensor(self) -> torch.Tensor:
        if self.streams.cuda:
            self.finish()
            self._written.synchronize()
        return self.data

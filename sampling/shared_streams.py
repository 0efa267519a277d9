"""One CUDA stream per (device, role) for the life of the process.

Invariant: ``shared_stream(device, role)`` returns the same stream for the same device and role every time, and a
stream other than the device's current one.

Why not a fresh ``torch.cuda.Stream`` per run: the caching allocator keeps freed blocks per stream, and cuBLAS
keeps one workspace per stream it has run on; a fresh stream per run or per CUDA-graph capture strands the last
one's cached blocks and leaves one more workspace behind each time.
"""
from __future__ import annotations

import torch

_STREAMS: dict = {}


def shared_stream(device: torch.device, role: str) -> "torch.cuda.Stream":
    """The process-wide stream of ``role`` (e.g. ``"capture-warmup"``, ``"text"``, ``"vae"``) on ``device``."""
    device = torch.device(device)
    key = (device.index if device.index is not None else torch.cuda.current_device(), role)
    stream = _STREAMS.get(key)
    if stream is None:
        stream = _STREAMS[key] = torch.cuda.Stream(device=device)
    return stream

"""A hard cap on the device memory the caching allocator may hold, for runs under the ``stream`` policy's budget.

Invariant: inside ``allocator_cap(device, cap_bytes)`` the caching allocator of ``device`` never holds more than
``cap_bytes`` (what ``torch.cuda.memory_reserved`` counts: the CUDA context is outside it); on exit the cap the
process had before is back, also after an error.

Why: a budget kept by estimates alone bounds what is *allocated*, while what the process *holds* also has the
allocator's cached blocks, sized for earlier requests (an exact tiled decode holds about twice what it allocates
above its base). PyTorch's own ``torch.cuda.set_per_process_memory_fraction`` makes the allocator return cached
blocks to the driver and retry before it goes over the cap (an out-of-memory error only when the live tensors do
not fit), which is exactly the budget's meaning; this module only scopes it to a run and computes the fraction.
Only the native allocator honours it the same way, so under another backend (``cudaMallocAsync``) the cap is a
no-op.

``release_library_workspaces``: cuBLAS keeps one workspace per (handle, stream) it has run on, allocated from the
caching allocator and never given back (after earlier runs in the same process they can push a budgeted run over
its budget). A budgeted run starts by releasing them; cuBLAS allocates what the run's own streams need again. The
call is PyTorch's private ``torch._C._cuda_clearCublasWorkspaces``, the one its inductor CUDA-graph trees use for
the same reason; where it is missing nothing is released.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Iterable, Iterator, Optional

import torch

from .. import bridge

logger = logging.getLogger(__name__)


def _capped(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_allocator_backend() == "native"


@contextlib.contextmanager
def allocator_cap(device: torch.device, cap_bytes: int) -> Iterator[bool]:
    """Cap ``device``'s caching allocator at ``cap_bytes`` for the block (never above a cap already set).

    Yields whether a cap is in force (False on the CPU and under a non-native allocator backend)."""
    device = torch.device(device)
    if not _capped(device):
        yield False
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.mem_get_info(index)[1]
    get = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    before = float(get(index)) if get is not None else 1.0
    fraction = min(before, max(0.0, min(1.0, cap_bytes / total)))
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    logger.debug("allocator cap on cuda:%d: %.2f GiB (fraction %.4f, was %.4f)", index, cap_bytes / 2 ** 30,
                 fraction, before)
    try:
        yield True
    finally:
        torch.cuda.set_per_process_memory_fraction(before, index)


def forget_library_workspaces(device: torch.device) -> bool:
    """Drop cuBLAS's references to its per-(handle, stream) workspaces (every stream); True if dropped.

    A workspace first used inside a CUDA-graph capture is allocated from that graph's private pool and its address
    is baked into the graph; cuBLAS keeps handing the same workspace to later work on that stream. So a capture
    must start with none cached (else it bakes in a workspace that lives in another graph's pool, and replays read
    freed memory once that graph is dropped: an illegal memory access), and a
    dropped graph's pool can only go back to the driver once cuBLAS no longer references it. A workspace dropped
    here stays reserved while the graph that owns its pool lives; eager work allocates a new one from the
    ordinary pool. Waits for the device first: no kernel may still be using one."""
    device = torch.device(device)
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if device.type != "cuda" or not torch.cuda.is_available() or clear is None:
        return False
    torch.cuda.synchronize(device)
    clear()
    return True


def release_library_workspaces(device: torch.device) -> bool:
    """Give the cuBLAS workspaces of every stream back to the driver (module docstring); True if released."""
    if not forget_library_workspaces(device):
        return False
    bridge.soft_empty_cache()
    return True


def device_storage_bytes(modules: Iterable[Optional[torch.nn.Module]], tensors: Iterable[Optional[torch.Tensor]],
                         device: torch.device) -> int:
    """Bytes of the distinct storages on ``device`` behind the modules' parameters and buffers and ``tensors``
    (each storage once, however many views share it): what these objects really hold there, not an estimate."""
    device = torch.device(device)
    seen: dict[int, int] = {}

    def add(t: Optional[torch.Tensor]) -> None:
        if t is None or t.device.type != device.type or (device.index is not None and t.device.index != device.index):
            return
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()

    for m in modules:
        if m is None:
            continue
        for t in m.parameters():
            add(t)
        for t in m.buffers():
            add(t)
    for t in tensors:
        add(t)
    return sum(seen.values())

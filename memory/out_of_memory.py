"""What counts as running out of memory, on the GPU and on the CPU, and releasing what a failed attempt held.

Invariants
- ``is_out_of_memory(exc)`` is True for ``torch.OutOfMemoryError`` (CUDA's), for ``MemoryError`` and for the
  ``RuntimeError`` torch's CPU allocator raises when an allocation fails (``DefaultCPUAllocator: can't allocate
  memory`` / ``not enough memory``); False for every other error, so a real bug is never retried.
- ``release_after_out_of_memory(exc, device)`` drops the locals of the error's finished frames (device tensors of
  the failed attempt) and, on CUDA, returns the cached blocks to the driver, so the next, smaller attempt starts
  from what the process really holds.

Why: a node that degrades (smaller batch, sequential CFG, smaller tiles) must recognise an allocation failure on
the CPU too, where torch raises a plain ``RuntimeError`` rather than ``OutOfMemoryError``.
"""
from __future__ import annotations

import torch

from ..batch import release_frames

_CUDA_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
_CPU_ALLOCATOR_MESSAGES = ("DefaultCPUAllocator: can't allocate memory", "DefaultCPUAllocator: not enough memory")


def is_out_of_memory(exc: BaseException) -> bool:
    """True when ``exc`` says an allocation failed (module docstring)."""
    if isinstance(exc, (_CUDA_OOM, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _CPU_ALLOCATOR_MESSAGES)


def release_after_out_of_memory(exc: BaseException, device: torch.device) -> None:
    """Free what the failed attempt behind ``exc`` still holds (module docstring)."""
    release_frames(exc)
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()

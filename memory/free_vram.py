"""How much device memory a run may count on: the free VRAM plus this process's cached-but-unused blocks.

Invariant: ``usable_free_bytes(device)`` is ``FREE_FRACTION`` of (the driver's free memory + what the caching
allocator holds without a live tensor in it), so the loader's ``auto`` policy, the Stream Scheduler's batch size
and the VAE's tile size all read the same number. The fraction leaves room for the driver, other processes and the
allocator's fragmentation; the cached blocks count because the allocator hands them out before asking the driver.
"""
from __future__ import annotations

import torch

FREE_FRACTION = 0.9


def free_bytes(device: torch.device) -> int:
    """Free device memory plus this process's cached-but-unused blocks on ``device`` (a CUDA device)."""
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free + cached


def usable_free_bytes(device: torch.device, fraction: float = FREE_FRACTION) -> int:
    """``fraction`` (default ``FREE_FRACTION``) of ``free_bytes(device)``, in bytes."""
    return int(fraction * free_bytes(device))

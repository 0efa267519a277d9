"""Buffer pool: device buffers for latents, noise, embeddings and staging, keyed by (role, shape, dtype).

Invariants
- ``get(role, shape, dtype)`` returns *the same tensor* for the same key every time (allocated on first use), so
  a repeated run with the same shapes allocates no new device memory and keeps the same addresses (which is what a
  replayed CUDA graph needs). A role is a slot: two buffers alive at once need two roles ("cond", "uncond").
- Bounded: each role keeps its ``max_per_role`` most recently used keys (default ``DEFAULT_MAX_PER_ROLE``); a new
  shape beyond that drops the role's least recently used buffer from the pool (without the bound every image size,
  batch and prompt length ever used would stay allocated for the life of the model). A dropped buffer stays
  valid for whoever still holds it (a cached CUDA graph's program holds its own buffers).
- Contents are not cleared between uses unless ``zero=True``; callers overwrite what they take.
- ``stats()`` counts allocations; a test asserts that a second identical run adds none.
- ``release()`` drops every buffer (the engine's placement calls it when ComfyUI frees memory); buffers still
  referenced elsewhere (a captured graph, say) stay valid until their last reference goes.
- Hand-written because no library offers a keyed, address-stable device buffer cache; PyTorch's caching
  allocator reuses memory but not addresses, and its reuse is invisible to a test.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

DEFAULT_MAX_PER_ROLE = 4  # > the graph runner's default of 2 cached graphs per model (sampling/graph_runner.py)


@dataclass(frozen=True)
class PoolStats:
    buffers: int
    bytes: int
    allocations: int
    hits: int


class BufferPool:
    """Keyed, address-stable device buffers (see the module docstring)."""

    def __init__(self, device="cpu", max_per_role: int = DEFAULT_MAX_PER_ROLE):
        if isinstance(max_per_role, bool) or not isinstance(max_per_role, int) or max_per_role < 1:
            raise ValueError(f"max_per_role={max_per_role!r}: expected an int >= 1 (buffers kept per role)")
        self.device = torch.device(device)
        self.max_per_role = max_per_role
        self._buffers: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
        self._lock = threading.Lock()
        self._allocations = 0
        self._hits = 0

    @staticmethod
    def _key(role: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> tuple:
        return (role, tuple(int(s) for s in shape), dtype, str(device))

    def get(self, role: str, shape: Sequence[int], dtype: torch.dtype = torch.float32,
            device: Optional[torch.device] = None, zero: bool = False) -> torch.Tensor:
        """The buffer for (role, shape, dtype[, device]); allocated once, then the same tensor every call."""
        if not isinstance(role, str) or not role:
            raise ValueError(f"role={role!r}: expected a non-empty string naming the buffer's use")
        if any(int(s) < 0 for s in shape):
            raise ValueError(f"shape={tuple(shape)!r}: dimensions must be >= 0")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype={dtype!r}: expected a torch.dtype")
        dev = torch.device(device) if device is not None else self.device
        key = self._key(role, shape, dtype, dev)
        with self._lock:
            buf = self._buffers.get(key)
            if buf is None:
                same_role = [k for k in self._buffers if k[0] == role]  # least recently used first
                for old in same_role[:max(0, len(same_role) - self.max_per_role + 1)]:
                    del self._buffers[old]
                buf = torch.empty(key[1], dtype=dtype, device=dev)
                self._buffers[key] = buf
                self._allocations += 1
            else:
                self._buffers.move_to_end(key)
                self._hits += 1
        if zero:
            buf.zero_()
        return buf

    def like(self, role: str, tensor: torch.Tensor, copy: bool = True) -> torch.Tensor:
        """The pool buffer for ``tensor``'s shape/dtype/device under ``role``, filled with it when ``copy``."""
        buf = self.get(role, tensor.shape, tensor.dtype, tensor.device)
        if copy:
            buf.copy_(tensor)
        return buf

    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(len(self._buffers), sum(b.numel() * b.element_size() for b in self._buffers.values()),
                             self._allocations, self._hits)

    def data_ptrs(self) -> dict:
        with self._lock:
            return {k: b.data_ptr() for k, b in self._buffers.items()}

    def trim(self, roles: Optional[Sequence[str]] = None) -> None:
        """Drop the buffers of ``roles`` (all when None)."""
        with self._lock:
            for key in [k for k in self._buffers if roles is None or k[0] in roles]:
                del self._buffers[key]

    def release(self) -> None:
        self.trim(None)

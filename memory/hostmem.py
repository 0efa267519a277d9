"""Flat weight buffers: a module's parameters laid out in one byte buffer, pinned on the host, one copy to move.

Invariants
- A :class:`FlatLayout` gives every tensor an offset aligned to ``ALIGN`` bytes inside one ``uint8`` buffer; a
  parameter is then a typed view of its slice (``buffer[o:o+n].view(dtype).view(shape)``), so moving a whole
  module (or one streamed block) is a single contiguous ``copy_`` and never an allocation per tensor.
- :class:`PinnedBuffer` pins exactly ``nbytes`` of host memory with ``cudaHostRegister`` on an ordinary CPU
  tensor (PyTorch's pinned allocator rounds every request up to a power of two, which would waste up to half of
  a multi-GB weight set); the registration is dropped by ``release`` or when the buffer object dies (a weakref
  finaliser runs before the tensor is freed). Without CUDA the buffer is plain CPU memory. Pinned memory is what
  makes ``non_blocking`` host->device copies asynchronous and CUDA-graph capturable.
- :class:`ModuleSwap` keeps a module's weights in a pinned flat host buffer and moves the module to the device
  (one allocation, one copy) and back (pointer swap only, no device->host copy: weights are never mutated while
  on the device; adapters are detached before a placement's ``exit``).
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

logger = logging.getLogger(__name__)

ALIGN = 512


def align(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def tensor_bytes(t: torch.Tensor, dtype: torch.dtype | None = None) -> int:
    dtype = dtype or t.dtype
    return t.numel() * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class FlatLayout:
    """Offsets of ``count`` tensors (shapes/dtypes given) in one aligned byte buffer of ``nbytes``."""

    shapes: tuple
    dtypes: tuple
    offsets: tuple
    nbytes: int

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> "FlatLayout":
        offsets, pos, dtypes = [], 0, []
        for t in tensors:
            dt = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
            offsets.append(pos)
            dtypes.append(dt)
            pos = align(pos + tensor_bytes(t, dt))
        return cls(tuple(tuple(t.shape) for t in tensors), tuple(dtypes), tuple(offsets), max(pos, ALIGN))

    def views(self, buffer: torch.Tensor, base: int = 0) -> list[torch.Tensor]:
        out = []
        for shape, dt, off in zip(self.shapes, self.dtypes, self.offsets):
            n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dt).element_size()
            out.append(buffer[base + off: base + off + n].view(dt).view(shape))
        return out


def _cudart():
    return torch.cuda.cudart() if torch.cuda.is_available() else None


def _unregister(ptr: int) -> None:
    rt = _cudart()
    if rt is not None:
        rt.cudaHostUnregister(ptr)


class PinnedBuffer:
    """``nbytes`` of host memory, page-locked when CUDA is available (see the module docstring)."""

    def __init__(self, nbytes: int, pin: bool | None = None):
        self.nbytes = int(nbytes)
        self.tensor = torch.empty(self.nbytes, dtype=torch.uint8)
        self.pinned = False
        self._finalizer = None
        want = torch.cuda.is_available() if pin is None else pin
        if want and self.nbytes:
            rt = _cudart()
            res = rt.cudaHostRegister(self.tensor.data_ptr(), self.nbytes, 0)
            if int(res) == 0:
                self.pinned = True
                self._finalizer = weakref.finalize(self, _unregister, self.tensor.data_ptr())
            else:  # e.g. a locked-memory limit: fall back to PyTorch's pinned allocator (power-of-two rounding)
                logger.warning("cudaHostRegister of %d bytes failed (%s); using pin_memory()", self.nbytes, res)
                self.tensor = self.tensor.pin_memory()
                self.pinned = True

    def release(self) -> None:
        """Unpin (the memory stays valid as ordinary host memory while views of it exist)."""
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None


def params_of(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return list(module.named_parameters(recurse=True))


class ModuleSwap:
    """A module whose weights live in a pinned flat host buffer and visit ``device`` as one flat copy."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype, device: torch.device):
        self.module = module
        self.device = torch.device(device)
        self.params = [p for _, p in params_of(module)]
        self.layout = FlatLayout.of(self.params, dtype)
        self.host = PinnedBuffer(self.layout.nbytes, pin=self.device.type == "cuda")
        host_views = self.layout.views(self.host.tensor)
        with torch.no_grad():
            for p, v in zip(self.params, host_views):
                v.copy_(p.data)
                p.data = v
        self.host_views = host_views
        for buf_owner, name, buf in _buffers(module):
            setattr(buf_owner, name, buf.to(self.device))  # buffers (position ids, ...) are tiny: always on device
        self.device_flat = None

    @property
    def on_device(self) -> bool:
        return self.device_flat is not None or self.device.type == "cpu"

    def onload(self) -> None:
        if self.device.type == "cpu" or self.device_flat is not None:
            return
        flat = torch.empty(self.layout.nbytes, dtype=torch.uint8, device=self.device)
        flat.copy_(self.host.tensor, non_blocking=True)
        try:
            for p, v in zip(self.params, self.layout.views(flat)):
                p.data = v
        except BaseException:  # cut short (Ctrl-C): every parameter back on its host view, nothing half-moved
            for p, v in zip(self.params, self.host_views):
                p.data = v
            raise
        self.device_flat = flat

    def offload(self) -> None:
        if self.device_flat is None:
            return
        for p, v in zip(self.params, self.host_views):
            p.data = v
        self.device_flat = None

    def restore(self) -> None:
        """Leave the module on the host in plain (unpinned) memory; used when the placement is removed."""
        self.offload()
        for owner, name, buf in _buffers(self.module):
            setattr(owner, name, buf.cpu())
        self.host.release()


def _buffers(module: torch.nn.Module) -> Iterable[tuple[torch.nn.Module, str, torch.Tensor]]:
    for mod in module.modules():
        for name, buf in list(mod._buffers.items()):
            if buf is not None:
                yield mod, name, buf

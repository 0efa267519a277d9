"""A model of a device's allocated memory for CPU tests: the bytes of every tensor storage alive on one device.

``LiveBytes(device, exclude)`` is a ``TorchDispatchMode``: after every operator it adds the storages of the op's
outputs that live on ``device`` (views share their base's storage and are counted once) and drops storages that
were freed, keeping the peak of the sum. Run a model on the ``meta`` device and it counts exactly the tensors a
CUDA run would allocate through PyTorch's caching allocator (same operators, same shapes, same lifetimes in the
host program), at no compute cost, at full size. It does not see kernel workspaces (cuDNN, cuBLAS), allocator
rounding, or frees deferred by ``record_stream`` on side streams; the GPU diagnostic measures those.

Host tensors meet meta tensors in the tiled executor's pinned-memory stores: a copy from a meta tensor into a host
tensor is a no-op here, and a meta tensor brought to the host becomes zeros (the values are not the point).
Storages in ``exclude`` (the weights) are never counted.
"""
from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode


class LiveBytes(TorchDispatchMode):
    def __init__(self, device: str = "meta", exclude=()):
        super().__init__()
        self.device = device
        self.exclude = {t.untyped_storage()._cdata for t in exclude}
        self.live: dict = {}
        self.peak = 0
        self.peak_op = None

    def current(self) -> int:
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            del self.live[key]
        return sum(n for _, n in self.live.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default and args[0].device.type != self.device == args[1].device.type:
            return args[0]
        if func is torch.ops.aten._to_copy.default and args[0].device.type == self.device \
                and kwargs.get("device") is not None and torch.device(kwargs["device"]).type != self.device:
            return torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype)
        out = func(*args, **kwargs)
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type == self.device:
                st = t.untyped_storage()
                if st._cdata not in self.exclude and st._cdata not in self.live:
                    self.live[st._cdata] = (StorageWeakRef(st), st.nbytes())
        now = self.current()
        if now > self.peak:
            self.peak, self.peak_op = now, str(func)
        return out

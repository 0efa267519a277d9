"""How a kernel module picks its implementation: ``"triton"``, ``"reference"`` or ``"auto"`` (the dispatcher's
choice), from the caller's ``impl`` argument, else the module's environment variable; and whether Triton can run
on a device at all. Each kernel module holds one ``KernelChoice`` naming its environment variable.

Invariants
- An unknown value, given or from the environment, is a ValueError naming where it came from.
- ``KernelChoice.pick`` returns ``"triton"`` or ``"reference"``: a named choice wins, and ``"auto"`` is the kernel
  exactly when the module's own ``usable()`` test says it can run on the inputs.
- ``triton_unusable_reason(device)`` is None exactly when Triton can compile for that CUDA device: the ``triton``
  package imports and the device's compute capability is at least ``MIN_TRITON_CAPABILITY`` (7.0, the floor
  Triton and inductor support; on older GPUs such as Pascal's GTX 10xx inductor refuses to compile and Triton's
  code generation is unsupported). ``auto`` dispatch and ``torch.compile`` use it, so a machine without Triton
  (ComfyUI on Windows, where PyTorch's wheels do not bring it) or with an older GPU runs the plain-torch path
  instead of failing.
"""
from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch

MIN_TRITON_CAPABILITY = (7, 0)

IMPLS = ("auto", "triton", "reference")


@dataclass(frozen=True)
class KernelChoice:
    """A kernel module's implementation switch, overridable by the environment variable ``env_name``."""

    env_name: str

    def resolve(self, impl: str = "auto") -> str:
        """``impl`` unless "auto", else ``$env_name`` (read case-insensitively, blank = "auto")."""
        if impl not in IMPLS:
            raise ValueError(f"impl={impl!r}: expected one of {IMPLS}")
        if impl != "auto":
            return impl
        env = os.environ.get(self.env_name, "auto").strip().lower() or "auto"
        if env not in IMPLS:
            raise ValueError(f"{self.env_name}={env!r}: expected one of {IMPLS}")
        return env

    def pick(self, impl: str, usable: Callable[[], bool]) -> str:
        """"triton" or "reference": the resolved choice, where "auto" is "triton" exactly when ``usable()``."""
        choice = self.resolve(impl)
        if choice == "auto":
            return "triton" if usable() else "reference"
        return choice


@functools.lru_cache(maxsize=1)
def triton_importable() -> bool:
    """Whether the ``triton`` package is installed (found without importing it; looked up once)."""
    return importlib.util.find_spec("triton") is not None


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))


def triton_unusable_reason(device: torch.device) -> Optional[str]:
    """None when Triton kernels (ours and inductor's) can run on ``device``; else why not, as a sentence end."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"Triton compiles for CUDA devices only, not {device}"
    if not triton_importable():
        return ("the 'triton' package is not installed in this Python (PyTorch's CUDA wheels bring it on Linux; "
                "on Windows install 'triton-windows')")
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = _capability(index)
    if (major, minor) < MIN_TRITON_CAPABILITY:
        need = ".".join(map(str, MIN_TRITON_CAPABILITY))
        return f"{device} has CUDA compute capability {major}.{minor} and Triton needs {need} or newer"
    return None

"""Refusing, before allocating, what cannot fit in the machine's memory, with an error that names the input.

Invariants
- ``available_host_bytes()`` is what the OS says a new allocation can take without swapping: ``MemAvailable`` of
  ``/proc/meminfo`` on Linux, else ``psutil.virtual_memory().available`` when psutil is installed, else ``None``
  (unknown: nothing is refused).
- ``check_host_bytes(nbytes, input_name, what, fix)`` raises ``ValueError`` naming the input, the bytes ``what``
  needs and the bytes available, and the fix, when ``nbytes`` exceeds ``HOST_SHARE`` of what is available.
  Callers pass the bytes they are about to allocate on the host (outputs, working copies, noise draws).

Why: a LATENT or IMAGE of absurd size (a 100000 px side, a batch_index of 10**10) used to allocate first and die
after a minute with a raw allocator error that named no input, after growing the process by many GB.
"""
from __future__ import annotations

from typing import Optional

HOST_SHARE = 0.9  # what one allocation may take of the available memory; the rest keeps the process alive
GiB = 2 ** 30


def available_host_bytes() -> Optional[int]:
    """Bytes the OS can hand out now (module docstring); ``None`` when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.virtual_memory().available)


def check_host_bytes(nbytes: int, input_name: str, what: str, fix: str) -> None:
    """``ValueError`` when ``nbytes`` of host memory for ``what`` cannot fit (module docstring)."""
    available = available_host_bytes()
    if available is None or nbytes <= HOST_SHARE * available:
        return
    raise ValueError(f"{input_name}: {what} needs {nbytes / GiB:.1f} GiB of host memory, more than the "
                     f"{available / GiB:.1f} GiB available; {fix}")

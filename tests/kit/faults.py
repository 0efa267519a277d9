"""Fault injection for error-path tests: a stand-in that runs out of memory once, then runs the real function; and
a package that cannot be imported.

Invariant: the failed attempt's tensor is reachable only through a weak reference, so ``alive_at_retry`` says
whether the code under test still held the failed attempt (its exception or traceback) when it retried."""
from __future__ import annotations

import builtins
import weakref
from typing import Callable, Optional

import torch


class OutOfMemoryOnce:
    """Call it in place of ``real``: the first call allocates a tensor and raises ``torch.OutOfMemoryError``;
    each later call appends to ``alive_at_retry`` whether that tensor still exists, then returns ``real(...)``."""

    def __init__(self, real: Callable):
        self.real = real
        self.failed: Optional[weakref.ref] = None
        self.alive_at_retry: list[bool] = []

    def failed_attempt_alive(self) -> bool:
        return self.failed is not None and self.failed() is not None

    def __call__(self, *args, **kwargs):
        if self.failed is None:
            activations = torch.empty(1 << 20)
            self.failed = weakref.ref(activations)
            raise torch.OutOfMemoryError("injected: CUDA out of memory")
        self.alive_at_retry.append(self.failed_attempt_alive())
        return self.real(*args, **kwargs)


def refuse_import(monkeypatch, name: str) -> None:
    """``import name`` (and ``from name import ...``) raises ``ImportError`` for the rest of the test, as on a
    machine without that package (modules imported before keep working)."""
    real_import = builtins.__import__

    def guarded(module, *args, **kwargs):
        if module == name or module.startswith(name + "."):
            raise ImportError(f"No module named {module!r} (refused by the test)")
        return real_import(module, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", guarded)

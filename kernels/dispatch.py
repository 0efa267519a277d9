"""How a kernel module picks its implementation: ``"triton"``, ``"reference"`` or ``"auto"`` (the dispatcher's
choice), from the caller's ``impl`` argument, else the module's environment variable.

Invariant: an unknown value, given or from the environment, is a ValueError naming where it came from.
"""
from __future__ import annotations

import os

IMPLS = ("auto", "triton", "reference")


def resolve_impl(impl: str, env_name: str) -> str:
    """``impl`` unless "auto", else ``$env_name`` (default "auto")."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: expected one of {IMPLS}")
    if impl != "auto":
        return impl
    env = os.environ.get(env_name, "auto").strip().lower() or "auto"
    if env not in IMPLS:
        raise ValueError(f"{env_name}={env!r}: expected one of {IMPLS}")
    return env

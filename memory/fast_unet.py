"""What the engine's UNet runs with inside ``engine.session("unet")``: diffusers' GEGLUs in one pass.

Invariants
- Inside ``fast_unet(unet)`` every diffusers ``GEGLU`` of ``unet`` with the exact gelu (not a subclass, no
  ``forward`` of another library's in its ``__dict__``) runs ``FusedGegluForward``: ``proj(x)``, then
  ``kernels.geglu`` (one pass on CUDA; on the CPU, and for anything the kernel does not take, exactly diffusers'
  ``a * gelu(g)``). Same operations, same rounding points as diffusers' forward: bit-identical on the CPU; on the
  GPU the kernel's ``erf`` rounds the gelu of ~2% of half-precision elements one ulp from PyTorch's (the
  samplers' parity tests against diffusers bound the result).
- On exit every module is as it was: the override leaves the module's ``__dict__``. Each GEGLU has one override
  object for as long as its UNet lives (``_OVERRIDES``, keyed weakly by the UNet; the values hold only submodules),
  so a ``torch.compile``d UNet sees the same ``forward`` in every session.
- An unmerged LoRA term on a GEGLU's ``proj`` (``lora.unmerged._GegluForward``) takes the place of this override
  for as long as it is attached and puts it back when its last term goes (``is_fused_geglu``); its own forward
  fuses the same epilogue with the delta.
- Only inside the session: a diffusers pipeline that shares the module (the benchmarks' peers) runs diffusers'
  own forward outside it.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Iterator

import torch

from ..kernels.geglu import geglu


class FusedGegluForward:
    """The instance-level ``forward`` of one diffusers ``GEGLU`` inside a UNet session."""

    __slots__ = ("module", "__weakref__")

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def __call__(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        p = self.module.proj(hidden_states)
        if p.requires_grad:  # autograd: diffusers' own ops (the kernel has no backward)
            a, gate = p.chunk(2, dim=-1)
            return a * self.module.gelu(gate)
        return geglu(p)


def is_fused_geglu(forward) -> bool:
    return isinstance(forward, FusedGegluForward)


_OVERRIDES: "weakref.WeakKeyDictionary[torch.nn.Module, list]" = weakref.WeakKeyDictionary()


def _overrides(unet: torch.nn.Module) -> list[tuple[torch.nn.Module, FusedGegluForward]]:
    """``(GEGLU, its override)`` for the UNet's diffusers ``GEGLU``s with the exact gelu, found once per UNet."""
    found = _OVERRIDES.get(unet)
    if found is None:
        try:
            from diffusers.models.activations import GEGLU
        except ImportError:  # pragma: no cover - diffusers is a dependency of the pack
            GEGLU = None
        found = [(m, FusedGegluForward(m)) for m in unet.modules()
                 if GEGLU is not None and type(m) is GEGLU and getattr(m, "approximate", "none") == "none"]
        _OVERRIDES[unet] = found  # holds submodules only, never ``unet``: the entry dies with it
    return found


@contextlib.contextmanager
def fast_unet(unet: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Inside the block ``unet``'s GEGLUs run ``FusedGegluForward`` (module docstring); a GEGLU with a ``forward``
    of someone else's in its ``__dict__`` keeps it."""
    installed = []
    try:
        for m, forward in _overrides(unet):
            if "forward" not in m.__dict__:
                m.__dict__["forward"] = forward
                installed.append(m)
        yield unet
    finally:
        for m in installed:
            if is_fused_geglu(m.__dict__.get("forward")):
                del m.__dict__["forward"]

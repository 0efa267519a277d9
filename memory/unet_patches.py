"""The engine's GEGLU patches: one override object per diffusers GEGLU, with its terms (``unet_norms`` owns the
GroupNorm and resnet patches).

Invariants
- Each diffusers ``GEGLU`` with the exact gelu (that class itself, not a subclass) has one override object
  (``geglu_override``) for as long as anything holds it: the UNet's sessions (``fused_geglus``, keyed weakly by the
  UNet, holding only submodules) and the LoRA bindings with a term on its ``proj``. A ``torch.compile``d UNet so
  sees the same ``forward`` object in every session, with or without LoRA terms.
- The override's ``forward`` is ``overridden_forward`` bound to the module (one bound method per override, kept for
  its life), which finds the override under ``STATE`` in the module's ``__dict__``: every GEGLU runs the same
  function, so dynamo guards on its code, not on a per-module object, and a regionally compiled UNet reuses one
  graph for all blocks of a shape (a per-module callable gave each block its own graph: SDXL's 70 transformer
  blocks ran past dynamo's recompile limit).
- The override is the module's instance ``forward`` (in ``module.__dict__``, with ``STATE`` beside it) while a UNet
  session holds it or it carries a term, and leaves the ``__dict__`` when neither does: outside
  ``engine.session("unet")`` and without a term the module is as it was, and a diffusers pipeline sharing it runs
  diffusers' own forward. A ``forward`` that another library put in the ``__dict__`` is never replaced nor removed:
  the session leaves that GEGLU alone and ``add`` answers False (the caller then hooks the ``proj``).
- Its forward is ``p = proj(x)`` (hooks on ``proj`` included), then
  - no term: ``kernels.geglu(p)``, the one-pass ``a * gelu(g)`` (``p = [a | g]``). Same operations and rounding
    points as diffusers' forward: bit-identical on the CPU (the reference path); on the GPU the kernel's ``erf``
    may round the gelu of a few percent of half-precision elements one ulp from PyTorch's. An input that needs
    autograd takes diffusers' ops (the kernel has no backward).
  - low-rank terms ``h_i @ up_i.T`` (``h_i = down_i(x)``, ``up_i`` the strength-scaled factor): ``kernels.geglu_lora``
    computes ``(a + h @ up_a.T) * gelu(g + h @ up_g.T)`` in one pass, stacked terms fused as one rank-(sum r_i)
    term. When the input or a term's factors differ in device or dtype (a placement ran the module elsewhere), the
    projection is not contiguous, or autograd needs the graph: the plain ``p + sum_i term_i`` out of place, then
    ``a * gelu(g)``.
- Terms are duck-typed (``GegluTerm``) and read at every call, so a strength written in place into their ``up_s``
  buffers is replayed by a captured CUDA graph without a recapture. Stacked terms run in ``add`` order.
- ``torch.compile`` traces the override like plain module code (attribute reads, ``len`` of the term list, torch
  ops; the kernels' dispatchers take their reference while tracing and inductor fuses it).

Why: diffusers' GEGLU reads its [M, 2N] projection, writes the gelu and reads both again; the override reads the
projection once and writes only the [M, N] output, and a LoRA term on ``proj`` joins the same pass instead of
writing the projection back.
"""
from __future__ import annotations

import contextlib
import types
import weakref
from typing import Iterator, Optional, Protocol

import torch

from ..kernels.geglu import geglu
from ..kernels.geglu_lora import geglu_lora
from .streaming import host_copy as _streamed_host_copy


class GegluTerm(Protocol):
    """A low-rank term on a GEGLU's ``proj``: ``hidden(x) @ up_s.T``."""

    up_s: torch.Tensor  # [2N, r], the strength-scaled up factor

    def fits(self, x: torch.Tensor) -> bool:
        """Whether ``x`` is on the factors' device and dtype (the fused path's precondition)."""

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """``down(x)`` for an ``x`` that ``fits``."""

    def added(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out + term(x)`` out of place, for any placement of ``x`` and ``out``."""


STATE = "_leandiffusion_geglu"  # the override's key in its module's ``__dict__`` while installed


def _no_grad_needed(*tensors: torch.Tensor) -> bool:
    return not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors)


class GegluOverride:
    """The override of one diffusers ``GEGLU`` (module docstring): its LoRA terms, its sessions and the bound
    ``forward`` it installs (the fused GEGLU, with the terms fused into the gating)."""

    __slots__ = ("module", "terms", "attrs", "sessions", "forward", "__weakref__")

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.terms: list[GegluTerm] = []  # in ``add`` order; read-only outside this class
        self.attrs = module.__dict__  # the module's instance dict
        self.sessions = 0  # UNet sessions holding the override in place
        self.forward = types.MethodType(overridden_forward, module)  # the module's forward while installed

    # ------------------------------------------------------------------ install / remove
    def _install(self) -> bool:
        """Put the override in the module's ``__dict__``; False when another ``forward`` sits there."""
        current = self.attrs.get("forward")
        if current is None:
            self.attrs[STATE] = self
            try:
                self.attrs["forward"] = self.forward
            except BaseException:
                self.attrs.pop(STATE, None)
                raise
            return True
        return current is self.forward

    def _remove_when_idle(self) -> None:
        if len(self.terms) == 0 and self.sessions == 0 and self.attrs.get("forward") is self.forward:
            del self.attrs["forward"]
            self.attrs.pop(STATE, None)

    def _enter_session(self) -> None:
        self._install()
        self.sessions += 1

    def _exit_session(self) -> None:
        self.sessions -= 1
        self._remove_when_idle()

    def add(self, term: GegluTerm) -> bool:
        """Append ``term``, installing the override if it is not yet in place; False (nothing changed) when another
        library's ``forward`` sits in the module's ``__dict__`` (the caller hooks the ``proj`` instead)."""
        if not self._install():  # first, so a failing write leaves the term list as it was
            return False
        self.terms.append(term)
        return True

    def remove(self, term: GegluTerm) -> None:
        """Drop ``term`` (by identity, last match first; absent = no-op); without terms and outside every UNet
        session the override then leaves the module."""
        terms = self.terms
        for i in range(len(terms) - 1, -1, -1):
            if terms[i] is term:
                del terms[i]
                break
        self._remove_when_idle()

    # ------------------------------------------------------------------ the forward
    def __call__(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """What the installed ``forward`` computes (``overridden_forward``), callable without installing."""
        return _forward(self.module, self.terms, hidden_states)


def overridden_forward(module: torch.nn.Module, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The instance ``forward`` of every overridden GEGLU (bound to it; module docstring): the fused GEGLU, with
    the LoRA terms attached to its ``proj`` fused into the gating."""
    return _forward(module, module.__dict__[STATE].terms, hidden_states)


def _forward(m: torch.nn.Module, terms: list, hidden_states: torch.Tensor) -> torch.Tensor:
    p = m.proj(hidden_states)  # the proj carries none of these terms; hooks of hook-path bindings included
    if len(terms) == 0:  # ``len``: dynamo refuses ``bool(list)`` on some versions
        if p.requires_grad:  # autograd: diffusers' own ops (the kernel has no backward)
            a, gate = p.chunk(2, dim=-1)
            return a * m.gelu(gate)
        return geglu(p)
    return _with_terms(m, hidden_states, p, terms)


def _with_terms(m: torch.nn.Module, x: torch.Tensor, p: torch.Tensor, terms: list) -> torch.Tensor:
    fast = (p.dtype == x.dtype and p.device == x.device and all(t.fits(x) for t in terms)
            and p.is_contiguous() and _no_grad_needed(x, p))
    if not fast:
        for t in terms:
            p = t.added(x, p)
        a, gate = p.chunk(2, dim=-1)
        return a * m.gelu(gate)
    hs = [t.hidden(x) for t in terms]
    hs = [h.reshape(-1, h.shape[-1]) for h in hs]
    if len(terms) == 1:
        h, up = hs[0], terms[0].up_s
    else:  # stacked terms: one rank-(sum r_i) term
        h, up = torch.cat(hs, dim=1), torch.cat([t.up_s for t in terms], dim=1)
    out = geglu_lora(p.reshape(-1, p.shape[-1]), h, up)
    return out.view(*p.shape[:-1], out.shape[-1])


# ---------------------------------------------------------------------------------------------- registries
_BY_MODULE: "weakref.WeakValueDictionary[int, GegluOverride]" = weakref.WeakValueDictionary()
_BY_UNET: "weakref.WeakKeyDictionary[torch.nn.Module, list[GegluOverride]]" = weakref.WeakKeyDictionary()


def _fusable(module: torch.nn.Module) -> bool:
    """A diffusers ``GEGLU`` (the class itself) with the exact gelu: what the fused kernels compute."""
    try:
        from diffusers.models.activations import GEGLU
    except ImportError:  # pragma: no cover - diffusers is a dependency of the pack
        return False
    return type(module) is GEGLU and getattr(module, "approximate", "none") == "none"


def geglu_override(module: torch.nn.Module) -> Optional[GegluOverride]:
    """The one override object of ``module`` when it is a diffusers ``GEGLU`` with the exact gelu, else None.
    While the object lives it holds the module, so its ``id`` key cannot be reused."""
    if not _fusable(module):
        return None
    override = _BY_MODULE.get(id(module))
    if override is None or override.module is not module:
        override = GegluOverride(module)
        _BY_MODULE[id(module)] = override
    return override


def _unet_overrides(unet: torch.nn.Module) -> list[GegluOverride]:
    """The overrides of ``unet``'s fusable GEGLUs, found once per UNet and kept for its life."""
    found = _BY_UNET.get(unet)
    if found is None:
        found = [ov for m in unet.modules() if (ov := geglu_override(m)) is not None]
        _BY_UNET[unet] = found  # holds submodules only, never ``unet``: the entry dies with it
    return found


@contextlib.contextmanager
def fused_geglus(unet: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Inside the block ``unet``'s fusable GEGLUs run their override (module docstring); sessions nest."""
    held = []
    try:
        for override in _unet_overrides(unet):
            override._enter_session()
            held.append(override)
        yield unet
    finally:
        for override in held:
            override._exit_session()


def host_copy(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The pinned host tensor holding a streamed parameter's values, else None. A streamed parameter's device
    tensor is a staging slot holding its values only inside its block's forward: code that reads a UNet weight
    outside a forward (a DoRA gain) reads this copy instead."""
    return _streamed_host_copy(param)

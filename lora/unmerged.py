"""Unmerged LoRA: ``y = W x + b + strength * up(down(x))`` computed at forward time, base weights never written.

Two injection strategies (``STRATEGIES``; chosen per binding by ``inject_lora(strategy=...)``, else
``$LEANDIFFUSION_LORA_STRATEGY`` = ``hook`` | ``geglu`` | ``auto``, else ``DEFAULT_STRATEGY`` = ``geglu``; part of
the binding key, hence of ``graph_key``):

- ``hook``: a forward hook per module adds the term after the base op (``lowrank_terms``). At strength 0 the base
  op runs untouched and the term adds exact zeros, so the output is the base bit-for-bit.
- ``geglu`` (default): the same hooks on every layer, except the ``proj`` of a diffusers ``GEGLU`` (``ff.net.0``):
  its term goes to the GEGLU's one override (``memory.unet_patches``), which computes
  ``(a + h @ up_a.T) * gelu(g + h @ up_g.T)`` in one pass (``p = [a | g]``) instead of a hook re-reading and
  re-writing the widest output of the block (the [M, 2N] projection) and the GEGLU reading it again; ``proj`` gets
  no term (no double count). At strength 0 it is the base bit-for-bit on the CPU (the reference path); on the GPU
  the kernel's fp32 gelu may round differently from torch's by an fp16 ulp.

Why only these two: the gain over ``hook`` is the fused GEGLU epilogue; pre-adding every Linear's term into its base
GEMM adds nothing to it and breaks strength-0 exactness on the GPU (the base GEMM then takes another cuBLAS path).

The hook path is the fallback wherever the GEGLU override does not apply: a GEGLU with the tanh approximation or
a subclass, a ``proj`` found without ``roots``, a GEGLU whose ``forward`` another library already overrides.

LyCORIS terms (LoHa, LoKr) come from ``fullrank.make_term`` and always use the hook path. A DoRA layer (any kind)
gets its module's instance ``forward`` (``dora_forward.DoraForward``; the dense ``fullrank`` hook where that cannot
sit); its gain is refreshed at attach when the weight changed, and its buffers are written with the strength (one
of them ``strength * source + 1``: ``_plus_one``); under ``geglu`` a DoRA on a GEGLU ``proj`` hands its low-rank
term to the GEGLU's override (``DoraForward.fuse_into``). Only plain LoRA layers (``fullrank.lowrank_factors``) get
the shared downs (``lowrank_terms.SharedDown``).

Invariants
- Base weights are never written. ``detach`` removes exactly what ``attach`` installed: hooks by their reserved
  id (one dict insert / pop per module, no ``register_forward_hook`` call), GEGLU terms from the GEGLU's one
  override object, which leaves ``module.__dict__`` when its last term goes outside a UNet session, so the module
  is left bit-for-bit as before (no ``forward`` key, hook dicts as they were). An attach failing midway undoes what
  it installed.
- Stacking: every binding with a term on one GEGLU's ``proj`` shares that GEGLU's override object, which holds the
  ordered list of active terms; each binding appends / removes its own (stacked terms are fused as one
  rank-(sum r_i) term). Hooks of several bindings run in registration order.
- Strength is data, not structure (``strength_buffers``): each layer owns a persistent buffer ``up_s = strength *
  up`` (``up`` already carries ``alpha / rank``; a ``fullrank`` term's buffer is its own strength-scaled factor);
  ``attach`` rewrites those buffers in place only when the strength changed: zero them, then
  ``buf += strength * up`` in one multi-tensor kernel, no allocation. A CUDA graph captured while the binding was
  attached reads ``up_s`` on replay, so a strength change costs the rewrite, never a recapture.
- No Python-side tensor creation in any forward (nothing host->device: capture safe). Siblings reading one input
  (``to_q/to_k/to_v``...) share one ``down`` GEMM.
- Strength writes happen at attach, never inside a CUDA-graph capture (``refuse_inside_capture`` raises). The
  sampler enters the session, then captures.
- ``torch.compile`` traces the GEGLU override like the hooks (plain attribute reads and torch ops; the shared-down
  cache and the Triton dispatch are bypassed while compiling: inductor fuses the reference math itself).

Why hand-written: PEFT's LoRA layers replace modules (``W x + up(down(x))`` as a separate GEMM pair plus an add,
the same traffic as ``hook``, and a changed model structure); no library fuses the low-rank term into GEGLU, and
none keeps strength in capture-stable device buffers.

A binding is shared by every view of the same (loaded LoRA, targets, strategy); the views differ only in the
strength written at attach. Two views of one binding cannot be attached at the same time with different strengths
(ComfyUI runs nodes one at a time; a nested attach with the same strength is counted and allowed).
"""
from __future__ import annotations

import os
from dataclasses import replace
from typing import Iterable, Optional

import torch
from torch.utils.hooks import RemovableHandle

from ..memory.unet_patches import GegluOverride, geglu_override
from .binding import RefCountedBinding
from .dora_forward import DoraForward
from .formats import LoraLayer
from .fullrank import lowrank_factors, make_term
from .keymap import Target
from .lowrank_terms import ConvTerm, LinearTerm, SharedDown, share_downs
from .strength_buffers import BufferArena, refuse_inside_capture

STRATEGIES = ("hook", "geglu")
DEFAULT_STRATEGY = "geglu"
ENV_STRATEGY = "LEANDIFFUSION_LORA_STRATEGY"


def resolve_strategy(strategy: str = "auto") -> str:
    """``strategy`` unless "auto", else ``$LEANDIFFUSION_LORA_STRATEGY``, else ``DEFAULT_STRATEGY``."""
    if strategy not in STRATEGIES + ("auto",):
        raise ValueError(f"strategy={strategy!r}: expected one of {', '.join(STRATEGIES + ('auto',))}")
    if strategy != "auto":
        return strategy
    env = os.environ.get(ENV_STRATEGY, "").strip().lower() or "auto"
    if env not in STRATEGIES + ("auto",):
        raise ValueError(f"{ENV_STRATEGY}={env!r}: expected one of {', '.join(STRATEGIES + ('auto',))}")
    return DEFAULT_STRATEGY if env == "auto" else env


def _shaped(target: Target, tensor: torch.Tensor) -> torch.Tensor:
    """View a factor in the layout the module's op expects (2-D for Linear, 4-D for conv)."""
    if isinstance(target.module, torch.nn.Linear):
        return tensor.reshape(tensor.shape[0], tensor.shape[1])
    if tensor.ndim == 2:
        return tensor.reshape(tensor.shape[0], tensor.shape[1], 1, 1)
    return tensor


def _geglu_of(target: Target, roots) -> Optional[GegluOverride]:
    """The override of the diffusers ``GEGLU`` (exact gelu) whose ``proj`` is ``target``'s module, else None."""
    if roots is None or not target.module_name.endswith(".proj") or roots.get(target.component) is None:
        return None
    parent = roots[target.component].get_submodule(target.module_name[:-len(".proj")])
    if getattr(parent, "proj", None) is not target.module:
        return None
    return geglu_override(parent)


class UnmergedBinding(RefCountedBinding):
    """A loaded LoRA bound to a model's modules, injected per ``strategy``. See the module docstring."""

    mode = "unmerged"

    def __init__(self, key: tuple, targets: Iterable[Target], label: str = "", strategy: str = "auto",
                 roots: "dict[str, torch.nn.Module] | None" = None):
        """``roots`` (component -> root module) lets ``geglu`` find GEGLU parents; without it every layer hooks."""
        self.key = key
        self.label = label
        self.strategy = resolve_strategy(strategy)
        self.targets = list(targets)
        self.components = sorted({t.component for t in self.targets})
        # per component: (hook dict, reserved hook id, term, override or None) per target; strength sources and
        # their buffers; DoRA forwards; buffers holding strength * source + 1
        self._slots, self._up, self._up_s, self._dora, self._plus_one = (
            {c: [] for c in self.components} for _ in range(5))
        lowrank = {id(t): f for t in self.targets if (f := lowrank_factors(t)) is not None}
        shared = share_downs(self.targets, {i: f[0] for i, f in lowrank.items()})
        self._shared: list[SharedDown] = list({id(g): g for g, _ in shared.values()}.values())
        self._arenas = {c: BufferArena(lowrank[id(t)][1] for t in self.targets
                                       if t.component == c and id(t) in lowrank)
                        for c in self.components}
        geglu_roots = roots if self.strategy == "geglu" else None
        for t in self.targets:
            if t.layer.magnitude is not None:
                term, up, up_s, override = self._dora_slot(t, geglu_roots)
            elif id(t) not in lowrank:  # LoHa, LoKr (``fullrank``): always a hook
                (term, up, up_s), override = make_term(t), None
            else:
                term, up, up_s, override = self._lowrank_slot(t, lowrank[id(t)], shared, geglu_roots)
            # A hook id reserved once per (binding, module) for the hook path (also an override's fallback): attach
            # is one dict insert per module, detach one pop, never a ``register_forward_hook`` call.
            slot = RemovableHandle(t.module._forward_hooks)
            self._slots[t.component].append((t.module._forward_hooks, slot.id, term, override))
            self._up[t.component].append(up)
            self._up_s[t.component].append(up_s)
        self._plan_rewrites()
        self._init_refcounts(self.components)

    def _dora_slot(self, t: Target, geglu_roots) -> tuple:
        """``(dense fallback hook, source, buffer, DoraForward)`` of a DoRA layer; its own buffers are recorded."""
        term, up, up_s = make_term(t)
        inner = None
        if not isinstance(t.layer, LoraLayer):  # LoHa / LoKr: their own term, run on g * x
            inner, inner_src, inner_buf = make_term(replace(t, layer=replace(t.layer, magnitude=None)))
            self._up[t.component].append(inner_src)
            self._up_s[t.component].append(inner_buf)
        override = DoraForward(t, inner)
        if override.folded:  # a plain LoRA term over the g-folded factors
            override.inner = (LinearTerm(override.down, override.up_s) if isinstance(t.module, torch.nn.Linear)
                              else ConvTerm(override.down, override.up_s, t.module))
            geglu = _geglu_of(t, geglu_roots)
            if geglu is not None:  # its low-rank term goes into the GEGLU's fused gating
                override.fuse_into(geglu)
        self._dora[t.component].append(override)
        for src, buf in override.strength_pairs():
            self._up[t.component].append(src)
            self._up_s[t.component].append(buf)
        self._plus_one[t.component] += override.plus_one()
        return term, up, up_s, override

    def _lowrank_slot(self, t: Target, factors: tuple, shared: dict, geglu_roots) -> tuple:
        """``(term, source, buffer, GEGLU override or None)`` of a plain LoRA layer."""
        down, up = _shaped(t, factors[0]), _shaped(t, factors[1])
        up_s = self._arenas[t.component].take(up)  # persistent strength-scaled buffer (written at attach)
        if not isinstance(t.module, torch.nn.Linear):
            return ConvTerm(down, up_s, t.module), up, up_s, None
        group, rows = shared.get(id(t), (None, slice(None)))
        term = LinearTerm(group.down[rows] if group is not None else down, up_s, group, rows)
        return term, up, up_s, _geglu_of(t, geglu_roots)

    def _plan_rewrites(self) -> None:
        """Per component, the (buffers, sources) of one multi-tensor add: the arena's spans, then the buffers
        outside it (fullrank and DoRA: zeroed one by one, ``_loose``)."""
        self._rewrite: dict[str, tuple[list, list]] = {}
        self._loose: dict[str, list[torch.Tensor]] = {}
        for c in self.components:
            loose = [(b, u) for b, u in zip(self._up_s[c], self._up[c]) if not self._arenas[c].holds(b)]
            self._loose[c] = [b for b, _ in loose]
            dst, src = self._arenas[c].spans()
            self._rewrite[c] = (dst + self._loose[c], src + [u for _, u in loose])
        # buffers start zeroed: strength 0 is written, unless a buffer holds strength * source + 1
        self._written: dict[str, "float | None"] = {c: None if self._plus_one[c] else 0.0 for c in self.components}

    def write_strength(self, component: str, strength: float) -> None:
        """Set ``up_s = strength * up`` for ``component`` in place (skipped when already written)."""
        if self._written.get(component) == strength:
            return
        refuse_inside_capture(self.label, component)
        self._arenas[component].zero_()
        if self._loose[component]:
            torch._foreach_zero_(self._loose[component])
        if strength != 0.0:
            torch._foreach_add_(*self._rewrite[component], alpha=float(strength))
        if self._plus_one.get(component):
            torch._foreach_add_(self._plus_one[component], 1.0)
        self._written[component] = strength

    def installed(self, comp: str) -> list[str]:
        """Where each term of ``comp`` sits now ("hook" | "override" | "off"), in target order (for tests)."""
        out = []
        for hooks, hook_id, term, override in self._slots[comp]:
            if hooks.get(hook_id) is term:
                out.append("hook")
            elif override is not None and any(t is term for t in override.terms):
                out.append("override")
            else:
                out.append("off")
        return out

    def _activate(self, comp: str, strength: float) -> None:
        if self._written.get(comp) != strength:
            refuse_inside_capture(self.label, comp)
        try:
            for hooks, hook_id, term, override in self._slots[comp]:
                if override is None or not override.add(term):
                    hooks[hook_id] = term  # the hook path, or the fallback when another forward sits on the module
            # a DoRA gain follows the weight it normalises (recomputed only when that changed); then the buffers
            # derived from it are rewritten with the strength
            if any([ov.refresh_gain() for ov in self._dora.get(comp, ()) if ov.active]):
                self._written[comp] = None
            self.write_strength(comp, strength)
        except BaseException:
            self._deactivate(comp)
            raise

    def _deactivate(self, comp: str) -> None:
        for hooks, hook_id, term, override in self._slots[comp]:
            if hooks.pop(hook_id, None) is None and override is not None:
                override.remove(term)
        for group in self._shared:
            group.clear()

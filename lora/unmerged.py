"""Unmerged LoRA: ``y = W x + b + strength * up(down(x))`` computed at forward time, base weights never written.

Two injection strategies (``STRATEGIES``; chosen per binding by ``inject_lora(strategy=...)``, else
``$LEANDIFFUSION_LORA_STRATEGY`` = ``hook`` | ``geglu`` | ``auto``, else ``DEFAULT_STRATEGY`` = ``geglu``; part of
the binding key, hence of ``graph_key``):

- ``hook``: a forward hook per module adds the term after the base op: ``out.addmm_(down(x), up_s.T)``. At
  strength 0 the base op runs untouched and the term adds exact zeros, so the output is the base bit-for-bit.
- ``geglu`` (default): the same hooks on every layer, except the ``proj`` of a diffusers ``GEGLU`` (``ff.net.0``):
  its term goes into the GEGLU (an instance-level ``forward``, ``_GegluForward``): ``p = proj(x)`` without this
  term, then ``kernels.geglu_lora`` computes ``(a + h @ up_a.T) * gelu(g + h @ up_g.T)`` in one pass
  (``p = [a | g]``), instead of a hook re-reading and re-writing the widest output of the block (the [M, 2N]
  projection) and the GEGLU reading it again; ``proj`` gets no term (no double count). At strength 0 it is the
  base bit-for-bit on the CPU (the reference path); on the GPU the kernel's fp32 gelu may round differently from
  torch's by an fp16 ulp.

Why these two (H200, SDXL 1024x1024 fp16, rank-32 LoRA on the 700 attention + feed-forward Linears, one UNet call
replayed from a CUDA graph; no LoRA 41.78 ms): ``hook`` 50.07 ms; ``geglu`` (then named ``preadd_geglu``) 44.98 ms,
+7.7%. A third strategy that pre-added every Linear's term into the base GEMM's ``beta=1`` epilogue (an instance
``forward`` per Linear) measured 49.84 ms alone, and post-hooks + fused GEGLU vs pre-add + fused GEGLU measured
46.7 vs 47.0 ms: nothing measurable, so it was removed; it also broke strength-0 exactness on the GPU (the base
GEMM then takes another cuBLAS path). The whole gain is the fused GEGLU epilogue.

The hook path is the fallback wherever the GEGLU override does not apply: a GEGLU with the tanh approximation or
a subclass, a ``proj`` found without ``roots``, a GEGLU whose ``forward`` another library already overrides. At
call time the override computes the plain ``proj(x) + terms``, then ``a * gelu(g)`` (out of place), when the
input or LoRA factors differ in device/dtype (a placement ran the module elsewhere) or autograd needs the graph.

LyCORIS terms (LoHa, LoKr) come from ``fullrank.make_term`` and always use the hook path. A DoRA layer (any kind)
gets its module's instance ``forward`` (``dora_forward.DoraForward``; the dense ``fullrank`` hook where that cannot
sit); its gain is refreshed at attach when the weight changed, and its buffers are written with the strength (one
of them ``strength * source + 1``: ``_plus_one``); under ``geglu`` a DoRA on a GEGLU ``proj`` hands its low-rank
term to the GEGLU's override (``DoraForward.fuse_into``). Only plain LoRA layers (``fullrank.lowrank_factors``) get
the shared downs described here.

Invariants
- Base weights are never written. ``detach`` removes exactly what ``attach`` installed: hooks by their reserved
  id (one dict insert / pop per module, no ``register_forward_hook`` call, ~2 us each), GEGLU terms from the
  GEGLU's one override object; the override leaves ``module.__dict__`` when its last term goes, so the module is
  left bit-for-bit as before (no ``forward`` key, hook dicts as they were). An attach failing midway undoes what
  it installed.
- Stacking: one override object per GEGLU (``_geglu_forward_for``, shared by every binding through a weak
  registry) holds the ordered list of active terms; each binding appends / removes its own (stacked terms are
  fused as one rank-(sum r_i) term). Hooks of several bindings run in registration order.
- Strength is data, not structure. Each layer owns a persistent buffer ``up_s = strength * up`` (``up`` already
  carries ``alpha / rank``; a ``fullrank`` term's buffer is its own strength-scaled factor); ``attach`` rewrites
  those buffers in place only when the strength changed: zero them, then ``buf += strength * up`` in one
  multi-tensor kernel (``_foreach_add_``; ``0 + s * up`` rounds exactly as ``s * up``), no allocation. The plain
  layers' buffers of a component are consecutive views of one flat tensor per device and dtype (``_BufferArena``),
  so zeroing them is one kernel, and since the loader packs their sources the same way (``loader.to_device``) the
  add runs over a few long spans, not one entry per layer. H100, rank-32 SDXL LoRA (700 buffers, 86 MB),
  ``scripts/diag/lora_switch_cost.py``, one run (session 26): copy + multiply over the 700 buffers 0.76 ms, zero +
  add over the 700 pairs 0.54 ms, zero + add over the one span 0.17 ms. A CUDA graph captured while the binding
  was attached reads ``up_s`` on replay, so a strength change costs the rewrite, never a recapture, recompile or
  base-weight copy.
- No Python-side tensor creation in any forward (nothing host->device: capture safe). Siblings reading one input
  (``to_q/to_k/to_v``...) share one ``down`` GEMM (``_SharedDown``).
- Strength writes happen at attach, never inside a CUDA-graph capture (``refuse_inside_capture`` raises): a
  write captured into a graph would replay the old value. The sampler enters the session, then captures.
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

import logging
import os
import weakref
from dataclasses import replace
from typing import Iterable

import torch
import torch.nn.functional as F
from torch.utils.hooks import RemovableHandle

from ..kernels.geglu_lora import geglu_lora
from ..memory.fast_unet import is_fused_geglu
from .binding import RefCountedBinding
from .dora_forward import DoraForward
from .formats import LoraLayer
from .fullrank import can_add_in_place, lowrank_factors, make_term
from .keymap import Target

logger = logging.getLogger(__name__)

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


def _shaped(target: Target, tensor: torch.Tensor, role: str) -> torch.Tensor:
    """View a factor in the layout the module's op expects (2-D for Linear, 4-D for conv)."""
    if isinstance(target.module, torch.nn.Linear):
        return tensor.reshape(tensor.shape[0], tensor.shape[1])
    if tensor.ndim == 2:
        return tensor.reshape(tensor.shape[0], tensor.shape[1], 1, 1)
    return tensor


def refuse_inside_capture(label: str, component: str) -> None:
    """Strength writes are kernels with the value baked in: inside a CUDA-graph capture they would be recorded
    and re-run on every replay with the old value. Sessions must be entered before capturing (as the sampler does)."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"LoRA {label!r}: cannot write the {component} strength while a CUDA graph is being "
                           f"captured; enter the view's session('unet') before capturing and capture inside it")


class _SharedDown:
    """The concatenated down factors of sibling Linears that read the same input (``to_q/to_k/to_v`` of a
    self-attention, ``to_k/to_v`` of a cross-attention, ``q_proj/k_proj/v_proj`` of CLIP): one GEMM
    ``H = x @ cat(down_i).T`` replaces one GEMM per sibling; member ``i`` reads its column slice of ``H``.

    The first member (``rows.start == 0``) always computes ``H`` and remembers ``x`` (identity); a later member
    called with the same tensor object reuses ``H``, one called with another tensor recomputes (so a sibling fed a
    different input, e.g. ``to_q`` of a cross-attention, is still exact). The cache is dropped after the last
    sibling read it (no tensor outlives the attention call; a model calling the siblings out of order only loses
    the sharing), at detach, and is never used while ``torch.compile`` traces (a plain per-member GEMM then).
    A forward that raised between two siblings leaves its ``H`` behind; the next forward never reads it, because
    its first member recomputes: identity alone would not do, since a cross-attention's ``to_k``/``to_v`` read the
    sampler's static context buffer, the same tensor object on the next forward with other contents.
    """

    __slots__ = ("down", "size", "x", "h", "__weakref__")

    def __init__(self, down: torch.Tensor):
        self.down, self.size = down, 0
        self.x = self.h = None

    def get(self, x: torch.Tensor, rows: slice) -> torch.Tensor:
        if rows.start == 0 or self.x is not x:  # the first member: a cached H is a failed forward's leftover
            self.x, self.h = x, F.linear(x, self.down)
        h = self.h[..., rows]
        if rows.stop == self.down.shape[0]:  # the last sibling (modules call them in order): drop the cache
            self.x = self.h = None
        return h

    def clear(self) -> None:
        self.x = self.h = None


class _LinearTerm:
    """One LoRA term of one Linear: ``down(x) @ up_s.T`` (``down(x)`` possibly shared with its siblings). Used as
    the forward hook itself, or (a GEGLU ``proj`` under ``geglu``) as a term of the GEGLU's override."""

    __slots__ = ("down", "up_s", "shared", "rows", "__weakref__")

    def __init__(self, down: torch.Tensor, up_s: torch.Tensor, shared: "_SharedDown | None" = None,
                 rows: slice = slice(None)):
        self.down, self.up_s, self.shared, self.rows = down, up_s, shared, rows

    def fits(self, x: torch.Tensor) -> bool:
        """True when ``x`` is on the factors' device and dtype (the fast paths' precondition)."""
        return x.dtype == self.up_s.dtype and x.device == self.up_s.device

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """``down(x)`` for an ``x`` that ``fits``."""
        if self.shared is not None and not torch.compiler.is_compiling():
            return self.shared.get(x, self.rows)
        return F.linear(x, self.down)

    def added(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out + term`` out of place, for any placement of ``x``/``out``."""
        if not self.fits(x):  # a placement ran this module elsewhere
            h = F.linear(x.to(self.down.device, self.down.dtype), self.down)
            return out + F.linear(h, self.up_s).to(out.device, out.dtype)
        return out + F.linear(self.hidden(x), self.up_s)

    def __call__(self, module, args, output):  # forward hook
        x = args[0]
        if not self.fits(x):
            return self.added(x, output)
        h = self.hidden(x)
        if can_add_in_place(output, self.up_s.dtype):
            output.view(-1, output.shape[-1]).addmm_(h.reshape(-1, h.shape[-1]), self.up_s.t())
            return None
        return output + F.linear(h, self.up_s)


def _no_grad_needed(*tensors: torch.Tensor) -> bool:
    return not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors)


class _GegluForward:
    """The one instance-level ``forward`` of a diffusers ``GEGLU`` (in ``module.__dict__``) while any binding has a
    term on its ``proj``: ``GEGLU.forward`` with those terms fused into the gating (``kernels.geglu_lora``).

    Installed with the first term, removed with the last; a ``forward`` that another library put in the module's
    ``__dict__`` is never replaced (that binding hooks the ``proj`` instead) nor removed. The engine's own one-pass
    GEGLU (``memory.fast_unet``, inside a UNet session) is the exception: this override takes its place and the
    last term puts it back (the same epilogue, now with the delta)."""

    __slots__ = ("module", "terms", "attrs", "replaced", "__weakref__")

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.terms: list[_LinearTerm] = []
        self.attrs = module.__dict__  # the module's instance dict
        self.replaced = None  # the engine's fused forward this override stands in for, put back with the last term

    def add(self, term: _LinearTerm) -> bool:
        """Append ``term``, installing the override with the first one; False (nothing changed) when another
        ``forward`` (not the engine's fused one) sits in the module's ``__dict__`` (the caller hooks the ``proj``
        instead)."""
        attrs = self.attrs
        if not self.terms:
            current = attrs.get("forward")
            if current is not None and not is_fused_geglu(current):
                return False
            attrs["forward"] = self  # first, so a failing write leaves the term list empty
            self.replaced = current
        elif attrs.get("forward") is not self:
            return False
        self.terms.append(term)
        return True

    def remove(self, term: _LinearTerm) -> None:
        """Drop ``term`` (by identity, last match first; absent = no-op); the last one removes the override from
        the module, putting back the forward it replaced."""
        terms = self.terms
        for i in range(len(terms) - 1, -1, -1):
            if terms[i] is term:
                del terms[i]
                break
        if not terms and self.attrs.get("forward") is self:
            if self.replaced is not None:
                self.attrs["forward"] = self.replaced
            else:
                del self.attrs["forward"]
            self.replaced = None

    def __call__(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        m = self.module
        x = hidden_states
        p = m.proj(x)  # without these terms (the proj carries none of them); hooks of hook-path bindings included
        terms = self.terms
        fast = (len(terms) > 0 and p.dtype == x.dtype and p.device == x.device and all(t.fits(x) for t in terms)
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
        else:  # stacked LoRAs: one rank-(sum r_i) term
            h, up = torch.cat(hs, dim=1), torch.cat([t.up_s for t in terms], dim=1)
        out = geglu_lora(p.reshape(-1, p.shape[-1]), h, up)
        return out.view(*p.shape[:-1], out.shape[-1])


_GEGLU_FORWARDS: "weakref.WeakValueDictionary[int, _GegluForward]" = weakref.WeakValueDictionary()


def _geglu_forward_for(module: torch.nn.Module) -> _GegluForward:
    """The GEGLU's one override object, shared by every binding (kept alive by the bindings that use it; it holds
    the module, so the ``id`` key cannot be reused while the entry lives)."""
    ov = _GEGLU_FORWARDS.get(id(module))
    if ov is None or ov.module is not module:
        ov = _GegluForward(module)
        _GEGLU_FORWARDS[id(module)] = ov
    return ov


def _geglu_parent(target: Target, roots) -> "torch.nn.Module | None":
    """The diffusers ``GEGLU`` (exact gelu) whose ``proj`` is ``target``'s module, else None."""
    if roots is None or not target.module_name.endswith(".proj") or roots.get(target.component) is None:
        return None
    try:
        from diffusers.models.activations import GEGLU
    except ImportError:  # pragma: no cover - diffusers is a dependency of the pack
        return None
    parent = roots[target.component].get_submodule(target.module_name[:-len(".proj")])
    if type(parent) is GEGLU and parent.proj is target.module and getattr(parent, "approximate", "none") == "none":
        return parent
    return None


class _ConvLoraHook:
    """Forward hook of one Conv2d: ``out += conv1x1(conv_kxk(x, down), up_s)`` (the base conv's geometry)."""

    __slots__ = ("down", "up_s", "stride", "padding", "dilation", "__weakref__")

    def __init__(self, down: torch.Tensor, up_s: torch.Tensor, module: torch.nn.Conv2d):
        self.down, self.up_s = down, up_s
        self.stride, self.padding, self.dilation = module.stride, module.padding, module.dilation

    def __call__(self, module, args, output):
        x = args[0]
        down, up_s = self.down, self.up_s
        foreign = x.device != down.device or x.dtype != down.dtype
        xin = x.to(down.device, down.dtype) if foreign else x
        delta = F.conv2d(F.conv2d(xin, down, None, self.stride, self.padding, self.dilation), up_s)
        if not foreign and can_add_in_place(output, up_s.dtype):
            output.add_(delta)
            return None
        return output + delta.to(output.device, output.dtype)


SIBLINGS = (("to_q", "to_k", "to_v"), ("q_proj", "k_proj", "v_proj"))


def _share_downs(targets: list[Target], downs: dict[int, torch.Tensor]) -> dict[int, tuple[_SharedDown, slice]]:
    """``id(target) -> (shared down, its rows)`` for Linear siblings (``SIBLINGS``) of one parent with the same
    input width, dtype and device, among the targets with a low-rank ``downs[id(target)]``; targets without a
    sibling are absent. The concatenated factor is a new tensor (the loaded factors are left as they are); each
    member's ``down`` becomes a row view of it."""
    buckets: dict[tuple, list[Target]] = {}
    for t in targets:
        if not isinstance(t.module, torch.nn.Linear) or id(t) not in downs:
            continue
        parent, _, leaf = t.module_name.rpartition(".")
        for family in SIBLINGS:
            if leaf in family:
                d = downs[id(t)]
                buckets.setdefault((t.component, parent, family, d.shape[1], d.dtype, d.device), []).append(t)
    out: dict[int, tuple[_SharedDown, slice]] = {}
    for (_, _, family, *_), members in buckets.items():
        if len(members) < 2:
            continue
        members.sort(key=lambda t: family.index(t.module_name.rpartition(".")[2]))
        group = _SharedDown(torch.cat([downs[id(t)].reshape(downs[id(t)].shape[0], -1) for t in members]))
        group.size = len(members)
        start = 0
        for t in members:
            rows = slice(start, start + downs[id(t)].shape[0])
            out[id(t)] = (group, rows)
            start = rows.stop
    return out


class _BufferArena:
    """The plain LoRA layers' ``up_s`` buffers of one component as consecutive views of one zeroed flat tensor per
    (device, dtype), handed out in ``take`` order with their sources.

    ``spans()`` merges each maximal run of buffers whose sources also lie back to back in one storage (the loader
    packs a component's plain ``up`` factors so: ``loader.to_device``) into one pair of 1-D views; every buffer lies
    in exactly one span, paired element for element with its own source."""

    __slots__ = ("flats", "used", "_pairs")

    def __init__(self, factors: Iterable[torch.Tensor]):
        sizes: dict[tuple, int] = {}
        for f in factors:
            sizes[(f.device, f.dtype)] = sizes.get((f.device, f.dtype), 0) + f.numel()
        self.flats = {key: torch.zeros(n, device=key[0], dtype=key[1]) for key, n in sizes.items()}
        self.used = dict.fromkeys(sizes, 0)
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def take(self, source: torch.Tensor) -> torch.Tensor:
        """A zeroed contiguous buffer shaped like ``source`` (whose device, dtype and size the arena was built
        with), to hold ``strength * source``."""
        key = (source.device, source.dtype)
        start = self.used[key]
        self.used[key] = start + source.numel()
        buf = self.flats[key][start:start + source.numel()].view(source.shape)
        self._pairs.append((source, buf))
        return buf

    def holds(self, buf: torch.Tensor) -> bool:
        """Whether ``buf`` is one of this arena's views."""
        return any(buf.untyped_storage().data_ptr() == f.data_ptr() for f in self.flats.values())

    def spans(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``(buffer spans, source spans)``: equal-shaped pairs covering every buffer taken (class docstring)."""
        runs: list[list] = []  # [first source, first buffer, element count]
        for src, buf in self._pairs:
            if runs and _follows(runs[-1][0], runs[-1][2], src) and _follows(runs[-1][1], runs[-1][2], buf):
                runs[-1][2] += src.numel()
            else:
                runs.append([src, buf, src.numel()])
        dst, srcs = [], []
        for src, buf, n in runs:
            if src.is_contiguous():
                src, buf = (torch.as_strided(t, (n,), (1,), t.storage_offset()) for t in (src, buf))
            dst.append(buf)
            srcs.append(src)
        return dst, srcs

    def zero_(self) -> None:
        for flat in self.flats.values():
            flat.zero_()


def _follows(first: torch.Tensor, count: int, t: torch.Tensor) -> bool:
    """Whether contiguous ``t`` starts right after ``count`` elements from ``first`` in the same storage."""
    return (t.is_contiguous() and first.is_contiguous() and t.dtype == first.dtype and t.device == first.device
            and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
            and t.storage_offset() == first.storage_offset() + count)


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
        self._slots: dict[str, list] = {c: [] for c in self.components}
        self._up: dict[str, list[torch.Tensor]] = {c: [] for c in self.components}
        self._up_s: dict[str, list[torch.Tensor]] = {c: [] for c in self.components}
        lowrank = {id(t): f for t in self.targets if (f := lowrank_factors(t)) is not None}
        shared = _share_downs(self.targets, {i: f[0] for i, f in lowrank.items()})
        self._shared = list({id(g): g for g, _ in shared.values()}.values())
        self._dora: dict[str, list[DoraForward]] = {c: [] for c in self.components}
        self._plus_one: dict[str, list[torch.Tensor]] = {c: [] for c in self.components}  # strength * source + 1
        self._arenas = {c: _BufferArena(lowrank[id(t)][1] for t in self.targets
                                        if t.component == c and id(t) in lowrank)
                        for c in self.components}
        self._loose: dict[str, list[torch.Tensor]] = {}  # buffers outside the arena
        for t in self.targets:
            override = None
            if t.layer.magnitude is not None:  # DoRA: its own forward (``dora_forward``), the dense hook as fallback
                term, up, up_s = make_term(t)
                inner = None
                if not isinstance(t.layer, LoraLayer):  # LoHa / LoKr: their own term, run on g * x
                    inner, inner_src, inner_buf = make_term(replace(t, layer=replace(t.layer, magnitude=None)))
                    self._up[t.component].append(inner_src)
                    self._up_s[t.component].append(inner_buf)
                override = DoraForward(t, inner)
                if override.folded:  # a plain LoRA term over the g-folded factors
                    override.inner = (_LinearTerm(override.down, override.up_s)
                                      if isinstance(t.module, torch.nn.Linear)
                                      else _ConvLoraHook(override.down, override.up_s, t.module))
                    parent = _geglu_parent(t, roots) if self.strategy == "geglu" else None
                    if parent is not None:  # its low-rank term goes into the GEGLU's fused gating
                        override.fuse_into(_geglu_forward_for(parent))
                self._dora[t.component].append(override)
                for src, buf in override.strength_pairs():
                    self._up[t.component].append(src)
                    self._up_s[t.component].append(buf)
                self._plus_one[t.component] += override.plus_one()
            elif id(t) not in lowrank:  # LoHa, LoKr (``fullrank``): always a hook
                term, up, up_s = make_term(t)
            else:
                down = _shaped(t, lowrank[id(t)][0], "down")
                up = _shaped(t, lowrank[id(t)][1], "up")
                up_s = self._arenas[t.component].take(up)  # persistent strength-scaled buffer (written at attach)
                if isinstance(t.module, torch.nn.Linear):
                    group, rows = shared.get(id(t), (None, slice(None)))
                    term = _LinearTerm(group.down[rows] if group is not None else down, up_s, group, rows)
                    parent = _geglu_parent(t, roots) if self.strategy == "geglu" else None
                    if parent is not None:
                        override = _geglu_forward_for(parent)
                else:
                    term = _ConvLoraHook(down, up_s, t.module)
            # A hook id reserved once per (binding, module) for the hook path (also the GEGLU term's fallback): attach
            # is one dict insert per module, detach one pop (``register_forward_hook`` costs ~2 us per module).
            slot = RemovableHandle(t.module._forward_hooks)
            self._slots[t.component].append((t.module._forward_hooks, slot.id, term, override))
            self._up[t.component].append(up)
            self._up_s[t.component].append(up_s)
        self._rewrite: dict[str, tuple[list, list]] = {}  # component -> (buffers, sources) of one multi-tensor add
        for c in self.components:  # fullrank and DoRA buffers: zeroed one by one, added one by one
            loose = [(b, u) for b, u in zip(self._up_s[c], self._up[c]) if not self._arenas[c].holds(b)]
            self._loose[c] = [b for b, _ in loose]
            dst, src = self._arenas[c].spans()
            self._rewrite[c] = (dst + self._loose[c], src + [u for _, u in loose])
        # buffers start zeroed: strength 0 is written, unless a buffer holds strength * source + 1
        self._written: dict[str, "float | None"] = {c: None if self._plus_one[c] else 0.0 for c in self.components}
        self._init_refcounts(self.components)

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

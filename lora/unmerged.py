"""Unmerged LoRA: ``y = W x + b + strength * up(down(x))`` computed at forward time by removable forward hooks.

Invariants
- Base weights are never written: the hooks only read the module's output and add the low-rank term to it.
  ``detach`` removes every hook it installed, leaving each module exactly as before (its hook dict as it was).
  Hooks are ordinary forward hooks; their ids are reserved once per binding (``RemovableHandle``), so attach and
  detach are one dict insert / pop per module instead of a ``register_forward_hook`` call (~2 us each).
- Strength is data, not structure. Each layer owns a persistent buffer ``up_s = strength * up`` (``up`` already
  carries ``alpha / rank``); ``attach`` rewrites those buffers in place with two multi-tensor kernels
  (``_foreach_copy_`` + ``_foreach_mul_``, no allocation) only when the strength changed. A CUDA graph captured
  while the binding was attached reads ``up_s`` on replay, so a strength change costs the rewrite (~0.1 ms for a
  rank-32 SDXL LoRA), never a recapture, recompile or base-weight copy.
- The hook adds in place into the module's fresh output with one GEMM (``out.addmm_(down(x), up_s.T)``): no
  Python-side tensor creation (nothing host->device, so hooks are CUDA-graph capture safe), no separate strength
  multiply. Siblings reading one input (``to_q/to_k/to_v``...) share one ``down`` GEMM (``_SharedDown``).
- Strength writes happen at attach, never inside a CUDA-graph capture (``refuse_inside_capture`` raises): a
  write captured into a graph would replay the old value. The sampler enters the session, then captures.
- Cost floor of this design (why it is not at +10% under graphs): each ``up`` GEMM reads and writes the base
  output once more, ~16 GB of extra traffic per SDXL-1024 step (~4 ms at 4 TB/s) for a LoRA on every
  attention/FF Linear; going lower needs the delta fused into the base GEMM or GEGLU epilogue.
- Several bindings stack: each registers its own hooks; hooks run in registration order and each adds its term.

A binding is shared by every view of the same (loaded LoRA, targets); the views differ only in the strength
written at attach. Two views of one binding cannot be attached at the same time with different strengths
(ComfyUI runs nodes one at a time; a nested attach with the same strength is counted and allowed).
"""
from __future__ import annotations

import logging
from typing import Iterable

import torch
import torch.nn.functional as F
from torch.utils.hooks import RemovableHandle

from .binding import RefCountedBinding
from .keymap import Target

logger = logging.getLogger(__name__)


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


def _can_add_in_place(output: torch.Tensor, dtype: torch.dtype) -> bool:
    return output.dtype == dtype and output.is_contiguous() and not (torch.is_grad_enabled() and output.requires_grad)


class _SharedDown:
    """The concatenated down factors of sibling Linears that read the same input (``to_q/to_k/to_v`` of a
    self-attention, ``to_k/to_v`` of a cross-attention, ``q_proj/k_proj/v_proj`` of CLIP): one GEMM
    ``H = x @ cat(down_i).T`` replaces one GEMM per sibling; member ``i`` reads its column slice of ``H``.

    The first member called computes ``H`` and remembers ``x`` (identity); a member called with the same tensor
    object reuses ``H``, one called with another tensor recomputes (so a sibling fed a different input, e.g.
    ``to_q`` of a cross-attention, is still exact). The cache is dropped after the last sibling read it (no tensor
    outlives the attention call; a model calling the siblings out of order only loses the sharing), at detach, and
    is never used while ``torch.compile`` traces (a plain per-member GEMM then).
    """

    __slots__ = ("down", "size", "x", "h", "__weakref__")

    def __init__(self, down: torch.Tensor):
        self.down, self.size = down, 0
        self.x = self.h = None

    def get(self, x: torch.Tensor, rows: slice) -> torch.Tensor:
        if self.x is not x:
            self.x, self.h = x, F.linear(x, self.down)
        h = self.h[..., rows]
        if rows.stop == self.down.shape[0]:  # the last sibling (modules call them in order): drop the cache
            self.x = self.h = None
        return h

    def clear(self) -> None:
        self.x = self.h = None


class _LinearLoraHook:
    """Forward hook of one Linear: ``out += down(x) @ up_s.T`` (``down(x)`` possibly shared with its siblings)."""

    __slots__ = ("down", "up_s", "shared", "rows", "__weakref__")

    def __init__(self, down: torch.Tensor, up_s: torch.Tensor, shared: "_SharedDown | None" = None,
                 rows: slice = slice(None)):
        self.down, self.up_s, self.shared, self.rows = down, up_s, shared, rows

    def __call__(self, module, args, output):
        x = args[0]
        down, up_s = self.down, self.up_s
        if x.device != down.device or x.dtype != down.dtype:  # a placement ran this module elsewhere
            h = F.linear(x.to(down.device, down.dtype), down)
            return output + F.linear(h, up_s).to(output.device, output.dtype)
        if self.shared is not None and not torch.compiler.is_compiling():
            h = self.shared.get(x, self.rows)
        else:
            h = F.linear(x, down)
        if _can_add_in_place(output, up_s.dtype):
            output.view(-1, output.shape[-1]).addmm_(h.reshape(-1, h.shape[-1]), up_s.t())
            return None
        return output + F.linear(h, up_s)


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
        if not foreign and _can_add_in_place(output, up_s.dtype):
            output.add_(delta)
            return None
        return output + delta.to(output.device, output.dtype)


SIBLINGS = (("to_q", "to_k", "to_v"), ("q_proj", "k_proj", "v_proj"))


def _share_downs(targets: list[Target]) -> dict[int, tuple[_SharedDown, slice]]:
    """``id(target) -> (shared down, its rows)`` for Linear siblings (``SIBLINGS``) of one parent with the same
    input width, dtype and device; targets without a sibling are absent. The concatenated factor is a new tensor
    (the loaded factors are left as they are); each member's ``down`` becomes a row view of it."""
    buckets: dict[tuple, list[Target]] = {}
    for t in targets:
        if not isinstance(t.module, torch.nn.Linear):
            continue
        parent, _, leaf = t.module_name.rpartition(".")
        for family in SIBLINGS:
            if leaf in family:
                d = t.layer.down
                buckets.setdefault((t.component, parent, family, d.shape[1], d.dtype, d.device), []).append(t)
    out: dict[int, tuple[_SharedDown, slice]] = {}
    for (_, _, family, *_), members in buckets.items():
        if len(members) < 2:
            continue
        members.sort(key=lambda t: family.index(t.module_name.rpartition(".")[2]))
        group = _SharedDown(torch.cat([t.layer.down.reshape(t.layer.down.shape[0], -1) for t in members]))
        group.size = len(members)
        start = 0
        for t in members:
            rows = slice(start, start + t.layer.down.shape[0])
            out[id(t)] = (group, rows)
            start = rows.stop
    return out


class UnmergedBinding(RefCountedBinding):
    """A loaded LoRA bound to a model's modules, injected by hooks. See the module docstring."""

    mode = "unmerged"

    def __init__(self, key: tuple, targets: Iterable[Target], label: str = ""):
        self.key = key
        self.label = label
        self.targets = list(targets)
        self.components = sorted({t.component for t in self.targets})
        self._hooks: dict[str, list] = {c: [] for c in self.components}
        self._up: dict[str, list[torch.Tensor]] = {c: [] for c in self.components}
        self._up_s: dict[str, list[torch.Tensor]] = {c: [] for c in self.components}
        shared = _share_downs(self.targets)
        self._shared = list({id(g): g for g, _ in shared.values()}.values())
        for t in self.targets:
            down = _shaped(t, t.layer.down, "down")
            up = _shaped(t, t.layer.up, "up")
            up_s = torch.zeros_like(up)  # persistent strength-scaled buffer (written at attach)
            if isinstance(t.module, torch.nn.Linear):
                group, rows = shared.get(id(t), (None, slice(None)))
                hook = _LinearLoraHook(group.down[rows] if group is not None else down, up_s, group, rows)
            else:
                hook = _ConvLoraHook(down, up_s, t.module)
            # A hook id reserved once per (binding, module): attach is one dict insert per module, detach one pop
            # (``register_forward_hook`` costs ~2 us per module per session, 1.5 ms for 700 SDXL layers).
            slot = RemovableHandle(t.module._forward_hooks)
            self._hooks[t.component].append((t.module._forward_hooks, slot.id, hook))
            self._up[t.component].append(up)
            self._up_s[t.component].append(up_s)
        self._written: dict[str, float] = {c: 0.0 for c in self.components}  # buffers start zeroed
        self._init_refcounts(self.components)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for c in self.components for t in self._up_s[c])

    def write_strength(self, component: str, strength: float) -> None:
        """Set ``up_s = strength * up`` for ``component`` in place (skipped when already written)."""
        if self._written.get(component) == strength:
            return
        refuse_inside_capture(self.label, component)
        ups, bufs = self._up[component], self._up_s[component]
        if strength == 0.0:
            torch._foreach_zero_(bufs)
        else:
            torch._foreach_copy_(bufs, ups)
            if strength != 1.0:
                torch._foreach_mul_(bufs, float(strength))
        self._written[component] = strength

    def _activate(self, comp: str, strength: float) -> None:
        self.write_strength(comp, strength)
        for hooks, hook_id, hook in self._hooks[comp]:
            hooks[hook_id] = hook

    def _deactivate(self, comp: str) -> None:
        for hooks, hook_id, _ in self._hooks[comp]:
            hooks.pop(hook_id, None)
        for group in self._shared:
            group.clear()

"""The forward terms of plain (low-rank) unmerged LoRA layers: ``strength * up(down(x))`` added to a module's output.

- ``LinearTerm``: ``down(x) @ up_s.T`` for a Linear, run as the module's forward hook (``out.addmm_`` in place) or
  as a term of its GEGLU's override (``memory.unet_patches``: it fuses ``up_s`` into the gating).
- ``ConvTerm``: ``conv1x1(conv_kxk(x, down), up_s)`` for a Conv2d, with the base conv's stride, padding and dilation.
- ``SharedDown``: Linear siblings that read one input (``SIBLINGS``) share one ``down`` GEMM.

Invariants
- ``up_s`` is a persistent buffer (``strength * up``) the binding rewrites in place at attach; a term reads it at
  every call, so a captured CUDA graph replays any strength. At strength 0 the term adds exact zeros, so the output
  is the base bit-for-bit.
- No Python-side tensor creation in a forward (nothing host->device: capture safe). An input on another device or
  dtype than the factors (a placement ran the module elsewhere), or one that autograd records, gets the plain
  out-of-place sum.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .fullrank import can_add_in_place
from .keymap import Target

SIBLINGS = (("to_q", "to_k", "to_v"), ("q_proj", "k_proj", "v_proj"))


class SharedDown:
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


class LinearTerm:
    """One LoRA term of one Linear: ``down(x) @ up_s.T`` (``down(x)`` possibly shared with its siblings). Used as
    the forward hook itself, or (a GEGLU ``proj`` under ``geglu``) as a term of the GEGLU's override."""

    __slots__ = ("down", "up_s", "shared", "rows", "__weakref__")

    def __init__(self, down: torch.Tensor, up_s: torch.Tensor, shared: "SharedDown | None" = None,
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


class ConvTerm:
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


def share_downs(targets: list[Target], downs: dict[int, torch.Tensor]) -> dict[int, tuple[SharedDown, slice]]:
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
    out: dict[int, tuple[SharedDown, slice]] = {}
    for (_, _, family, *_), members in buckets.items():
        if len(members) < 2:
            continue
        members.sort(key=lambda t: family.index(t.module_name.rpartition(".")[2]))
        group = SharedDown(torch.cat([downs[id(t)].reshape(downs[id(t)].shape[0], -1) for t in members]))
        group.size = len(members)
        start = 0
        for t in members:
            rows = slice(start, start + downs[id(t)].shape[0])
            out[id(t)] = (group, rows)
            start = rows.stop
    return out

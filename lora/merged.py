"""Merged LoRA: ``W <- W + strength * dW`` written into the shared weights for the duration of a session
(``dW``: LoRA ``up @ down``, LoHa, LoKr, DoRA; ``fullrank.weight_delta``).

Design (the view does not own a merged copy; it merges on attach and restores on detach):
- ``attach`` saves a copy of *only the weights it touches*, then writes ``round(W + s * up @ down)`` into each
  weight in place (the product and sum in fp32, rounded once to the weight's dtype). Weight storage and
  ``data_ptr()`` never change, so a CUDA graph captured with the merged weights stays valid, and a strength
  change is a re-merge at the next attach, never a recapture.
- ``detach`` copies the saved weights back: the base weights are restored *bit-exactly* (a copy, not a
  subtraction), so the upstream engine and every other view see the model exactly as before.
- Cost per session: one extra copy of the touched weights (on their device; on OOM the copy falls back to
  pinned CPU memory), one GEMM ``up @ down`` per layer at attach and one copy back at detach. A LoRA on every
  attention/feed-forward Linear of SDXL touches 1.7 of the UNet's 2.57 G parameters, so the backup is about two
  thirds of the UNet's size. Cheap next to a sampling loop in time, expensive in memory: use ``unmerged`` when
  VRAM is tight.
- Strength 0 merges nothing. An error during attach restores what was merged before re-raising.

Why hand-written: diffusers' ``fuse_lora``/``unfuse_lora`` (PEFT's ``merge``/``unmerge``) restore by subtracting the
delta, which in fp16/bf16 does not give the base weights back bit-exactly, and they need PEFT's layers injected into
the model first (a changed module structure); here the base weights are a saved copy and the modules stay as they are.
"""
from __future__ import annotations

import logging
from typing import Iterable

import torch

from .binding import RefCountedBinding
from .fullrank import weight_delta
from .keymap import Target
from .strength_buffers import refuse_inside_capture

logger = logging.getLogger(__name__)


def lora_delta(target: Target, strength: float, device: torch.device) -> torch.Tensor:
    """``strength * dW`` (LoRA ``up @ down``, LoHa, LoKr; DoRA against the weight as it is now:
    ``fullrank.weight_delta``) in fp32 on ``device``, shaped like the module's weight."""
    return weight_delta(target, strength, target.module.weight).to(device)


def _save_copy(w: torch.Tensor) -> torch.Tensor:
    try:
        return w.detach().clone()
    except torch.OutOfMemoryError:
        logger.warning("merged LoRA: no room for a %.1f MB weight backup on %s; keeping it in CPU memory",
                       w.nbytes / 2**20, w.device)
        out = torch.empty(w.shape, dtype=w.dtype, device="cpu", pin_memory=w.is_cuda)
        return out.copy_(w)


class MergedBinding(RefCountedBinding):
    """A loaded LoRA bound to a model's modules, merged into the weights while attached."""

    mode = "merged"
    verb = "merged into"

    def __init__(self, key: tuple, targets: Iterable[Target], label: str = ""):
        self.key = key
        self.label = label
        self.targets = list(targets)
        self.components = sorted({t.component for t in self.targets})
        self._saved: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {c: [] for c in self.components}
        self._init_refcounts(self.components)

    @torch.no_grad()
    def _merge(self, comp: str, strength: float) -> None:
        saved = self._saved[comp]
        try:
            for t in self.targets:
                if t.component != comp:
                    continue
                w = t.module.weight
                backup = _save_copy(w)
                saved.append((w, backup))
                merged = w.float() + lora_delta(t, strength, w.device)
                w.copy_(merged)
        except BaseException:
            self._restore(comp)
            raise

    @torch.no_grad()
    def _restore(self, comp: str) -> None:
        saved = self._saved[comp]
        while saved:
            w, backup = saved.pop()
            w.copy_(backup)

    def _activate(self, comp: str, strength: float) -> None:
        if strength != 0.0:
            refuse_inside_capture(self.label, comp)
            self._merge(comp, strength)

    def _deactivate(self, comp: str) -> None:
        self._restore(comp)

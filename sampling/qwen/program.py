"""One Qwen-Image step over static buffers: what the eager loop runs and the CUDA graph captures.

Invariant: ``QwenStepProgram.step()`` reads only its buffers (state, model input, timestep, coefficients and the
layout: text rows, mask, RoPE tables, reference tokens) and writes only its buffers, without host synchronisation,
so an eager step and a graph replay do the same work on the same memory, and a new step, seed or prompt of the same
text bucket needs only fresh values copied in.

Per step (``QwenImagePipeline``'s loop with its two CFG calls batched into one):
  pred = transformer(model_input, t, layout)                    rows [cond x B, uncond x B] when guided
  v = u + cfg (c - u), rescaled per token to |c| (true CFG)     in the model dtype, as the pipeline does
  state <- state + (sigma_next - sigma) v                       float32; model_input <- state (cast, per copy)
The state stays float32 whatever the model dtype (diffusers casts it back each step; in fp32 the two agree).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .forward import QwenLayout

STATE_DTYPE = torch.float32
DitFn = Callable[[torch.Tensor, torch.Tensor, QwenLayout], torch.Tensor]
_FIELDS = tuple(QwenLayout.__dataclass_fields__)


def true_cfg(cond: torch.Tensor, uncond: torch.Tensor, cfg: torch.Tensor) -> torch.Tensor:
    """``QwenImagePipeline``'s true CFG: ``u + cfg (c - u)`` rescaled per token (last dim) to the norm of ``c``."""
    combined = uncond + cfg * (cond - uncond)
    return combined * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))


class QwenStepProgram:
    """Static buffers + the step body; built once per (rows, tokens, dtype, guided, layout shapes)."""

    def __init__(self, dit_fn: Optional[DitFn], batch: int, tokens: int, features: int, like: QwenLayout,
                 model_dtype: torch.dtype, guided: bool, alloc):
        self.dit_fn = dit_fn
        self.batch = batch
        self.guided = guided
        rows = 2 * batch if guided else batch
        self.sample = alloc("qwen.state", (batch, tokens, features), STATE_DTYPE)
        self.model_input = alloc("qwen.model_input", (rows, tokens, features), model_dtype)
        self.timestep = alloc("qwen.timestep", (rows,), model_dtype)
        self.coeffs = alloc("qwen.coeffs", (2,), torch.float32)  # (cfg, sigma_next - sigma)
        self.layout = QwenLayout(*(None if t is None else alloc(f"qwen.{name}", tuple(t.shape), t.dtype)
                                   for name, t in zip(_FIELDS, _fields(like))))

    def load(self, layout: QwenLayout, x: torch.Tensor) -> None:
        """Copy a run's layout and starting packed latents (model space, float32) into the buffers."""
        for name, mine, theirs in zip(_FIELDS, _fields(self.layout), _fields(layout)):
            if (mine is None) != (theirs is None) or (mine is not None and mine.shape != theirs.shape):
                raise ValueError(f"layout {name} of shape {None if theirs is None else tuple(theirs.shape)} does not "
                                 f"fit this program's {None if mine is None else tuple(mine.shape)}")
            if mine is not None:
                mine.copy_(theirs)
        self.sample.copy_(x)
        self._refresh_input()

    def set_step(self, timestep: torch.Tensor, coeffs: torch.Tensor) -> None:
        """The next step's timestep (a 0-d device tensor in the model dtype) and ``(cfg, sigma_next - sigma)``."""
        self.timestep.copy_(timestep.expand(self.timestep.shape[0]))
        self.coeffs.copy_(coeffs)

    def step(self) -> None:
        pred = self.dit_fn(self.model_input, self.timestep, self.layout)
        v = true_cfg(pred[:self.batch], pred[self.batch:], self.coeffs[0]) if self.guided else pred
        self.sample.add_(v.to(STATE_DTYPE) * self.coeffs[1])
        self._refresh_input()

    def _refresh_input(self) -> None:
        copies = self.model_input.shape[0] // self.batch
        self.model_input.view(copies, *self.sample.shape).copy_(self.sample.unsqueeze(0).expand(copies, -1, -1, -1))


def _fields(layout: QwenLayout) -> tuple:
    return tuple(getattr(layout, name) for name in _FIELDS)

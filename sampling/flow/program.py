"""One flow-matching step over static buffers: what the eager loop runs and the CUDA graph captures.

Invariant: ``FlowStepProgram.step()`` reads only its buffers (state, model input, timestep, coefficients and the
caption layout) and writes only its buffers, without host synchronisation, so an eager step and a graph replay do
the same work on the same memory, and a new step or a new prompt of the same caption bucket needs only fresh
values copied in.

Per step:  pred = DiT(model_input, t, layout)        (rows [cond..., uncond...] when guided)
           state, model_input <- fused CFG + Euler update (``kernels/flow_euler_cfg.py``):
           x' = x + (sigma - sigma_next) (u + cfg (c - u))   (the DiT predicts the negative velocity)
The state stays float32 whatever the model dtype (the model input is its cast), as diffusers keeps its latents.
"""
from __future__ import annotations

from typing import Callable

import torch

from ...kernels.flow_euler_cfg import flow_euler_step
from .dit_forward import CaptionLayout, ImageGrid

STATE_DTYPE = torch.float32
DitFn = Callable[[torch.Tensor, torch.Tensor, CaptionLayout, ImageGrid], torch.Tensor]


class FlowStepProgram:
    """Static buffers + the step body; built once per (batch, guided, grid, capacity, dtypes)."""

    def __init__(self, dit_fn: DitFn, batch: int, channels: int, grid: ImageGrid, like: CaptionLayout,
                 model_dtype: torch.dtype, guided: bool, alloc):
        self.dit_fn = dit_fn
        self.grid = grid
        self.batch = batch
        self.guided = guided
        rows = 2 * batch if guided else batch
        h, w = grid.rows * grid.patch, grid.cols * grid.patch
        self.sample = alloc("flow.state", (batch, channels, h, w), STATE_DTYPE)
        self.model_input = alloc("flow.model_input", (rows, channels, h, w), model_dtype)
        self.timestep = alloc("flow.timestep", (rows,), torch.float32)
        self.coeffs = alloc("flow.coeffs", (2,), torch.float32)
        self.layout = CaptionLayout(*(alloc(f"flow.{name}", tuple(t.shape), t.dtype) for name, t in
                                      zip(CaptionLayout.__dataclass_fields__, _fields(like))))

    def load(self, layout: CaptionLayout, x: torch.Tensor) -> None:
        """Copy a run's caption layout and starting latent (model space, float32) into the buffers."""
        for mine, theirs in zip(_fields(self.layout), _fields(layout)):
            if mine.shape != theirs.shape:
                raise ValueError(f"caption layout of shape {tuple(theirs.shape)} does not fit this program's "
                                 f"{tuple(mine.shape)}")
            mine.copy_(theirs)
        self.sample.copy_(x)
        copies = self.model_input.shape[0] // self.batch
        self.model_input.view(copies, *self.sample.shape).copy_(self.sample.unsqueeze(0).expand(copies, -1, -1, -1, -1))

    def set_step(self, timestep: torch.Tensor, coeffs: torch.Tensor) -> None:
        """The next step's model timestep (a 0-d device tensor) and (cfg, sigma - sigma_next) coefficients."""
        self.timestep.copy_(timestep.expand(self.timestep.shape[0]))
        self.coeffs.copy_(coeffs)

    def step(self) -> None:
        pred = self.dit_fn(self.model_input, self.timestep, self.layout, self.grid)
        if self.guided:
            cond, uncond = pred[:self.batch], pred[self.batch:]
        else:
            cond, uncond = pred, None
        flow_euler_step(self.sample, cond, uncond, self.coeffs, out=self.sample, model_input=self.model_input)


def _fields(layout: CaptionLayout) -> tuple:
    return tuple(getattr(layout, name) for name in CaptionLayout.__dataclass_fields__)

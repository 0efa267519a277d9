"""The model half of ComfyUI's denoiser: one guided model evaluation over static buffers, for the UNet families and
for the flow DiT (Z-Image), returning the cond and (when guided) uncond predictions in float32.

Invariant: ``__call__`` reads only the buffers it owns (model input, timestep, conditioning) plus the tensors it is
given, writes only its buffers and synchronises nothing with the host, so it can sit inside a captured CUDA graph.
Layouts follow the pack's other samplers: the UNet takes ``[uncond x B, cond x B]`` in one call (batched CFG, as
``sampling.cfg.unet_calls`` builds it) or two calls (sequential); the DiT takes ``[cond x B, uncond x B]`` rows with
static caption buffers (``sampling.flow.dit_forward``), so any prompt of a caption bucket replays the same graph.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from ..cfg import UNetCall, call_buffers, load_calls
from ..flow.dit_forward import CaptionLayout, ImageGrid
from ..flow.schedule import TRAIN_TIMESTEPS

Prediction = tuple[torch.Tensor, Optional[torch.Tensor]]


class UNetModelCall:
    """The UNet evaluated on ``x_in`` (already ``calculate_input``-scaled, float32) at an integer timestep."""

    def __init__(self, shape: Sequence[int], model_dtype: torch.dtype, calls: Sequence[UNetCall], copies: int,
                 guided: bool, alloc):
        self.fn: Optional[Callable] = None  # bound per run (a cached program must not keep its engine alive)
        self.shape = tuple(int(s) for s in shape)
        self.copies = copies
        self.guided = guided
        self.model_input = alloc("ksampler.unet_input", (copies * self.shape[0],) + self.shape[1:], model_dtype)
        self.calls: list[UNetCall] = call_buffers(calls, alloc, "ksampler")

    def load(self, calls: Sequence[UNetCall]) -> None:
        load_calls(self.calls, calls)

    def __call__(self, x_in: torch.Tensor, timestep: torch.Tensor) -> Prediction:
        b = self.shape[0]
        self.model_input.view(self.copies, *self.shape).copy_(x_in.unsqueeze(0).expand(self.copies, *self.shape))
        if len(self.calls) == 2:  # sequential CFG: uncond, then cond
            u = self.fn(self.model_input, timestep, self.calls[0].context, self.calls[0].added)
            c = self.fn(self.model_input, timestep, self.calls[1].context, self.calls[1].added)
            return c.float(), u.float()
        pred = self.fn(self.model_input, timestep, self.calls[0].context, self.calls[0].added).float()
        if self.guided:
            return pred[b:], pred[:b]
        return pred, None


class DitModelCall:
    """The flow DiT evaluated at sigma: model timestep ``(1000 - 1000 sigma) / 1000`` as diffusers forms it."""

    def __init__(self, batch: int, channels: int, grid: ImageGrid, like: CaptionLayout, model_dtype: torch.dtype,
                 guided: bool, alloc):
        self.fn: Optional[Callable] = None
        self.batch, self.grid, self.guided = batch, grid, guided
        rows = 2 * batch if guided else batch
        h, w = grid.rows * grid.patch, grid.cols * grid.patch
        self.model_input = alloc("ksampler.dit_input", (rows, channels, h, w), model_dtype)
        self.timestep = alloc("ksampler.dit_timestep", (rows,), torch.float32)
        self.layout = CaptionLayout(*(alloc(f"ksampler.{name}", tuple(t.shape), t.dtype) for name, t in
                                      zip(CaptionLayout.__dataclass_fields__, _fields(like))))

    def load(self, layout: CaptionLayout) -> None:
        for mine, theirs in zip(_fields(self.layout), _fields(layout)):
            if mine.shape != theirs.shape:
                raise ValueError(f"caption layout of shape {tuple(theirs.shape)} does not fit this program's "
                                 f"{tuple(mine.shape)}")
            mine.copy_(theirs)

    def __call__(self, x_in: torch.Tensor, sigma: torch.Tensor) -> Prediction:
        t = sigma * TRAIN_TIMESTEPS
        self.timestep.copy_(((TRAIN_TIMESTEPS - t) / TRAIN_TIMESTEPS).expand(self.timestep.shape[0]))
        copies = self.model_input.shape[0] // self.batch
        self.model_input.view(copies, *x_in.shape).copy_(x_in.unsqueeze(0).expand(copies, *x_in.shape))
        pred = self.fn(self.model_input, self.timestep, self.layout, self.grid).float()
        if self.guided:
            return pred[:self.batch], pred[self.batch:]
        return pred, None


def _fields(layout: CaptionLayout) -> tuple:
    return tuple(getattr(layout, name) for name in CaptionLayout.__dataclass_fields__)

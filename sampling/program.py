"""One denoising step as a program over static buffers: the unit the eager loop runs and the graph runner captures.

Invariant: ``StepProgram.step()`` reads only its buffers (latent state, UNet input, timestep, coefficients, noise,
conditioning) and writes only its buffers, with no host synchronisation and no allocation visible outside the step.
So running it eagerly and replaying a CUDA graph captured from it perform the same kernels on the same memory, and
a new step needs nothing but fresh values copied into ``timestep`` / ``coeffs`` / ``noise``.

Per step:  pred = UNet(model_input, t, context)   (one call on [x, x] for batched CFG, two for sequential)
           state, model_input <- fused CFG + DDIM update (``kernels/cfg_ddim.py``)
The latent state is kept in float32 whatever the UNet's dtype (the UNet input is its cast), so fp16 models lose
no precision across steps; in fp32 this equals diffusers' loop.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from ..kernels.cfg_ddim import N_COEFFS, cfg_ddim_step
from .cfg import UNetCall, call_buffers, load_calls

UNetFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Optional[dict]], torch.Tensor]
Allocator = Callable[[str, tuple, torch.dtype], torch.Tensor]

STATE_DTYPE = torch.float32


def plain_allocator(device: torch.device) -> Allocator:
    def alloc(role: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device)

    return alloc


class StepProgram:
    """Static buffers + the step body. Build once per (shape, dtype, calls layout); load inputs per run."""

    def __init__(self, unet_fn: UNetFn, latent_shape: Sequence[int], model_dtype: torch.dtype,
                 calls: Sequence[UNetCall], copies: int, has_noise: bool, guided: bool, prediction: str,
                 alloc: Allocator):
        self.unet_fn = unet_fn
        self.latent_shape = tuple(int(s) for s in latent_shape)
        self.copies = copies
        self.guided = guided
        self.prediction = prediction
        b = self.latent_shape[0]
        self.sample = alloc("sampler.state", self.latent_shape, STATE_DTYPE)
        self.model_input = alloc("sampler.unet_input", (copies * b,) + self.latent_shape[1:], model_dtype)
        self.timestep = alloc("sampler.timestep", (), torch.int64)
        self.coeffs = alloc("sampler.coeffs", (N_COEFFS,), torch.float32)
        self.noise = alloc("sampler.noise", self.latent_shape, STATE_DTYPE) if has_noise else None
        self.calls: list[UNetCall] = call_buffers(calls, alloc, "sampler")

    # ------------------------------------------------------------------ inputs
    def load(self, calls: Sequence[UNetCall], x: torch.Tensor) -> None:
        """Copy a run's conditioning and initial latent (scaled space) into the buffers."""
        load_calls(self.calls, calls)
        self.set_sample(x)

    def set_sample(self, x: torch.Tensor) -> None:
        self.sample.copy_(x)
        self.model_input.view(self.copies, *self.latent_shape).copy_(
            self.sample.unsqueeze(0).expand(self.copies, *self.latent_shape))

    def set_step(self, timestep: torch.Tensor, coeffs: torch.Tensor, noise: Optional[torch.Tensor]) -> None:
        """Values of the next step (device tensors; copies are stream-ordered, no host sync)."""
        self.timestep.copy_(timestep, non_blocking=True)
        self.coeffs.copy_(coeffs, non_blocking=True)
        if self.noise is not None:
            if noise is None:
                raise ValueError("this program was built for eta > 0 and needs noise every step")
            self.noise.copy_(noise, non_blocking=noise.device.type == "cpu" and noise.is_pinned())

    # ------------------------------------------------------------------ the step (captured by the graph runner)
    def step(self) -> None:
        b = self.latent_shape[0]
        if len(self.calls) == 2:  # sequential CFG: uncond, then cond
            pred_u = self.unet_fn(self.model_input, self.timestep, self.calls[0].context, self.calls[0].added)
            pred_c = self.unet_fn(self.model_input, self.timestep, self.calls[1].context, self.calls[1].added)
        else:
            pred = self.unet_fn(self.model_input, self.timestep, self.calls[0].context, self.calls[0].added)
            if self.guided:
                pred_u, pred_c = pred[:b], pred[b:]
            else:
                pred_u, pred_c = None, pred
        cfg_ddim_step(self.sample, pred_c, pred_u, self.coeffs, self.noise, out=self.sample,
                      model_input=self.model_input, prediction=self.prediction)

"""ComfyUI's denoiser ``D(x, sigma)`` (what its samplers call: the guided model turned into a denoised estimate) as a
program over static buffers, eager or replayed from one captured CUDA graph per shape.

Math (ComfyUI's ``comfy/model_sampling.py`` and ``samplers.cfg_function``; sigma_data 1):
- discrete models: model timestep = the index of the table's log sigma nearest ``log sigma``; model input
  ``x / sqrt(sigma^2 + 1)``; eps: ``D = x - out sigma``; v: ``D = x / (sigma^2 + 1) - out sigma / sqrt(sigma^2 + 1)``.
- flow (ComfyUI's CONST): model input ``x``; the DiT predicts the negative velocity, so ``D = x - (-out) sigma``
  (Z-Image); ``velocity``: the same for a DiT that predicts the velocity itself, ``D = x - out sigma`` (Qwen-Image).
- guidance: each side is turned into a denoised estimate, then ``D = D_u + (D_c - D_u) cfg``; ``cfg == 1`` runs the
  positive side only (ComfyUI's cfg-1 shortcut).
Invariant: ``step()`` reads only the program's buffers (x, sigma, cfg, the model's conditioning) and writes only its
buffers without host synchronisation, so eager steps and graph replays do the same work; a new call needs only
fresh ``x`` and ``sigma`` copied in. The state stays float32 whatever the model dtype (ComfyUI's ``.float()``).
"""
from __future__ import annotations

import collections
from typing import Callable, Optional

import torch

from ... import bridge
from ..loop import bound_run_ahead

PREDICTIONS = ("epsilon", "v_prediction", "flow", "velocity")


class DenoiserProgram:
    """Buffers + one guided denoiser evaluation; ``model`` is a ``model_calls`` object (UNet or DiT)."""

    def __init__(self, model, shape: tuple, prediction: str, log_sigmas: Optional[torch.Tensor], alloc):
        if prediction not in PREDICTIONS:
            raise ValueError(f"prediction={prediction!r}: expected one of {PREDICTIONS}")
        self.model = model
        self.prediction = prediction
        self.x = alloc("ksampler.x", shape, torch.float32)
        self.sigma = alloc("ksampler.sigma", (1,), torch.float32)
        self.cfg = alloc("ksampler.cfg", (), torch.float32)
        self.denoised = alloc("ksampler.denoised", shape, torch.float32)
        self.log_sigmas = None
        if log_sigmas is not None:  # discrete models: the model's log-sigma table, [n, 1], on the device
            self.log_sigmas = alloc("ksampler.log_sigmas", (log_sigmas.numel(), 1), torch.float32)
            self.log_sigmas.copy_(log_sigmas.reshape(-1, 1))

    def set_call(self, x: torch.Tensor, sigma: torch.Tensor) -> None:
        self.x.copy_(x)
        self.sigma.copy_(sigma.reshape(-1)[:1])

    def _denoised(self, out: torch.Tensor) -> torch.Tensor:
        x, s = self.x, self.sigma.view(1, 1, 1, 1)
        if self.prediction == "epsilon":
            return x - out * s
        if self.prediction == "v_prediction":
            return x * 1.0 / (s ** 2 + 1.0) - out * s / (s ** 2 + 1.0) ** 0.5
        if self.prediction == "velocity":
            return x - out * s
        return x - (-out) * s

    def step(self) -> None:
        s = self.sigma
        if self.prediction in ("flow", "velocity"):
            cond, uncond = self.model(self.x, s)
        else:
            timestep = (s.log() - self.log_sigmas).abs().argmin(dim=0)
            cond, uncond = self.model(self.x / (s.view(1, 1, 1, 1) ** 2 + 1.0) ** 0.5, timestep)
        d = self._denoised(cond)
        if uncond is not None:
            du = self._denoised(uncond)
            d = du + (d - du) * self.cfg
        self.denoised.copy_(d)


class Denoiser:
    """The callable the samplers get: ``denoiser(x, sigma) -> denoised`` (a new tensor each call).

    Interruption is checked before every model call; on the GPU the host runs at most two calls ahead of the
    device, so progress and interruption track the GPU within a step.
    """

    def __init__(self, program: DenoiserProgram, advance: Callable[[], None]):
        self.program = program
        self.advance = advance
        self.calls = 0
        self._cuda = program.x.device.type == "cuda"
        self._in_flight: collections.deque = collections.deque()

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        bridge.check_interrupted()
        self.program.set_call(x, sigma)
        self.advance()
        self.calls += 1
        out = self.program.denoised.clone()
        if self._cuda:
            bound_run_ahead(self._in_flight)
        return out

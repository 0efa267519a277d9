"""How the sampler calls the UNet: eagerly through ``engine.unet``, or through a ``torch.compile``d UNet.

Invariants
- The compiled module is ``torch.compile(parts.unet)`` (inductor, ``dynamic=False``): it shares every parameter
  with the engine's UNet, never copies or changes weights, and is cached once per ``ModelParts`` for the life of
  the process (weakly: a collected model drops it), so compilation (minutes for SDXL) is paid once; dynamo itself
  recompiles when a new shape or an attached adapter changes its guards.
- The compiled call mirrors ``LeanEngine.unet`` exactly (same arguments, first output) and, like it, must run
  inside ``engine.session("unet")`` so placement and adapters are in effect.
- The inductor mode comes from ``LEANDIFFUSION_COMPILE_MODE`` (default ``default``; ``max-autotune-no-cudagraphs``
  tunes kernels for longer). CUDA graphs are the graph runner's job, so inductor's own cudagraphs stay off.
"""
from __future__ import annotations

import logging
import os
import weakref
from typing import Any, Optional

import torch

from ..memory.engine import LeanEngine
from .program import UNetFn

logger = logging.getLogger(__name__)

ENV_COMPILE_MODE = "LEANDIFFUSION_COMPILE_MODE"
_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
_COMPILED: "weakref.WeakKeyDictionary[Any, torch.nn.Module]" = weakref.WeakKeyDictionary()


def eager_unet_fn(engine: LeanEngine) -> UNetFn:
    def call(x: torch.Tensor, t: torch.Tensor, context: torch.Tensor, added: Optional[dict]) -> torch.Tensor:
        return engine.unet(x, t, context, added)

    return call


def compile_mode() -> str:
    mode = os.environ.get(ENV_COMPILE_MODE, "default").strip() or "default"
    if mode not in _MODES:
        raise ValueError(f"{ENV_COMPILE_MODE}={mode!r}: expected one of {_MODES}")
    if mode in ("reduce-overhead", "max-autotune"):
        raise ValueError(f"{ENV_COMPILE_MODE}={mode!r} turns on inductor's own CUDA graphs, which would nest inside "
                         f"the sampler's; use 'default' or 'max-autotune-no-cudagraphs'")
    return mode


def compiled_unet(engine: LeanEngine) -> torch.nn.Module:
    """The process-wide compiled wrapper of ``engine.parts.unet`` (created on first use, compiled lazily)."""
    compiled = _COMPILED.get(engine.parts)
    if compiled is None:
        mode = compile_mode()
        compiled = torch.compile(engine.parts.unet, mode=mode, dynamic=False, fullgraph=False)
        _COMPILED[engine.parts] = compiled
        logger.info("torch.compile(mode=%r) wraps the UNet of %s; the first call of each shape compiles it",
                    mode, engine.parts.name or "the model")
    return compiled


def compiled_unet_fn(engine: LeanEngine) -> UNetFn:
    """A call with ``LeanEngine.unet``'s contract through the compiled UNet."""
    module = compiled_unet(engine)

    def call(x: torch.Tensor, t: torch.Tensor, context: torch.Tensor, added: Optional[dict]) -> torch.Tensor:
        kwargs = {"added_cond_kwargs": added} if added else {}
        return module(x, t, encoder_hidden_states=context, return_dict=False, **kwargs)[0]

    return call

"""How the sampler calls the UNet: eagerly through ``engine.unet``, or through a ``torch.compile``d UNet.

Invariants
- The compiled module is ``torch.compile(parts.unet)`` (inductor, ``dynamic=False``): it shares every parameter
  with the engine's UNet, never copies or changes weights, and is cached once per ``ModelParts`` for the life of
  the process (weakly: a collected model drops it), so compilation (minutes for SDXL) is paid once; dynamo itself
  recompiles when a new shape or an attached adapter changes its guards.
- The compiled call mirrors ``LeanEngine.unet`` exactly (same arguments, first output) and, like it, must run
  inside ``engine.session("unet")`` so placement and adapters are in effect.
- The inductor settings come from ``LEANDIFFUSION_COMPILE_MODE``, passed per call (never through inductor's global
  config): ``default`` (inductor's default mode plus ``conv_1x1_as_mm``, which turns the UNet's many 1x1
  convolutions into matmuls), ``plain`` (inductor's default mode alone), ``tuned`` (adds coordinate-descent tuning
  of the generated kernels; longer compile) and ``max-autotune-no-cudagraphs`` (benchmarks GEMM/conv templates;
  much longer compile). CUDA graphs are the graph runner's job, so inductor's own cudagraphs stay off.
- What is compiled comes from ``LEANDIFFUSION_COMPILE_SCOPE``: ``auto`` (the default, below), ``full`` (the whole
  UNet, one dynamo frame) or a regional scope (``blocks``: every ``BasicTransformerBlock``; ``blocks+resnets``: those and every
  ``ResnetBlock2D``; ``transformers+resnets``: every ``Transformer2DModel`` and ``ResnetBlock2D``). Regional
  compilation (the technique of diffusers' ``compile_repeated_blocks``) compiles one graph per distinct block shape
  and reuses it for every block of that shape - dynamo guards on the block's type and tensor shapes, not its
  identity - so SDXL's ~100 s full compile becomes a few tens of seconds, while the glue between blocks stays eager
  (inside the sampler's CUDA graph, eager glue costs no launch overhead). Unlike diffusers' in-place
  ``module.compile()``, the compiled block calls are installed only for the duration of a compiled UNet call
  (``nn.Module._compiled_call_impl``, restored afterwards), so ``none`` and ``cuda_graph`` keep running the eager
  blocks of the same modules. Blocks of one class share dynamo's cache, so the recompile limit is raised for the
  call (one entry per distinct block shape and batch size).
- ``auto`` compiles the whole UNet unless it has more than ``REGIONAL_ABOVE_BLOCKS`` transformer blocks, and then
  ``blocks+resnets``. Why: a large UNet's whole graph takes long to compile and gains little over its blocks
  compiled alone (SDXL: the regional first run is about a third of the full one, for a loop ~2% slower), and a user
  pays the compile at every server start and new shape; a small UNet's whole graph compiles about as fast as its
  regions and fuses across block boundaries (SD1.5: ``full`` gives the fastest loop). Among regional scopes,
  ``blocks+resnets`` compiles faster than ``transformers+resnets`` for a loop about as fast, while ``blocks`` alone
  leaves too much eager.
"""
from __future__ import annotations

import contextlib
import logging
import os
import weakref
from typing import Any, Optional

import torch

from ..memory.engine import LeanEngine
from .program import UNetFn

logger = logging.getLogger(__name__)

ENV_COMPILE_MODE = "LEANDIFFUSION_COMPILE_MODE"
_PRESETS: dict[str, dict] = {
    "default": {"options": {"conv_1x1_as_mm": True}},
    "plain": {"mode": "default"},
    "tuned": {"options": {"conv_1x1_as_mm": True, "coordinate_descent_tuning": True, "epilogue_fusion": False}},
    "max-autotune-no-cudagraphs": {"mode": "max-autotune-no-cudagraphs"},
}
ENV_COMPILE_SCOPE = "LEANDIFFUSION_COMPILE_SCOPE"
DEFAULT_SCOPE = "auto"
REGIONAL_ABOVE_BLOCKS = 32
AUTO_REGIONAL_SCOPE = "blocks+resnets"
_SCOPES: dict[str, Optional[tuple[str, ...]]] = {
    "auto": None,  # resolved per UNet by ``resolved_scope``
    "full": None,
    "blocks": ("BasicTransformerBlock",),
    "blocks+resnets": ("BasicTransformerBlock", "ResnetBlock2D"),
    "transformers+resnets": ("Transformer2DModel", "ResnetBlock2D"),
}
REGIONAL_RECOMPILE_LIMIT = 64
_COMPILED: "weakref.WeakKeyDictionary[Any, torch.nn.Module]" = weakref.WeakKeyDictionary()


def eager_unet_fn(engine: LeanEngine) -> UNetFn:
    def call(x: torch.Tensor, t: torch.Tensor, context: torch.Tensor, added: Optional[dict]) -> torch.Tensor:
        return engine.unet(x, t, context, added)

    return call


def compile_mode() -> str:
    """The ``LEANDIFFUSION_COMPILE_MODE`` preset (default ``default``)."""
    mode = os.environ.get(ENV_COMPILE_MODE, "default").strip() or "default"
    if mode not in _PRESETS:
        raise ValueError(f"{ENV_COMPILE_MODE}={mode!r}: expected one of {tuple(_PRESETS)} (inductor's own "
                         f"CUDA-graph modes would nest inside the sampler's graphs)")
    return mode


def compile_options(mode: str) -> dict:
    """``torch.compile`` keyword arguments of a ``LEANDIFFUSION_COMPILE_MODE`` preset (a fresh copy)."""
    preset = _PRESETS[mode]
    return {k: (dict(v) if isinstance(v, dict) else v) for k, v in preset.items()}


def compile_scope() -> str:
    """The ``LEANDIFFUSION_COMPILE_SCOPE`` choice (default ``DEFAULT_SCOPE``)."""
    scope = os.environ.get(ENV_COMPILE_SCOPE, DEFAULT_SCOPE).strip() or DEFAULT_SCOPE
    if scope not in _SCOPES:
        raise ValueError(f"{ENV_COMPILE_SCOPE}={scope!r}: expected one of {tuple(_SCOPES)}")
    return scope


def recompile_limit_raised(limit: int):
    """``torch._dynamo.config.patch`` setting dynamo's per-frame recompile limit to ``limit`` for a block.

    The option is ``recompile_limit`` from PyTorch 2.7 on and ``cache_size_limit`` before it (2.7 keeps the old name
    as an alias; patching the new name on 2.3-2.6 raised a bare ``KeyError`` from every regional compiled call).
    """
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    return config.patch(**{name: limit})


class RegionallyCompiledUNet:
    """Calls the UNet with each region module's compiled call installed for that call only (see module docstring).

    A region is a module whose class is in ``class_names`` and that has no region ancestor (nested regions would
    compile twice)."""

    def __init__(self, unet: torch.nn.Module, class_names: tuple[str, ...], **compile_kwargs):
        self.unet = unet
        self.regions = compiled_regions(unet, class_names, **compile_kwargs)
        if not self.regions:
            raise ValueError(f"regional compilation: the UNet ({type(unet).__name__}) has no {class_names} module; "
                             f"set {ENV_COMPILE_SCOPE}=full")

    def __call__(self, *args, **kwargs):
        with regions_installed(self.regions):
            return self.unet(*args, **kwargs)


def compiled_regions(module: torch.nn.Module, class_names: tuple[str, ...], **compile_kwargs) -> list:
    """``(region, compiled call)`` for every module of ``module`` whose class is in ``class_names`` and that has no
    region ancestor (nested regions would compile twice); compiled lazily, at the first call."""
    regions: list[tuple[torch.nn.Module, Any]] = []
    prefixes: list[str] = []
    for name, sub in module.named_modules():
        if type(sub).__name__ not in class_names or any(name.startswith(p) for p in prefixes):
            continue
        prefixes.append(name + ".")
        regions.append((sub, torch.compile(sub._call_impl, dynamic=False, **compile_kwargs)))
    return regions


@contextlib.contextmanager
def regions_installed(regions: list):
    """Each region's compiled call installed (``nn.Module._compiled_call_impl``) for the block only, with dynamo's
    recompile limit raised (one cache entry per distinct block shape and batch); the previous calls restored after."""
    previous = [module._compiled_call_impl for module, _ in regions]
    try:
        for module, fn in regions:
            module._compiled_call_impl = fn
        with recompile_limit_raised(REGIONAL_RECOMPILE_LIMIT):
            yield
    finally:
        for (module, _), prev in zip(regions, previous):
            module._compiled_call_impl = prev


def resolved_scope(unet: torch.nn.Module, scope: str) -> str:
    """``scope`` with ``auto`` replaced by ``full`` or ``AUTO_REGIONAL_SCOPE`` for this UNet (module docstring)."""
    if scope != "auto":
        return scope
    blocks = sum(1 for m in unet.modules() if type(m).__name__ == "BasicTransformerBlock")
    return AUTO_REGIONAL_SCOPE if blocks > REGIONAL_ABOVE_BLOCKS else "full"


def compiled_unet(engine: LeanEngine):
    """The process-wide compiled wrapper of ``engine.parts.unet`` (created on first use, compiled lazily)."""
    compiled = _COMPILED.get(engine.parts)
    if compiled is None:
        mode = compile_mode()
        scope = resolved_scope(engine.parts.unet, compile_scope())
        if _SCOPES[scope] is None:
            compiled = torch.compile(engine.parts.unet, dynamic=False, fullgraph=False, **_PRESETS[mode])
        else:
            compiled = RegionallyCompiledUNet(engine.parts.unet, _SCOPES[scope], **_PRESETS[mode])
        _COMPILED[engine.parts] = compiled
        logger.info("torch.compile (%s: %s, scope %s) wraps the UNet of %s; the first call of each shape compiles it",
                    mode, _PRESETS[mode], scope, engine.parts.name or "the model")
    return compiled


def compiled_unet_fn(engine: LeanEngine) -> UNetFn:
    """A call with ``LeanEngine.unet``'s contract through the compiled UNet."""
    module = compiled_unet(engine)

    def call(x: torch.Tensor, t: torch.Tensor, context: torch.Tensor, added: Optional[dict]) -> torch.Tensor:
        kwargs = {"added_cond_kwargs": added} if added else {}
        return module(x, t, encoder_hidden_states=context, return_dict=False, **kwargs)[0]

    return call


def compile_errors() -> tuple:
    """The exception types that mean "torch.compile failed" (dynamo's and inductor's, raised at the first call)."""
    try:
        from torch._dynamo.exc import TorchDynamoException
    except ImportError:  # pragma: no cover - torch without dynamo
        return ()
    return (TorchDynamoException,)


def compile_failure(exc: BaseException) -> str:
    """One line saying why torch.compile failed: the backend's own error (dynamo wraps it in paragraphs that end
    in advice to set ``suppress_errors``, which would hide the failure)."""
    inner = getattr(exc, "inner_exception", None) or exc
    lines = [ln.strip() for ln in str(inner).splitlines() if ln.strip()]
    text = f"{type(inner).__name__}: {lines[0] if lines else 'no message'}"
    return text if len(text) <= 200 else text[:197] + "..."

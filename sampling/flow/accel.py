"""How the flow program calls the DiT: eagerly, or with every transformer block compiled by ``torch.compile``.

Invariant: both calls run ``dit_forward`` on the engine's own modules (weights shared, never copied). The compiled
call installs each ``ZImageTransformerBlock``'s compiled ``_call_impl`` only for the duration of the call
(``compile.regions_installed``, the regional compilation the UNet uses too), so eager runs of the same modules
stay eager; blocks of one shape share dynamo's cache entry, so compiling costs one block's graph, not 34.
Compiled wrappers are cached per model.
"""
from __future__ import annotations

import logging
import weakref
from typing import Any

import torch

from ...memory.engine import LeanEngine
from ..compile import compile_mode, compile_options, compiled_regions, regions_installed
from .dit_forward import dit_forward

logger = logging.getLogger(__name__)

BLOCK_CLASSES = ("ZImageTransformerBlock",)
_COMPILED: "weakref.WeakKeyDictionary[Any, list]" = weakref.WeakKeyDictionary()


def eager_dit_fn(dit: torch.nn.Module):
    def call(x, t, layout, grid):
        return dit_forward(dit, x, t, layout, grid)

    return call


def _regions(engine: LeanEngine) -> list:
    regions = _COMPILED.get(engine.parts)
    if regions is None:
        options = compile_options(compile_mode())
        regions = compiled_regions(engine.parts.unet, BLOCK_CLASSES, **options)
        _COMPILED[engine.parts] = regions
        logger.info("torch.compile wraps the %d DiT blocks of %s; the first call of each shape compiles them",
                    len(regions), engine.parts.name or "the model")
    return regions


def compiled_dit_fn(engine: LeanEngine):
    regions = _regions(engine)
    dit = engine.parts.unet

    def call(x, t, layout, grid):
        with regions_installed(regions):
            return dit_forward(dit, x, t, layout, grid)

    return call

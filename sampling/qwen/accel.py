"""How the Qwen-Image step program calls the transformer: eagerly, or with every ``QwenImageTransformerBlock``
compiled by ``torch.compile``.

Invariant: both calls run ``forward.qwen_forward`` on the engine's own modules (weights shared, never copied). The
compiled call installs each block's compiled ``_call_impl`` only for the duration of the call
(``compile.regions_installed``, the regional compilation diffusers names ``_repeated_blocks`` for this model), so
eager runs of the same modules stay eager; the 60 blocks share one shape and so one dynamo cache entry, and
compiling costs one block's graph. The glue between blocks stays eager: inside the step's CUDA graph it costs no
launch overhead. Compiled wrappers are cached per model.
"""
from __future__ import annotations

import logging
import weakref
from typing import Any

from ...memory.engine import LeanEngine
from ..compile import compile_mode, compile_options, compiled_regions, regions_installed
from .forward import qwen_forward

logger = logging.getLogger(__name__)

BLOCK_CLASSES = ("QwenImageTransformerBlock",)
_COMPILED: "weakref.WeakKeyDictionary[Any, list]" = weakref.WeakKeyDictionary()


def eager_forward_fn(dit):
    def call(x, t, layout):
        return qwen_forward(dit, x, t, layout)

    return call


def compiled_forward_fn(engine: LeanEngine):
    regions = _COMPILED.get(engine.parts)
    if regions is None:
        regions = compiled_regions(engine.parts.unet, BLOCK_CLASSES, **compile_options(compile_mode()))
        if not regions:
            raise ValueError(f"acceleration='compile+cuda_graph': the transformer ({type(engine.parts.unet).__name__})"
                             f" has no {BLOCK_CLASSES[0]}; use acceleration='cuda_graph'")
        _COMPILED[engine.parts] = regions
        logger.info("torch.compile wraps the %d transformer blocks of %s; the first call of each shape compiles "
                    "them", len(regions), engine.parts.name or "the model")
    dit = engine.parts.unet

    def call(x, t, layout):
        with regions_installed(regions):
            return qwen_forward(dit, x, t, layout)

    return call

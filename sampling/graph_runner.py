"""CUDA-graph runner: capture one denoising step (UNet + CFG + DDIM update) once per key, replay it every step.

Invariants
- A captured step reads and writes only its ``StepProgram``'s static buffers; per step the loop copies the
  timestep, the coefficients (guidance scale included) and the eta noise into device buffers, then replays. So
  changing ``cfg``, ``eta``'s value, the step count or the seed never recaptures.
- The key holds everything the captured kernels depend on: latent shape, dtypes, device, the CFG layout (calls x
  copies, context and pooled shapes), whether eta noise is read, whether the UNet is compiled, the placement's
  name and ``epoch`` (bumped when it re-placed the weights), every adapter's ``graph_key`` (LoRA strengths are
  *not* part of it: they live in persistent device tensors the adapter writes at attach time) and a fingerprint of the UNet's parameter/buffer addresses (moved weights invalidate the
  graph instead of replaying reads of freed memory). A different key captures again; the same key replays. A
  cached graph keeps its view's adapters alive, so a LoRA binding (whose buffers the graph reads) is the one any
  later view with the same key gets, never a new one at other addresses.
- Capture happens inside ``engine.session("unet")`` after a warm-up on a side stream (cuBLAS/cuDNN/Triton/
  inductor initialisation must not happen during capture). Graphs are cached per ``ModelParts`` (weakly: a
  collected model drops its graphs), at most ``LEANDIFFUSION_MAX_GRAPHS`` (default 2) per model, least recently
  used evicted. A failed capture leaves nothing cached. Under a hard VRAM budget a text or VAE stage may drop a
  model's graphs to make room (``memory/budget.py``); the next run captures again (a DiT's runs of that key go eager
  instead: ``was_released``, read by ``dit_steps.prepare_dit_steps``).

The capture mechanism is a small backend (``CudaGraphBackend``) so the key/cache logic is testable on the CPU with
a stand-in backend; torch's ``torch.cuda.CUDAGraph`` does the real work.
"""
from __future__ import annotations

import logging
import os
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Optional

import torch

from ..memory.budget import register_device_cache
from ..memory.cap import forget_library_workspaces
from ..memory.engine import LeanEngine
from .program import StepProgram
from .shared_streams import shared_stream

logger = logging.getLogger(__name__)

ENV_MAX_GRAPHS = "LEANDIFFUSION_MAX_GRAPHS"


class CudaGraphBackend:
    """Captures a callable into a ``torch.cuda.CUDAGraph`` (after ``warmup`` eager runs on a side stream).

    A warm-up or capture that raises (out of memory, say) leaves nothing behind for the caller's next work (the
    sampler's retry or eager fallback, which reuses the same buffers): the caller's stream is ordered after every
    warm-up kernel already enqueued, and cuBLAS holds no workspace from the failed graph's pool (it would keep
    that pool reserved).
    """

    name = "cuda"

    def __init__(self, warmup: int = 2):
        self.warmup = warmup

    def capture(self, fn: Callable[[], None], device: torch.device) -> Callable[[], None]:
        current = torch.cuda.current_stream(device)
        side = shared_stream(device, "capture-warmup")  # one per device: see shared_streams.py
        side.wait_stream(current)
        try:
            with torch.cuda.stream(side):
                for _ in range(self.warmup):
                    fn()
        finally:
            current.wait_stream(side)  # also after a failed warm-up: its queued kernels write the step's buffers
        forget_library_workspaces(device)  # this graph's cuBLAS workspace must come from its own pool (memory/cap.py)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: CUDA work of other threads (ComfyUI's previews, say) must not invalidate the capture
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                fn()
        except BaseException:
            forget_library_workspaces(device)  # a workspace taken from the failed graph's pool would pin that pool
            raise
        return graph.replay


def adapter_key(adapter: Any) -> Hashable:
    """An adapter's ``graph_key`` (structure, not strength); its identity when it declares none."""
    key = getattr(adapter, "graph_key", None)
    return ("id", id(adapter)) if key is None else key


def weights_fingerprint(module: torch.nn.Module) -> int:
    """Hash of every parameter's and buffer's (data_ptr, shape, dtype): changes when weights move or are replaced."""
    return hash(tuple((t.data_ptr(), tuple(t.shape), t.dtype) for t in
                      list(module.parameters()) + list(module.buffers())))


def graph_key(engine: LeanEngine, program_key: Hashable, compiled: bool) -> Hashable:
    placement = engine.placement
    return (program_key, compiled, str(engine.device), placement.name, placement.epoch,
            tuple(adapter_key(a) for a in engine.adapters), weights_fingerprint(engine.parts.unet))


@dataclass(eq=False)
class CapturedStep:
    program: StepProgram
    replay: Callable[[], None]
    adapters: tuple = ()  # every adapter of the captured view, kept alive while its graph is cached (step_for)
    replays: int = 0
    device: Optional[torch.device] = None


@dataclass(eq=False)
class _PartsCache:
    graphs: "OrderedDict[Hashable, CapturedStep]" = field(default_factory=OrderedDict)
    captures: int = 0


class GraphRunner:
    """Cache of captured steps per model. ``step_for`` returns a ready program and its replay function."""

    def __init__(self, backend: Any = None, max_graphs: Optional[int] = None):
        self.backend = backend if backend is not None else CudaGraphBackend()
        if max_graphs is None:
            text = os.environ.get(ENV_MAX_GRAPHS, "").strip() or "2"
            max_graphs = int(text) if text.isdigit() else 0
            if max_graphs < 1:
                raise ValueError(f"{ENV_MAX_GRAPHS}={text!r}: expected a positive int (CUDA graphs cached per model, "
                                 f"default 2); set it to 1 or more, or unset it")
        if max_graphs < 1:
            raise ValueError(f"max_graphs={max_graphs}: expected >= 1 (set {ENV_MAX_GRAPHS} to a positive int)")
        self.max_graphs = max_graphs
        self._cache: "weakref.WeakKeyDictionary[Any, _PartsCache]" = weakref.WeakKeyDictionary()
        # per model, the keys of graphs a budgeted stage dropped (``release_device_memory``; ``was_released``)
        self._released: "weakref.WeakKeyDictionary[Any, set]" = weakref.WeakKeyDictionary()
        register_device_cache(self)  # a budgeted stage may need the graphs' pools back (memory/budget.py)

    def captures(self, engine: LeanEngine) -> int:
        """How many captures this runner has made for the engine's model (tests use it)."""
        entry = self._cache.get(engine.parts)
        return 0 if entry is None else entry.captures

    def cached_keys(self, engine: LeanEngine) -> list:
        entry = self._cache.get(engine.parts)
        return [] if entry is None else list(entry.graphs)

    def clear(self, engine: Optional[LeanEngine] = None) -> None:
        """Drop cached graphs (of one model, or all): frees their static buffers and graph memory pools."""
        if engine is None:
            dropped = [entry for entry in self._cache.values() if entry.graphs]
            self._cache = weakref.WeakKeyDictionary()
            self._released = weakref.WeakKeyDictionary()
        else:
            dropped = [self._cache.pop(engine.parts, None)]
            self._released.pop(engine.parts, None)
        self._after_drop(dropped)

    def _after_drop(self, dropped: list) -> None:
        """Let the dropped graphs' pools go: cuBLAS may still reference a workspace in the last one captured."""
        devices = {e.device for entry in dropped if entry is not None for e in entry.graphs.values()}
        for entry in dropped:
            if entry is not None:
                entry.graphs.clear()
        for device in devices:
            forget_library_workspaces(device)

    def release_device_memory(self, parts: Any) -> None:
        """Drop the graphs cached for the model ``parts`` (``memory.budget``'s device-cache protocol), remembering
        their keys (``was_released``)."""
        entry = self._cache.pop(parts, None)
        if entry is not None and entry.graphs:
            self._released.setdefault(parts, set()).update(entry.graphs)
        self._after_drop([entry])

    def was_released(self, engine: LeanEngine, key: Hashable, compiled: bool = False) -> bool:
        """Whether this runner captured the step ``key`` of the engine's model and a budgeted stage then dropped it:
        under that budget the next capture of it would be lost at the same stage again."""
        return graph_key(engine, key, compiled) in self._released.get(engine.parts, ())

    def step_for(self, engine: LeanEngine, key: Hashable, build: Callable[[], StepProgram],
                 prepare: Callable[[StepProgram], None], compiled: bool = False) -> CapturedStep:
        """The captured step for ``key`` (capturing it when absent). Call inside ``engine.session("unet")``.

        ``prepare(program)`` loads the run's inputs and the first step's values; it runs before a capture (the
        warm-up executes real steps) and again after it, so the buffers always hold the run's start state.
        """
        full_key = graph_key(engine, key, compiled)
        entry = self._cache.setdefault(engine.parts, _PartsCache())
        captured = entry.graphs.get(full_key)
        if captured is not None:
            entry.graphs.move_to_end(full_key)
            prepare(captured.program)
            return captured
        while len(entry.graphs) >= self.max_graphs:  # evict before capturing: its memory is needed now
            old_key, _ = entry.graphs.popitem(last=False)
            logger.info("evicting a cached CUDA graph of %s (cache holds %d)", engine.parts.name or "model",
                        self.max_graphs)
        program = build()
        prepare(program)
        t0 = time.perf_counter()
        replay = self.backend.capture(program.step, engine.device)  # raises -> nothing cached
        elapsed = time.perf_counter() - t0
        if compiled:
            logger.info("torch.compile + CUDA-graph capture of the UNet step took %.1f s (first run of this shape "
                        "in this process; later runs reuse it)", elapsed)
        else:
            logger.info("CUDA-graph capture of the UNet step took %.2f s", elapsed)
        prepare(program)
        # Invariant: a cache hit replays reads of the very buffers attached at capture. An adapter's graph_key names
        # its structure only (a LoRA binding's key), and the buffers belong to the binding object, which LoRA views
        # share through a weak map (lora.adapter). Keeping every adapter (hence its binding) alive while the graph
        # is cached means a view injected later with the same key gets this binding, never a new one elsewhere
        # (id()-keyed adapters need it too: their id must not be reused while the graph lives).
        captured = CapturedStep(program, replay, tuple(engine.adapters), device=torch.device(engine.device))
        entry.graphs[full_key] = captured
        entry.captures += 1
        return captured


_DEFAULT: Optional[GraphRunner] = None


def default_runner() -> GraphRunner:
    """The process-wide runner the sampler uses (created on first use)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = GraphRunner()
    return _DEFAULT

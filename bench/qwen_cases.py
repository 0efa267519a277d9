"""The qwen suite's cases, each over the ONE set of full-size weights the process built (``SharedWeights``).

Invariants
- Weights are built once (40 GB of DiT, 16 GB of text encoder): every case runs on the same module objects, which
  move between the device and the host, never copied, except the fp8 DiT (quantized in place from one copy made on
  the device; ``fp8_e4m3fn`` and ``fp8_e4m3fn_fast`` store the same bytes, so one copy serves both).
- Ours is the node level: ``memory.load.build_engine`` (the loader's policy, ``weight_dtype``, budget) over the
  modules our loader would hold (the workload's ``ours_parts``: the Qwen2.5-VL language model only for text-to-image,
  the whole ``Qwen2_5_VLModel`` for the edit), sampled by the workload's node. A ``full``
  engine is dropped with its graphs (its modules stay where they are); a ``stream`` engine's placement is removed
  (hooks off, modules back on the host) before the next case.
- Capped cases (``stream``, the peer's group offload) start with every module on the host and run inside
  ``memory.cap.allocator_cap`` at the budget: a side that needs more fails with out of memory, recorded, instead of
  passing quietly; their peak is ``max_memory_reserved`` read inside the cap.
- A case the pack cannot run yet raises ``Unavailable``: a loader/sampler refusal that says "not supported yet", or
  (on CUDA) an accelerated run that captured no CUDA graph (the loop ran eager). Its targets are then recorded as
  FAIL with the reason (``qwen_targets``); any other error propagates.
- Timing: ``warmup`` untimed runs (capture and compile for ours), then the median of ``repeat`` (CUDA events); the
  latent is the last timed run's.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import os
from dataclasses import dataclass
from typing import Callable, Optional
from unittest import mock

import torch

from ..memory.packed_weights import ENV as PACKED_ENV
from .harness import BenchContext, peak_memory, time_ms
from .qwen_models import Workload
from .zimage_budget import free_device

logger = logging.getLogger(__name__)

GiB = 2 ** 30
NOT_YET = "not supported yet"


class Unavailable(RuntimeError):
    """A case the pack cannot run yet (the reason is the message)."""


@dataclass
class Run:
    """One measured case: median time, peak reserved memory inside the case, the raw latent (CPU float32)."""

    ms: float
    peak_gb: float
    latent: torch.Tensor
    notes: str = ""


def unavailable_reason(exc: BaseException) -> Optional[str]:
    """The reason when ``exc`` says the pack cannot run the case yet; None for a real error."""
    if isinstance(exc, Unavailable) or (isinstance(exc, (ValueError, NotImplementedError)) and NOT_YET in str(exc)):
        return f"unavailable: {str(exc).splitlines()[0][:300]}"
    return None


class SharedWeights:
    """The process's one copy of the weights (a components dict with the whole Qwen2.5-VL) and its fp8 DiT."""

    def __init__(self, components: dict, device: torch.device, dtype: str):
        self.components = components
        self.device = device
        self.dtype = dtype  # "bf16" on CUDA, "fp32" for the CPU smoke run
        self._fp8_dit: Optional[torch.nn.Module] = None

    def modules(self) -> list:
        c = self.components
        return [c["transformer"], c["text_encoder"], c["vae"]] + ([self._fp8_dit] if self._fp8_dit is not None else [])

    def place(self, device, *modules: torch.nn.Module) -> None:
        for m in modules:
            m.to(device)
        free_device()

    def all_to_host(self) -> None:
        self.place("cpu", *self.modules())

    def for_peer(self) -> dict:
        """Every module of the peer on the device (the resident peer reads the vision tower's and LM head's
        weights too: its text encoder's forward computes logits)."""
        c = self.components
        self.place(self.device, c["transformer"], c["text_encoder"], c["vae"])
        return c

    def for_ours(self, w: Workload, dit: Optional[torch.nn.Module] = None) -> dict:
        """Our loader's components for ``w``; the modules only the peer uses go to the host, out of our peak."""
        self.place("cpu", *w.peer_only(self.components["text_encoder"]))
        return w.ours_parts(self.components, dit)

    def fp8_dit(self) -> torch.nn.Module:
        """A copy of the DiT made on the device (quantized in place by the first fp8 engine built over it)."""
        if self._fp8_dit is None:
            dit = self.components["transformer"]
            self.place(self.device, dit)
            self._fp8_dit = copy.deepcopy(dit)
            free_device()
        return self._fp8_dit

    def drop_fp8_dit(self) -> None:
        self._fp8_dit = None
        free_device()


def _timed(ctx: BenchContext, fn: Callable[[], torch.Tensor], warmup: int, repeat: int,
           cap_gb: Optional[float] = None) -> tuple[float, float, torch.Tensor]:
    """(median ms, peak reserved GB, the last output) of ``fn``, inside the allocator cap when ``cap_gb``."""
    import contextlib

    from ..memory.cap import allocator_cap

    out: list = [None]

    def call() -> None:
        out[0] = fn()

    cap = allocator_cap(ctx.device, int(cap_gb * GiB)) if cap_gb is not None else contextlib.nullcontext()
    with cap, peak_memory(ctx.device) as mem:
        ms = time_ms(call, warmup=warmup, repeat=repeat, device=ctx.device)
    return ms, mem["reserved_gb"], out[0]


def _check_accelerated(ctx: BenchContext, engine, acceleration: str) -> None:
    from ..sampling.graph_runner import default_runner

    if ctx.device.type == "cuda" and acceleration != "none" and default_runner().captures(engine) == 0:
        raise Unavailable(f"acceleration={acceleration!r} captured no CUDA graph for the Qwen-Image engine: the loop "
                          f"ran eager ({acceleration} {NOT_YET} for qwen_image)")


def _engine(weights: SharedWeights, components: dict, policy: str, storage: str, budget_gb: float = 4.0):
    from ..memory.engine import parts_from_components
    from ..memory.load import build_engine

    return build_engine(parts_from_components(components, name="qwen-image-random"), policy,
                        vram_budget_gb=budget_gb, weight_dtype=storage, vae_dtype=weights.dtype,
                        device=weights.device)


def _release(engine, remove: bool) -> None:
    from ..sampling.graph_runner import default_runner

    default_runner().clear(engine)
    if remove:
        engine.placement.remove()
    free_device()


def peer_resident(ctx: BenchContext, weights: SharedWeights, w: Workload, warmup: int, repeat: int) -> Run:
    """The diffusers pipeline, every module resident, its default attention (SDPA)."""
    pipe = w.pipeline(weights.for_peer())
    ms, peak, packed = _timed(ctx, w.peer_run(pipe), warmup, repeat)
    latent = w.peer_raw(pipe, packed)
    del pipe, packed
    free_device()
    return Run(ms, peak, latent)


def ours_resident(ctx: BenchContext, weights: SharedWeights, w: Workload, storage: str, accelerations: list,
                  warmup: int, repeat: int, dit: Optional[torch.nn.Module] = None) -> dict:
    """``{acceleration: Run or reason}`` for one ``full`` engine with ``storage`` weights (``dit`` replaces the
    shared DiT, e.g. the fp8 copy). An acceleration that is not available is its reason; the others still run."""
    engine = _engine(weights, weights.for_ours(w, dit), "full", storage)
    out = {}
    try:
        for acceleration in accelerations:
            try:
                ms, peak, latent = _timed(ctx, w.ours_run(engine, acceleration), warmup, repeat)
                _check_accelerated(ctx, engine, acceleration)
                out[acceleration] = Run(ms, peak, latent.float().cpu(), notes=f"full policy, {storage}")
            except Exception as exc:
                reason = unavailable_reason(exc)
                if reason is None:
                    raise
                out[acceleration] = reason
            finally:
                _release(engine, remove=False)
    finally:
        del engine
        free_device()
    return out


def ours_stream(ctx: BenchContext, weights: SharedWeights, w: Workload, budget_gb: float, storage: str,
                acceleration: str, warmup: int, repeat: int, dit: Optional[torch.nn.Module] = None,
                packed: bool = True) -> Run:
    """Our ``stream`` policy at ``budget_gb`` (every module starts on the host; allocator capped at the budget);
    ``packed=False`` loads it with packed copies off (``LEANDIFFUSION_PACKED_STREAMING=off``: plain copies)."""
    weights.all_to_host()
    with _packed_streaming(packed):
        engine = _engine(weights, weights.for_ours(w, dit), "stream", storage, budget_gb)
    try:
        logger.info("%s", engine.placement.report())
        ms, peak, latent = _timed(ctx, w.ours_run(engine, acceleration), warmup, repeat, cap_gb=budget_gb)
        _check_accelerated(ctx, engine, acceleration)
        copies = "" if packed else ", plain copies"
        return Run(ms, peak, latent.float().cpu(), notes=f"stream {budget_gb:g} GB, {storage}, {acceleration}{copies}")
    finally:
        _release(engine, remove=True)
        del engine


def _packed_streaming(on: bool):
    """Packed copies as the loader decides (``on``) or off, for the load inside; the environment is restored after."""
    return contextlib.nullcontext() if on else mock.patch.dict(os.environ, {PACKED_ENV: "off"})


def peer_offload(ctx: BenchContext, weights: SharedWeights, w: Workload, budget_gb: float, warmup: int,
                 repeat: int) -> Run:
    """The pipeline with diffusers' leaf-level group offload (CUDA streams, record_stream) on the transformer and
    the text encoder, the VAE resident, under the same allocator cap. Leaves the hooks on the modules: run last."""
    from diffusers.hooks import apply_group_offloading

    weights.all_to_host()
    pipe = w.pipeline(weights.components)
    cuda = ctx.device.type == "cuda"
    if cuda:  # pinned in place, one tensor at a time: group offload then pins nothing twice (host RAM holds one copy)
        for module in (pipe.transformer, pipe.text_encoder):
            for t in list(module.parameters()) + list(module.buffers()):
                t.data = t.data.pin_memory()
    for module in (pipe.transformer, pipe.text_encoder):
        apply_group_offloading(module, onload_device=ctx.device, offload_device=torch.device("cpu"),
                               offload_type="leaf_level", use_stream=cuda, record_stream=cuda)
    pipe.vae.to(ctx.device)
    ms, peak, packed = _timed(ctx, w.peer_run(pipe), warmup, repeat, cap_gb=budget_gb)
    latent = w.peer_raw(pipe, packed)
    del pipe, packed
    free_device()
    return Run(ms, peak, latent, notes=f"leaf group offload + streams under a {budget_gb:g} GiB cap")

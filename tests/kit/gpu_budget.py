"""GPU budget checks shared by the stream-policy tests: full-size components built on the device moved to the host as
``ModelParts``, the allocator capped at a budget, the peak read back over what the process held before, an engine
dropped without leftovers, relative distance of two results.

Invariant: ``capped_allocator`` restores the process's previous memory fraction however its body ends, so one
test's cap never limits the next.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

GiB = 2 ** 30


def host_parts(components: dict, name: str):
    """``ModelParts`` over ``components`` (built on the device, where random filling is fast) with the denoiser, the
    text encoder and the VAE moved to the host and the device's cache emptied: the policies place from there."""
    from ...memory.engine import parts_from_components

    for key in ("transformer", "text_encoder", "vae"):
        components[key] = components[key].to("cpu")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return parts_from_components(components, name=name)


@contextlib.contextmanager
def bf16_stream_engine(parts, budget_gb: float, working_shape: tuple) -> Iterator[tuple]:
    """``(engine, base)``: ``parts`` under ``stream`` at ``budget_gb`` in bf16 and what the process held (reserved)
    before the engine existed; the engine is dropped on exit."""
    from ...memory.load import build_engine

    base = reserved_now()
    engine = build_engine(parts, "stream", budget_gb, weight_dtype="bf16", vae_dtype="bf16", device="cuda",
                          working_shape=working_shape)
    try:
        yield engine, base
    finally:
        drop_engine(engine)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs difference relative to ``b``'s largest magnitude."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def drop_engine(engine) -> None:
    """Release the engine's captured graphs and device buffers, remove its placement, empty the cache."""
    engine.placement.release()
    engine.placement.remove()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def reserved_now() -> int:
    """What the process holds reserved once cached blocks are returned."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


@contextlib.contextmanager
def capped_allocator(budget_gb: float, base: int) -> Iterator[None]:
    """The caching allocator capped at ``budget_gb`` plus ``base`` bytes, peak statistics reset."""
    total = torch.cuda.mem_get_info()[1]
    get = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    before = float(get()) if get is not None else 1.0
    torch.cuda.set_per_process_memory_fraction(min(1.0, (budget_gb * GiB + base) / total))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(before)


def peak_over(base: int) -> int:
    """Peak reserved bytes since the last reset, over ``base``."""
    torch.cuda.synchronize()
    return torch.cuda.max_memory_reserved() - base

"""The zimage suite's fp8 cases: full-size Z-Image-Turbo with the DiT's weights stored in fp8 (``weight_dtype``
``fp8_e4m3fn`` and ``fp8_e4m3fn_fast``), fully resident and under a 4 GB budget.

Records (case ``1024_9steps``, the same prompt, seed and sizes as the bf16 rows of the same run):
- ``e2e_ms_<storage>``: prompt -> latent with ``cuda_graph``, against diffusers' bf16 pipeline (target for
  ``fp8_e4m3fn_fast``: >= 1.6x) and against our bf16 ``cuda_graph`` time;
- ``rel_vs_bf16_<storage>`` and, when the fidelity part ran, ``rel_vs_fp32_<storage>``: distances reported;
- ``stream_4gb_fp8``: ``stream`` at 4 GB with ``fp8_e4m3fn`` (allocator capped; targets: peak <= 4 GB and <= 1.25x
  the resident fp8 time), through ``zimage_budget.budget_case``.
Each engine is built on the GPU from fresh random weights of the same seeds (the quantization replaces the DiT's
weights in place) after the bf16 engine and pipeline were freed.
"""
from __future__ import annotations

import gc
import logging

import torch

from .harness import BenchContext, peak_memory, time_ms
from .zimage_models import ours_run

logger = logging.getLogger(__name__)

CASE = "1024_9steps"
STORAGES = ("fp8_e4m3fn", "fp8_e4m3fn_fast")
FAST_TARGET = 1.6


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _resident(ctx: BenchContext, storage: str, size: int, steps: int, repeat: int):
    from ..memory.engine import parts_from_components
    from ..memory.load import build_engine
    from .zimage_models import full_zimage_components

    comps = full_zimage_components(ctx.device)
    engine = build_engine(parts_from_components(comps, name="zimage-random"), "full", weight_dtype=storage,
                          vae_dtype="bf16", device=ctx.device)
    del comps
    gc.collect()
    torch.cuda.empty_cache()
    run = ours_run(engine, size, steps, "cuda_graph")
    with peak_memory(ctx.device) as mem:
        ms = time_ms(run, warmup=1, repeat=repeat, device=ctx.device)
    latent = run().float().cpu()
    del engine, run
    gc.collect()
    torch.cuda.empty_cache()
    return ms, mem["reserved_gb"], latent


def fp8_cases(ctx: BenchContext, times: dict, latents: dict, size: int, steps: int, repeat: int,
              parts: tuple) -> None:
    resident = {}
    for storage in STORAGES:
        if "fp8" not in parts and not (storage == "fp8_e4m3fn" and "stream_fp8" in parts):
            continue
        if not ctx.has_time(60):
            ctx.skip(f"{CASE}/{storage}", "no time left in the suite's budget")
            continue
        ms, peak, latent = _resident(ctx, storage, size, steps, repeat)
        resident[storage] = (ms, latent)
        target = FAST_TARGET if storage.endswith("fast") else None
        if "diffusers" in times:
            ctx.record(CASE, f"e2e_ms_{storage}", ms, times["diffusers"], "diffusers ZImagePipeline bf16",
                       target=target, target_kind="ratio>=" if target else "", unit="ms",
                       notes=f"fp8 weight storage, cuda_graph, prompt -> latent, {steps} steps")
        if "cuda_graph" in times:
            ctx.record(CASE, f"e2e_ms_{storage}_vs_bf16", ms, times["cuda_graph"], "ours bf16 cuda_graph",
                       unit="ms")
        ctx.record(CASE, f"peak_reserved_gb_{storage}", peak, unit="GB")
        if "cuda_graph" in latents:
            ctx.record(CASE, f"rel_vs_bf16_{storage}", _rel(latent, latents["cuda_graph"]), unit="rel L2",
                       notes="fp8-stored DiT against our bf16 latent (same noise)")
        if "fp32" in latents:
            ctx.record(CASE, f"rel_vs_fp32_{storage}", _rel(latent, latents["fp32"]), unit="rel L2",
                       notes="against diffusers' fp32 pipeline on the same (unquantized) weights")
    if "stream_fp8" in parts and "fp8_e4m3fn" in resident and ctx.has_time(90):
        from .zimage_budget import budget_case

        ms, latent = resident["fp8_e4m3fn"]
        budget_case(ctx, "stream_4gb_fp8", 4.0, "fp8_e4m3fn", ms, latent, steps, repeat, with_peer=False)

"""The zimage suite's fp8 parts: Z-Image-Turbo with the DiT's weights stored in fp8 (``weight_dtype``
``fp8_e4m3fn`` and ``fp8_e4m3fn_fast``), fully resident and under a 4 GB budget.

Parts (``LEANDIFFUSION_BENCH_ZIMAGE_CASES``; not in the default set, which they would push past the ``--quick`` call's
time), e.g. in one device call after the bf16 ``cuda_graph`` row they compare with:
    LEANDIFFUSION_BENCH_ZIMAGE_CASES=cuda_graph,fp8,stream_fp8 bash scripts/device_bench.sh --quick --suite zimage \\
        --budget 400
(add ``fidelity`` for the distances from diffusers' fp32 pipeline; it costs about 60 s more: ``--budget 480``).
- ``fp8``: a ``full`` engine per storage, ``cuda_graph`` (``fp8_e4m3fn_fast`` also ``compile+cuda_graph``, rows
  suffixed ``_compile+cuda_graph``), prompt -> latent at the bf16 rows' prompt, seed and size.
  Records (case ``1024_9steps``): ``e2e_ms_<storage>`` against diffusers' bf16 ``ZImagePipeline`` (target for
  ``fp8_e4m3fn_fast`` under ``compile+cuda_graph``: >= 1.6x), ``e2e_ms_<storage>_vs_bf16`` against our bf16 time
  under the same acceleration (when that part ran),
  ``peak_reserved_gb_<storage>``, ``rel_vs_bf16_<storage>`` and, when the fidelity part ran, ``rel_vs_fp32_<storage>``
  (relative L2 distances of the latents; reported, no target).
- ``stream_fp8``: ``stream`` at 4 GB with ``fp8_e4m3fn`` (allocator capped; targets: peak <= 4 GB and <= 1.25x the
  resident ``fp8_e4m3fn`` time of the same run, which it runs first if ``fp8`` is not asked for), through
  ``zimage_budget.budget_case`` (case ``stream_4gb_fp8``).
Invariant: each engine is built from a fresh host copy of the same weights (the quantization replaces the DiT's
weights in place, so engines never share modules), after the bf16 engine, the pipeline and their CUDA graphs were
released; the GPU memory still allocated when a build starts is in the peak row's notes.
Smoke mode: the tiny Z-Image on the CPU (fp32 compute, no fp8 matmuls, no cap) through the same code.
"""
from __future__ import annotations

import logging

import torch

from .harness import BenchContext, peak_memory, time_ms
from .zimage_budget import free_device, host_components, on_gpu
from .zimage_models import ours_run

logger = logging.getLogger(__name__)

CASE = "1024_9steps"
STORAGES = ("fp8_e4m3fn", "fp8_e4m3fn_fast")
FAST_TARGET = 1.6
STREAM_BUDGET_GB = 4.0
PARTS = ("fp8", "stream_fp8")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _allocated_gb() -> float:
    return torch.cuda.memory_allocated() / 2 ** 30 if torch.cuda.is_available() else 0.0


def _accelerations(storage: str) -> tuple:
    """``cuda_graph`` for every storage; the fp8 matmul storage also under ``compile+cuda_graph``, where inductor
    fuses the activation's per-tensor quantization (amax, scale, cast) into the ops around each GEMM."""
    return ("cuda_graph", "compile+cuda_graph") if storage.endswith("fast") else ("cuda_graph",)


def _resident(ctx: BenchContext, storage: str, size: int, steps: int, repeat: int) -> tuple[dict, float]:
    """``({acceleration: (ms, peak reserved GB, latent)}, GB allocated before the build)`` of one ``full`` engine."""
    from ..memory.engine import parts_from_components
    from ..memory.load import build_engine
    from ..sampling.graph_runner import default_runner

    comps = host_components(ctx)
    before = _allocated_gb()
    engine = build_engine(parts_from_components(comps, name="zimage-random"), "full", weight_dtype=storage,
                          vae_dtype="bf16" if on_gpu(ctx) else "fp32", device=ctx.device)
    del comps
    free_device()
    results = {}
    for acceleration in _accelerations(storage):
        run = ours_run(engine, size, steps, acceleration)
        with peak_memory(ctx.device) as mem:
            ms = time_ms(run, warmup=1, repeat=repeat, device=ctx.device)
        results[acceleration] = (ms, mem["reserved_gb"], run().float().cpu())
        default_runner().clear(engine)
        del run
    del engine
    free_device()
    return results, before


def _record_resident(ctx: BenchContext, storage: str, result, times: dict, latents: dict, steps: int) -> None:
    results, before = result
    for acceleration, (ms, peak, latent) in results.items():
        suffix = storage if acceleration == "cuda_graph" else f"{storage}_{acceleration}"
        target = FAST_TARGET if storage.endswith("fast") and acceleration == _accelerations(storage)[-1] else None
        ctx.record(CASE, f"e2e_ms_{suffix}", ms, times.get("diffusers"), "diffusers ZImagePipeline bf16",
                   target=target if "diffusers" in times else None, target_kind="ratio>=" if target else "",
                   unit="ms", notes=f"fp8 weight storage, full policy, {acceleration}, prompt -> latent, {steps} steps")
        if acceleration in times:
            ctx.record(CASE, f"e2e_ms_{suffix}_vs_bf16", ms, times[acceleration], f"ours bf16 {acceleration}",
                       unit="ms")
        ctx.record(CASE, f"peak_reserved_gb_{suffix}", peak, unit="GB",
                   notes=f"full policy; {before:.2f} GB still allocated on the device when the build started")
        if "cuda_graph" in latents:
            ctx.record(CASE, f"rel_vs_bf16_{suffix}", _rel(latent, latents["cuda_graph"]), unit="rel L2",
                       notes="fp8-stored DiT against our bf16 latent (same weights before quantization, same noise)")
        if acceleration != "cuda_graph" and "cuda_graph" in results:
            ctx.record(CASE, f"rel_vs_cuda_graph_{suffix}", _rel(latent, results["cuda_graph"][2]), unit="rel L2",
                       notes=f"the same fp8 engine: {acceleration} against its cuda_graph run (same noise)")
        if "fp32" in latents:
            ctx.record(CASE, f"rel_vs_fp32_{suffix}", _rel(latent, latents["fp32"]), unit="rel L2",
                       notes="against diffusers' fp32 pipeline on the same (unquantized) weights")


def fp8_cases(ctx: BenchContext, times: dict, latents: dict, size: int, steps: int, repeat: int,
              parts: tuple) -> None:
    """The asked-for fp8 parts; ``times`` / ``latents``: the bf16 part's (``diffusers``, ``cuda_graph``, ``fp32``)."""
    resident = {}
    for storage in STORAGES:
        if "fp8" not in parts and not (storage == "fp8_e4m3fn" and "stream_fp8" in parts):
            continue
        if not ctx.has_time(60 if on_gpu(ctx) else 0):
            ctx.skip(f"{CASE}/{storage}", "no time left in the suite's budget")
            continue
        resident[storage] = _resident(ctx, storage, size, steps, repeat)
        _record_resident(ctx, storage, resident[storage], times, latents, steps)
    if "stream_fp8" not in parts:
        return
    if "fp8_e4m3fn" not in resident or not ctx.has_time(90 if on_gpu(ctx) else 0):
        ctx.skip("stream_4gb_fp8", "no resident fp8_e4m3fn time to compare with, or no time left")
        return
    from .zimage_budget import budget_case

    ms, _, latent = resident["fp8_e4m3fn"][0]["cuda_graph"]
    budget_case(ctx, "stream_4gb_fp8", STREAM_BUDGET_GB, "fp8_e4m3fn", ms, latent, steps, repeat, with_peer=False,
                size=size)

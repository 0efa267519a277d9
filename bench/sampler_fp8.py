"""The sampler suite's SDXL fp8 cases: the Fused DDIM Sampler with the UNet's weights stored in fp8, against the
SDXL row's diffusers peer, on the same random weights, conditioning and initial noise.

Cases (``LEANDIFFUSION_BENCH_SAMPLER_CASES``; not in the default ``sd15,sdxl``), e.g. in one device call:
    LEANDIFFUSION_BENCH_SAMPLER_CASES=sdxl_fp8,sdxl_fp8_4gb bash scripts/device_bench.sh --quick --suite sampler \\
        --budget 240
Both first run the references once: the diffusers eager loop (fp16 UNet, SDPA, DDIM, both styles of
``sampler_loops.diffusers_loop``, the faster one is the peer, as in the ``sdxl-1024`` row) and our fp16 engine with
``cuda_graph``; SDXL 1024x1024, 30 steps, batch 1, CFG 7.5 batched, text encoding excluded (stand-in encoders).
- ``sdxl_fp8`` (case ``sdxl-1024/fp8_e4m3fn_fast``): a ``full`` engine with ``fp8_e4m3fn_fast`` (fp8 matmuls on
  fp8 tensor cores, bf16 compute), ``cuda_graph``. Records ``loop_ms`` against the diffusers peer and
  ``loop_ms_vs_fp16`` against our fp16 ``cuda_graph`` loop, ``rel_vs_fp16`` / ``rel_vs_diffusers`` (relative L2 of
  the final latents; reported, no target) and ``peak_reserved_gb``.
- ``sdxl_fp8_4gb`` (case ``sdxl-1024/fp8_e4m3fn_4gb``): ``fp8_e4m3fn`` with the allocator capped at 4 GB
  (``memory.cap.allocator_cap``), capture and timed runs inside the cap: ``peak_reserved_gb`` (target <= 4 GB),
  ``loop_ms`` and ``rel_vs_fp16``. Policy: ``balanced``, the issue's "SDXL fully resident within 4 GB" read as the
  denoiser fully resident. ``full`` would also keep the text encoders resident: CLIP-L + CLIP-G (0.82B parameters,
  1.6 GB in bf16) next to the 2.6 GB fp8 UNet leave no room for a 1024 px step inside 4 GB, while ``balanced``
  (``memory/policies.py``) keeps the UNet resident and has the text encoders and the VAE on the device only while
  their own stage runs, which is how a 4 GB card runs SDXL; the sampler's stage is the UNet alone.
Invariant: every fp8 engine is built from a fresh host copy of the same weights (quantization replaces the UNet's
weights in place), after the fp16 engine and its graphs were released, so no engine's memory is in another's peak.
The fp8 engines compute in bf16: the conditioning is the same random draw rounded to bf16 (part of the distance).
Smoke mode: the tiny SDXL on the CPU (fp32 compute, no fp8 matmuls, no cap) through the same code.
"""
from __future__ import annotations

import gc
import logging

import torch

from .harness import BenchContext, peak_memory, time_ms
from .sampler_loops import CFG, conditioning, diffusers_loop, ours_loop, use_sdpa

logger = logging.getLogger(__name__)

CASES = ("sdxl_fp8", "sdxl_fp8_4gb")
CAP_GB = 4.0


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _parts(ctx: BenchContext, host: bool):
    if ctx.smoke or ctx.device.type != "cuda":
        from ..memory.engine import parts_from_components
        from ..memory.tiny import build_tiny_components

        return parts_from_components(build_tiny_components("sdxl"), name="tiny-sdxl")
    from .models import full_parts

    return full_parts("sdxl", ctx.device, host=host)


def _inputs(engine, size: int, steps: int):
    from ..sampling import ddim

    g = torch.Generator().manual_seed(1234)  # the sdxl-1024 row's initial noise
    x_init = torch.randn(1, 4, size // 8, size // 8, generator=g)
    return conditioning(engine, "sdxl", 1, size), x_init, ddim.make_schedule(engine.parts.scheduler_config, steps)


def _loop(ctx: BenchContext, engine, size: int, steps: int, repeat: int, runner):
    """Our loop with ``cuda_graph``: (median ms, final latent on the host); the first run (capture) is untimed."""
    cond, x_init, schedule = _inputs(engine, size, steps)
    run = ours_loop(engine, cond, x_init, schedule, "cuda_graph", runner)
    out = run().float().cpu()
    return time_ms(run, warmup=0, repeat=repeat, device=ctx.device), out


def _references(ctx: BenchContext, size: int, steps: int, repeat: int) -> dict:
    """The diffusers peer (faster style) and our fp16 ``cuda_graph`` loop on the fp16 engine; the engine is freed."""
    from ..memory.engine import engine_from_parts
    from ..sampling.graph_runner import GraphRunner

    dtype = torch.float16 if ctx.device.type == "cuda" else torch.float32
    engine = engine_from_parts(_parts(ctx, host=False), device=ctx.device, dtype=dtype, vae_dtype=dtype)
    if ctx.device.type == "cuda":
        use_sdpa(engine.parts.unet)
    cond, x_init, _ = _inputs(engine, size, steps)
    peers = {}
    for style in ("pipeline", "nosync"):
        fn = diffusers_loop(engine, cond, x_init, steps, style)
        out = fn().float().cpu()  # first run: cuDNN/cuBLAS handles and kernel selection, outside the timing
        peers[style] = (time_ms(fn, warmup=0, repeat=repeat, device=ctx.device), out)
    style = min(peers, key=lambda k: peers[k][0])
    runner = GraphRunner()
    ours_ms, ours_out = _loop(ctx, engine, size, steps, repeat, runner)
    runner.clear()
    del engine, runner
    _free()
    name = str(dtype).replace("torch.", "")  # fp16 on the GPU; the CPU smoke runs fp32
    return {"peer_ms": peers[style][0], "peer_out": peers[style][1],
            "peer_name": f"diffusers eager loop ({style}) {name}", "fp16_ms": ours_ms, "fp16_out": ours_out,
            "fp16_name": f"ours {name} cuda_graph"}


def _fp8_engine(ctx: BenchContext, policy: str, weight_dtype: str):
    from ..memory.load import build_engine

    vae = "fp16" if ctx.device.type == "cuda" else "fp32"
    return build_engine(_parts(ctx, host=True), policy, CAP_GB, weight_dtype=weight_dtype, vae_dtype=vae,
                        device=ctx.device)


def _fast(ctx: BenchContext, refs: dict, case: str, size: int, steps: int, repeat: int) -> None:
    from ..sampling.graph_runner import GraphRunner

    engine = _fp8_engine(ctx, "full", "fp8_e4m3fn_fast")
    runner = GraphRunner()
    with peak_memory(ctx.device) as mem:
        ms, out = _loop(ctx, engine, size, steps, repeat, runner)
    notes = f"fp8 weights ({engine.dtype} compute), full policy, cuda_graph, {steps} steps, CFG {CFG}, batch 1"
    ctx.record(case, "loop_ms", ms, refs["peer_ms"], refs["peer_name"], unit="ms", notes=notes)
    ctx.record(case, "loop_ms_vs_fp16", ms, refs["fp16_ms"], refs["fp16_name"], unit="ms", notes=notes)
    ctx.record(case, "rel_vs_fp16", _rel(out, refs["fp16_out"]), unit="rel L2",
               notes="final latents against our fp16 cuda_graph loop (same weights before quantization, same noise)")
    ctx.record(case, "rel_vs_diffusers", _rel(out, refs["peer_out"]), unit="rel L2",
               notes="final latents against the diffusers fp16 peer's")
    ctx.record(case, "peak_reserved_gb", mem["reserved_gb"], unit="GB", notes="first run (capture) and timed runs")
    runner.clear()
    del engine, runner
    _free()


def _capped(ctx: BenchContext, refs: dict, case: str, size: int, steps: int, repeat: int) -> None:
    from ..memory.cap import allocator_cap
    from ..memory.plan import GiB, module_bytes
    from ..sampling.graph_runner import GraphRunner

    engine = _fp8_engine(ctx, "balanced", "fp8_e4m3fn")
    unet_gb = module_bytes(engine.parts.unet, engine.dtype) / GiB
    runner = GraphRunner()
    note = f"balanced policy: UNet resident in fp8 ({unet_gb:.2f} GB), {steps} steps, cuda_graph"
    try:
        with allocator_cap(ctx.device, int(CAP_GB * GiB)), peak_memory(ctx.device) as mem:
            ms, out = _loop(ctx, engine, size, steps, repeat, runner)
    except torch.cuda.OutOfMemoryError as exc:
        ctx.record(case, "peak_reserved_gb", float("inf"), target=CAP_GB, target_kind="ours<=", unit="GB",
                   notes=f"{note}; out of memory under the cap: {str(exc).splitlines()[0][:160]}")
    else:
        ctx.record(case, "peak_reserved_gb", mem["reserved_gb"], target=CAP_GB, target_kind="ours<=", unit="GB",
                   notes=f"{note}; allocator capped at {CAP_GB:g} GB through capture and timed runs")
        ctx.record(case, "loop_ms", ms, refs["peer_ms"], refs["peer_name"], unit="ms", notes=note)
        ctx.record(case, "rel_vs_fp16", _rel(out, refs["fp16_out"]), unit="rel L2",
                   notes="final latents against our fp16 cuda_graph loop")
    runner.clear()
    del engine, runner
    _free()


def run_cases(ctx: BenchContext, wanted, repeat: int) -> None:
    """The asked-for cases of ``CASES`` (``wanted``: the suite's case list)."""
    asked = [c for c in CASES if c in wanted]
    if not asked:
        return
    smoke = ctx.smoke or ctx.device.type != "cuda"
    size, steps = (64, 2) if smoke else (1024, 30)
    if not smoke and not ctx.has_time(60):
        ctx.skip("sdxl-1024/fp8", "not enough of the suite's time budget left")
        return
    refs = _references(ctx, size, steps, repeat)
    prefix = "tiny-sdxl-64" if smoke else "sdxl-1024"
    for name, fn, case in (("sdxl_fp8", _fast, f"{prefix}/fp8_e4m3fn_fast"),
                           ("sdxl_fp8_4gb", _capped, f"{prefix}/fp8_e4m3fn_4gb")):
        if name not in asked:
            continue
        if not smoke and not ctx.has_time(30):
            ctx.skip(case, "not enough of the suite's time budget left")
            continue
        fn(ctx, refs, case, size, steps, repeat)

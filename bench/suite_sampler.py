"""Fused DDIM Sampler benchmark: the denoising loop under each acceleration vs the diffusers eager loop.

Cases (full-size random-weight UNets, fp16, one process, one GPU; text encoding excluded on both sides - the
conditioning is precomputed random embeddings of the real shapes):
- ``sd15-512``: SD1.5 UNet, 512x512 (64x64 latent), 20 steps, batch 1, CFG 7.5 (batched: UNet batch 2);
- ``sdxl-1024``: SDXL UNet, 1024x1024 (128x128 latent), 30 steps, batch 1, CFG 7.5, pooled + time ids.
Peer: the diffusers eager loop - ``torch.cat([x] * 2)``, UNet (fp16, SDPA pinned: ``AttnProcessor2_0``), guidance,
``DDIMScheduler.step`` - timed over the same steps from the same initial noise, in two styles (``pipeline``: as
``StableDiffusionPipeline`` runs it, device timesteps, host syncs inside ``step``; ``nosync``: CPU timesteps for
``step``, no syncs); the faster one is the peer of the ratios, both are recorded (``peer_*_ms``), with
``unet_eager_call_ms`` (one eager UNet call, back to back: the host-launch speed that bounds every eager loop).
Ours: ``sampling.loop.denoise`` with ``none``, ``cuda_graph`` and ``compile+cuda_graph``. Each side's first run
(cuDNN/cuBLAS handle creation, kernel selection; capture and compile for ours) is outside its timing.

Records per case: ``loop_ms`` per acceleration with the speed-up over the peer (targets: SD1.5
cuda_graph >= 2.0x, compile+cuda_graph >= 3.0x; SDXL 1.4x / 1.8x), ``rel_diff_vs_diffusers`` and
``rel_diff_vs_eager`` (||ours - ref|| / ||ref|| over the final latents, target <= 5e-3), ``first_run_s`` (capture,
and compile, time) and ``peak_reserved_gb``. Timing: one warm-up run, then the median of ``repeat`` runs timed with
CUDA events (``harness.time_ms``); the peer is re-timed after every acceleration and the fastest peer timing so far
is the denominator (``peer_spread`` records the drift). Each acceleration starts with the graph cache empty, so
its ``peak_reserved_gb`` holds its own graph's memory pool and no earlier acceleration's.

Modes: smoke = CPU tiny SD1/SDXL, 1 step (plumbing only; accelerations fall back to eager on the CPU);
quick = both cases, every acceleration, 3 timed runs (SDXL 2) instead of 5, ``none`` (no target) run once for the
parity records but not timed (SDXL's regional compile dominates: ``sampling/compile.py``); full = every
acceleration timed with 5 runs.
``LEANDIFFUSION_BENCH_SAMPLER_CASES`` (comma list of ``ALL_CASES``; default ``sd15,sdxl``) picks the cases, e.g. to
give SDXL's compile its own device call. The SDXL fp8 cases ``sdxl_fp8`` (``fp8_e4m3fn_fast`` against the diffusers
peer) and ``sdxl_fp8_4gb`` (``fp8_e4m3fn`` resident under a 4 GB allocator cap) are asked for by name
(``sampler_fp8.py``; in smoke mode too), e.g. in one device call:
    LEANDIFFUSION_BENCH_SAMPLER_CASES=sdxl_fp8,sdxl_fp8_4gb bash scripts/device_bench.sh --quick --suite sampler \
        --budget 240
"""
from __future__ import annotations

import gc
import logging
import os
import time

import torch

from .harness import BenchContext, peak_memory, time_ms
from .models import full_engine, tiny_engine
from .sampler_loops import CFG, conditioning, diffusers_loop, ours_loop, use_sdpa

logger = logging.getLogger(__name__)

SUITE = "sampler"
SMOKE_BUDGET_S = 60
QUICK_BUDGET_S = 300  # SDXL's regional compile is the largest part
FULL_BUDGET_S = 540

DEFAULT_CASES = ("sd15", "sdxl")
ALL_CASES = DEFAULT_CASES + ("sdxl_fp8", "sdxl_fp8_4gb")
TARGETS = {"sd15": {"cuda_graph": 2.0, "compile+cuda_graph": 3.0},
           "sdxl": {"cuda_graph": 1.4, "compile+cuda_graph": 1.8}}
# rough seconds a case needs (first run included, compile and capture for compile+cuda_graph), to skip instead of
# overrunning the suite's budget
COST_S = {("sd15", "none"): 15, ("sd15", "cuda_graph"): 15, ("sd15", "compile+cuda_graph"): 75,
          ("sdxl", "none"): 40, ("sdxl", "cuda_graph"): 40, ("sdxl", "compile+cuda_graph"): 60}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _has_time(ctx: BenchContext, seconds: float) -> bool:
    has_time = getattr(ctx, "has_time", None)
    return True if has_time is None else bool(has_time(seconds))


def _skip(ctx: BenchContext, case: str, reason: str) -> None:
    skip = getattr(ctx, "skip", None)
    if skip is not None:
        skip(case, reason)
    else:
        logger.info("%s skipped: %s", case, reason)


def _scope(engine) -> str:
    from ..sampling.compile import compile_scope, resolved_scope

    return resolved_scope(engine.parts.unet, compile_scope())


def _unet_call_ms(engine, conditioning, x_init: torch.Tensor, calls: int = 10) -> float:
    """Host-speed calibration: ms per eager UNet call (CFG batch 2), ``calls`` back to back, one sync at the end.
    When this exceeds the GPU time of a call (the CUDA-graph step), the eager loops are host-launch-bound and their
    speed is the host's."""
    unet = engine.parts.unet
    c, u = conditioning.cond, conditioning.uncond
    context = torch.cat([u.context, c.context])
    kwargs = {}
    if conditioning.time_ids is not None:
        kwargs["added_cond_kwargs"] = {"text_embeds": torch.cat([u.pooled, c.pooled]),
                                       "time_ids": torch.cat([conditioning.time_ids, conditioning.time_ids])}
    x = torch.cat([x_init] * 2).to(engine.device, engine.dtype)
    t = torch.tensor(500, device=engine.device)

    @torch.no_grad()
    def run():
        for _ in range(calls):
            unet(x, t, encoder_hidden_states=context, return_dict=False, **kwargs)

    return time_ms(run, warmup=1, repeat=3, device=engine.device) / calls


def _case(ctx: BenchContext, kind: str, engine, size: int, steps: int, accelerations, repeat: int) -> None:
    from ..sampling import ddim
    from ..sampling.graph_runner import GraphRunner

    case = f"{kind}-{size}"
    factor = 8
    batch = 1
    schedule = ddim.make_schedule(engine.parts.scheduler_config, steps)
    cond = conditioning(engine, kind, batch, size)
    g = torch.Generator().manual_seed(1234)
    x_init = torch.randn(batch, 4, size // factor, size // factor, generator=g)
    dev = engine.device
    notes = f"{steps} steps, batch {batch}, CFG {CFG} batched, fp16, random weights, text encoding excluded"

    attn = use_sdpa(engine.parts.unet) if dev.type == "cuda" else "default"
    peers = {}
    for style in ("pipeline", "nosync"):
        fn = diffusers_loop(engine, cond, x_init, steps, style)
        out_style = fn().float()  # first run: cuDNN/cuBLAS handles and kernel selection, outside the timing
        peers[style] = (time_ms(fn, warmup=1, repeat=repeat, device=dev), out_style)
    for style, (ms, _) in peers.items():
        ctx.record(case, f"peer_{style}_ms", ms, unit="ms",
                   notes=f"diffusers eager loop, {style} style (see suite docstring); attention {attn}; " + notes)
    # the official peer is the faster way of running diffusers' loop: a slow peer would inflate our ratios
    peer_style = min(peers, key=lambda k: peers[k][0])
    peer_ms, peer_out = peers[peer_style]
    peer_name = f"diffusers eager loop ({peer_style})"
    peer_fn = diffusers_loop(engine, cond, x_init, steps, peer_style)
    peer_times = [peer_ms]
    ctx.record(case, "peer_styles_rel", _rel(peers["nosync"][1], peers["pipeline"][1]), target=1e-3,
               target_kind="ours<=", notes="the two peer styles compute the same latents (||a - b|| / ||b||)")
    if dev.type == "cuda":
        ctx.record(case, "unet_eager_call_ms", _unet_call_ms(engine, cond, x_init), unit="ms",
                   notes="host-speed calibration: eager UNet call, CFG batch 2, 10 back to back; loops slower "
                         "than steps x this are host-bound")
    notes += (f"; timed region: ours = session('unet') + latent upload + {steps} steps + final copy; peer = "
              f"set_timesteps + latent upload + {steps} x (cat, UNet, CFG, DDIMScheduler.step); attention {attn}")

    runner = GraphRunner()
    eager_out = None
    for acc in accelerations:
        if not _has_time(ctx, COST_S.get((kind, acc), 60) if not ctx.smoke else 1):
            _skip(ctx, f"{case}/{acc}", "not enough of the suite's time budget left")
            continue
        fn = ours_loop(engine, cond, x_init, schedule, acc, runner)
        # the previous acceleration's graph (and its private memory pool, which empty_cache cannot return) is
        # dropped first: kept, it sat reserved through this acceleration's first run and counted in its peak
        runner.clear()
        with peak_memory(dev) as peak:
            t0 = time.perf_counter()
            out = fn().float()  # first run: capture (and compile)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            first_s = time.perf_counter() - t0
        acc_case = f"{case}/{acc}"  # one case per acceleration: (case, metric) keys stay unique
        acc_note = f"acceleration={acc}" + (f" (compile scope {_scope(engine)})" if "compile" in acc else "")
        target = TARGETS.get(kind, {}).get(acc)
        if target is not None or not ctx.quick:  # quick mode times only the accelerations with a target
            ms = time_ms(fn, warmup=0, repeat=repeat, device=dev)
            # eager loops are host-launch-bound and the host's speed drifts: re-time the peer right after ours and
            # compare with the fastest peer seen so far (conservative: never a slow peer)
            peer_times.append(time_ms(peer_fn, warmup=0, repeat=repeat, device=dev))
            peer_ms = min(peer_times)
            ctx.record(acc_case, "loop_ms", ms, peer_ms, peer_name, target, "ratio>=" if target else "",
                       lower_is_better=True, unit="ms", notes=f"{acc_note}; " + notes)
        scaled_out = out  # scaled latents, like the peer's
        ctx.record(acc_case, "rel_diff_vs_diffusers", _rel(scaled_out, peer_out), target=5e-3, target_kind="ours<=",
                   notes=f"acceleration={acc}: ||ours - diffusers|| / ||diffusers|| over the final latents "
                         f"(ours keeps a float32 latent state, diffusers fp16)")
        if acc == "none":
            eager_out = scaled_out
        elif eager_out is not None:
            ctx.record(acc_case, "rel_diff_vs_eager", _rel(scaled_out, eager_out), target=5e-3, target_kind="ours<=",
                       notes=f"acceleration={acc} vs acceleration=none, same run")
        ctx.record(acc_case, "first_run_s", first_s, unit="s",
                   notes=f"{acc_note}: first loop incl. capture/compile (once per process)")
        if dev.type == "cuda":
            ctx.record(acc_case, "peak_reserved_gb", peak["reserved_gb"], unit="GB",
                       notes=f"acceleration={acc}: max_memory_reserved during the first run (CUDA context excluded)")
    runner.clear()
    ctx.record(case, "peer_spread", max(peer_times) / min(peer_times), unit="x",
               notes=f"slowest / fastest of the {len(peer_times)} timings of the peer ({peer_style}) spread through "
                     f"the case: the host-speed drift the ratios are exposed to ({', '.join(f'{t:.0f}' for t in peer_times)} ms)")


def wanted_cases() -> list:
    """``LEANDIFFUSION_BENCH_SAMPLER_CASES`` as a list (default ``DEFAULT_CASES``); unknown names are refused."""
    text = os.environ.get("LEANDIFFUSION_BENCH_SAMPLER_CASES", "").replace(" ", "")
    wanted = [c for c in text.split(",") if c] or list(DEFAULT_CASES)
    unknown = [c for c in wanted if c not in ALL_CASES]
    if unknown:
        raise ValueError(f"LEANDIFFUSION_BENCH_SAMPLER_CASES: unknown case(s) {unknown}; expected names from "
                         f"{ALL_CASES}")
    return wanted


def run(ctx: BenchContext) -> None:
    from .sampler_fp8 import run_cases as fp8_cases

    wanted = wanted_cases()
    if ctx.smoke:
        for family in ("sd1", "sdxl"):
            engine = tiny_engine(family)
            _case(ctx, "tiny-" + family, engine, 64, 1, ("none", "cuda_graph", "compile+cuda_graph"), repeat=1)
        fp8_cases(ctx, wanted, repeat=1)
        return
    if ctx.device.type != "cuda":
        raise RuntimeError("the sampler suite needs a CUDA device outside smoke mode")
    plan = [("sd15", 512, 20, ("none", "cuda_graph", "compile+cuda_graph")),
            ("sdxl", 1024, 30, ("none", "cuda_graph", "compile+cuda_graph"))]
    for kind, size, steps, accelerations in plan:
        if kind not in wanted:
            _skip(ctx, f"{kind}-{size}", "not in LEANDIFFUSION_BENCH_SAMPLER_CASES")
            continue
        if not _has_time(ctx, COST_S[(kind, "none")] * 2):
            _skip(ctx, f"{kind}-{size}", "not enough of the suite's time budget left")
            continue
        engine = full_engine(kind, ctx.device)
        try:
            _case(ctx, kind, engine, size, steps, accelerations, repeat=(2 if kind == "sdxl" else 3) if ctx.quick else 5)
        finally:
            del engine
            gc.collect()
            torch.cuda.empty_cache()
    fp8_cases(ctx, wanted, repeat=2 if ctx.quick else 5)

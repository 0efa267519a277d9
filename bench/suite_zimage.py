"""Z-Image suite: the Fused Flow Sampler against diffusers' ZImagePipeline on the full-size architecture.

Case ``1024_9steps`` (random weights scaled so activations stay O(1), bf16, one process, one GPU; prompt -> latent
end to end, text encoding included on both sides, cfg 1 as Z-Image-Turbo runs):
- peer: ``ZImagePipeline(prompt, num_inference_steps=9, guidance_scale=0, 1024x1024, output_type="latent")`` over
  the same modules (SDPA attention, diffusers' default);
- ours: ``sampling.flow.loop.sample_flow`` on an engine over the same modules (``full`` policy) with ``none``,
  ``cuda_graph`` and ``compile+cuda_graph``.
Records: ``e2e_ms`` per acceleration with the speed-up over the peer (targets: cuda_graph >= 1.0x, compile+cuda_graph
>= 1.25x), ``dit_forward_ms`` (one eager forward of each side, the GEMM-bound floor), ``peak_reserved_gb`` of each
side's timed runs, and fidelity: the relative L2 distance of the bf16 latents from diffusers' fp32 pipeline on the
same weights and noise (ours: target <= 1e-2; and no further than diffusers' own bf16 pipeline, recorded as a ratio
>= 1). The fp32 reference runs once (a float copy of the DiT and text encoder, freed afterwards).

Timing: one warm-up run (capture and compile for ours, outside the timing), then the median of ``repeat`` runs
(CUDA events, ``harness.time_ms``); the peer is re-timed after our runs and the faster peer timing is the
denominator. ``ctx.smoke``: the tiny Z-Image on the CPU through the same code (numbers are meaningless).

Parts: ``LEANDIFFUSION_BENCH_ZIMAGE_CASES`` (comma list of ``ALL_PARTS``; default ``DEFAULT_PARTS``). The budget case
``stream`` (bf16 at 6 GB, ``zimage_budget.py``) and the fp8 parts ``fp8`` / ``stream_fp8`` (``zimage_fp8.py``) build
their own engines after this part's engine, pipeline and graphs are released. The fp8 parts are not in the default
set (they would push the ``--quick`` call past ~420 s); ask for them with the bf16 row they compare with, in one device call:
    LEANDIFFUSION_BENCH_ZIMAGE_CASES=cuda_graph,fp8,stream_fp8 bash scripts/device_bench.sh --quick --suite zimage \
        --budget 400
"""
from __future__ import annotations

import copy
import gc
import logging
import os

import torch

from .harness import BenchContext, peak_memory, time_ms
from .zimage_budget import free_device
from .zimage_fp8 import PARTS as FP8_PARTS, fp8_cases
from .zimage_models import ours_run, peer_run

logger = logging.getLogger(__name__)

SUITE = "zimage"
SMOKE_BUDGET_S = 30
QUICK_BUDGET_S = 330  # the full-size build, the fp32 reference run and the regional compile dominate
FULL_BUDGET_S = 540

CASE = "1024_9steps"
# ``LEANDIFFUSION_BENCH_ZIMAGE_CASES`` (comma list) restricts the suite to some parts, e.g. to give the budget
# cases a device call of their own: accelerations (none, cuda_graph, compile+cuda_graph), fidelity, dit_forward,
# stream, and the fp8 parts (not in the default set: ask for them, e.g. ``cuda_graph,fp8,stream_fp8``; see
# ``zimage_fp8.py``).
ALL_PARTS = ("dit_forward", "none", "cuda_graph", "compile+cuda_graph", "fidelity", "stream", "fp8", "stream_fp8",
             "ksampler")
DEFAULT_PARTS = ALL_PARTS[:6]


def selected_parts() -> tuple:
    text = os.environ.get("LEANDIFFUSION_BENCH_ZIMAGE_CASES", "").strip()
    if not text:
        return DEFAULT_PARTS
    parts = tuple(p.strip() for p in text.split(",") if p.strip())
    unknown = [p for p in parts if p not in ALL_PARTS]
    if unknown:
        raise ValueError(f"LEANDIFFUSION_BENCH_ZIMAGE_CASES: unknown part(s) {unknown}; expected {ALL_PARTS}")
    return parts
TARGETS = {"cuda_graph": 1.0, "compile+cuda_graph": 1.25}
FIDELITY_TARGET = 1e-2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _components(ctx: BenchContext):
    if ctx.smoke or ctx.device.type != "cuda":
        from ..memory.tiny_zimage import build_tiny_zimage

        return build_tiny_zimage(seed=0), 64, 2
    from .zimage_models import full_zimage_components

    return full_zimage_components(ctx.device), 1024, 9


def _dit_forward_ms(ctx: BenchContext, comps: dict, engine, size: int) -> None:
    from ..sampling.flow.dit_forward import ImageGrid, caption_layout
    from ..sampling.flow.accel import eager_dit_fn

    dit, dev = comps["transformer"], ctx.device
    dtype = next(dit.parameters()).dtype
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, size // 8, size // 8, generator=g).to(dev, dtype)
    t = torch.full((1,), 0.5, device=dev)
    cap = torch.randn(48, dit.config.cap_feat_dim, generator=g).to(dev, dtype)
    grid = ImageGrid.of(size // 8, size // 8, 2)
    layout = caption_layout(dit, [cap], grid, 128, dtype, dev)
    ours = eager_dit_fn(dit)
    with torch.no_grad(), engine.session("unet"):
        with peak_memory(dev) as mine_mem:
            mine = time_ms(lambda: ours(x, t, layout, grid), warmup=1, repeat=3, device=dev)
        with peak_memory(dev) as theirs_mem:
            theirs = time_ms(lambda: dit([x[0].unsqueeze(1)], t, [cap], return_dict=False), warmup=1, repeat=3,
                             device=dev)
    ctx.record(CASE, "dit_forward_ms", mine, theirs, "diffusers forward (unmasked caption)", unit="ms",
               notes="one eager DiT forward, caption bucket 128 with masked slots vs diffusers' exact padding")
    ctx.record(CASE, "dit_forward_peak_reserved_gb", mine_mem["reserved_gb"], theirs_mem["reserved_gb"],
               "diffusers forward", unit="GB", notes="weights of every stage resident, one forward's activations")


def _speed(ctx: BenchContext, comps: dict, pipe, engine, size: int, steps: int, repeat: int) -> dict:
    dev = ctx.device
    peer = peer_run(pipe, size, steps)
    with peak_memory(dev) as peer_mem:
        peer_ms = [time_ms(peer, warmup=1, repeat=repeat, device=dev)]
    latents = {"diffusers_bf16": peer().float().cpu()}
    times = {"diffusers": min(peer_ms)}
    for acceleration in ("none", "cuda_graph", "compile+cuda_graph"):
        if acceleration not in selected_parts():
            continue
        # smoke: the tiny model takes seconds, and its record needs the "none" latent
        if not ctx.smoke and not ctx.has_time(120 if acceleration.startswith("compile") else 30):
            ctx.skip(f"{CASE}/{acceleration}", "no time left in the suite's budget")
            continue
        ours = ours_run(engine, size, steps, acceleration)
        with peak_memory(dev) as mem:
            ms = time_ms(ours, warmup=1, repeat=repeat, device=dev)
        latents[acceleration] = ours().float().cpu()
        times[acceleration] = ms
        peer_ms.append(time_ms(peer, warmup=0, repeat=repeat, device=dev))
        times["diffusers"] = min(peer_ms)
        target = TARGETS.get(acceleration)
        ctx.record(CASE, f"e2e_ms_{acceleration}", ms, min(peer_ms), "diffusers ZImagePipeline bf16", target=target,
                   target_kind="ratio>=" if target else "", unit="ms",
                   notes=f"prompt -> latent, {steps} steps; peer timings {[round(p, 1) for p in peer_ms]}")
        ctx.record(CASE, f"peak_reserved_gb_{acceleration}", mem["reserved_gb"], peer_mem["reserved_gb"],
                   "diffusers ZImagePipeline bf16", unit="GB")
    return latents, times


def _ksampler(ctx: BenchContext, engine, times: dict, size: int, steps: int, repeat: int) -> None:
    """The Fused KSampler (cuda_graph, prompt -> latent) against the diffusers pipeline of the same run (its
    FlowMatchEuler scheduler matches ``euler``; diffusers has no ``res_multistep``: reported against the same peer)."""
    from .zimage_models import ksampler_run

    for sampler in ("euler", "res_multistep"):
        ms = time_ms(ksampler_run(engine, size, steps, sampler), warmup=1, repeat=repeat, device=ctx.device)
        ctx.record(CASE, f"ksampler_ms_{sampler}", ms, times["diffusers"], "diffusers ZImagePipeline bf16",
                   target=1.15, target_kind="ratio>=", unit="ms",
                   notes=f"Fused KSampler {sampler} / simple, cuda_graph, cfg 1, prompt -> latent, {steps} steps")


def _fidelity(ctx: BenchContext, comps: dict, latents: dict, size: int, steps: int) -> None:
    from .zimage_models import zimage_pipeline

    if not ctx.has_time(60):
        ctx.skip(f"{CASE}/fidelity", "no time left for the fp32 reference")
        return
    fp32 = dict(comps, transformer=copy.deepcopy(comps["transformer"]).float(),
                text_encoder=copy.deepcopy(comps["text_encoder"]).float())
    reference = peer_run(zimage_pipeline(fp32), size, steps)().float().cpu()
    latents["fp32"] = reference
    del fp32
    gc.collect()
    torch.cuda.empty_cache()
    theirs = _rel(latents["diffusers_bf16"], reference)
    ctx.record(CASE, "diffusers_bf16_rel_vs_fp32", theirs, unit="rel L2",
               notes="diffusers' own bf16 pipeline against its fp32 run (same weights, same noise)")
    for acceleration in ("cuda_graph", "compile+cuda_graph"):
        if acceleration not in latents:
            continue
        mine = _rel(latents[acceleration], reference)
        ctx.record(CASE, f"rel_vs_fp32_{acceleration}", mine, target=FIDELITY_TARGET, target_kind="ours<=",
                   unit="rel L2", notes="bf16 latent vs diffusers' fp32 pipeline on the same weights and noise")
        ctx.record(CASE, f"rel_vs_fp32_against_diffusers_bf16_{acceleration}", mine, theirs,
                   "diffusers bf16 distance", target=1.0, target_kind="ratio>=", unit="rel L2",
                   notes="ratio >= 1: ours no further from fp32 than diffusers' own bf16 pipeline")


def _budget_cases(ctx: BenchContext, times: dict, latents: dict, steps: int, repeat: int) -> None:
    from .zimage_budget import budget_case

    if "cuda_graph" not in times or not ctx.has_time(90):
        ctx.skip("stream_6gb_bf16", "no resident cuda_graph time to compare with, or no time left")
        return
    budget_case(ctx, "stream_6gb_bf16", 6.0, "bf16", times["cuda_graph"], latents.get("cuda_graph"), steps,
                repeat, with_peer=True)


def _release(engine) -> None:
    """Drop the engine's captured CUDA graphs (their memory pools stay reserved while a graph lives)."""
    from ..sampling.graph_runner import default_runner

    default_runner().clear(engine)


def run(ctx: BenchContext) -> None:
    from ..memory.engine import parts_from_components
    from ..memory.load import build_engine
    from .zimage_models import zimage_pipeline

    comps, size, steps = _components(ctx)
    cuda = ctx.device.type == "cuda"
    pipe = zimage_pipeline(comps)
    if not cuda:
        pipe.to(ctx.device)
    dtype = "bf16" if cuda else "fp32"
    engine = build_engine(parts_from_components(comps, name="zimage-random"), "full", weight_dtype=dtype,
                          vae_dtype=dtype, device=ctx.device)
    repeat = 1 if ctx.smoke else (2 if ctx.quick else 3)
    parts = selected_parts()
    if cuda and "dit_forward" in parts:
        _dit_forward_ms(ctx, comps, engine, size)
    latents, times = _speed(ctx, comps, pipe, engine, size, steps, repeat)
    if cuda and "ksampler" in parts:
        _ksampler(ctx, engine, times, size, steps, repeat)
    logger.info("%s", engine.placement.report())
    if cuda and "fidelity" in parts:
        _fidelity(ctx, comps, latents, size, steps)
    eager = next((latents[a] for a in ("none", "cuda_graph", "compile+cuda_graph") if a in latents), None)
    if not cuda and eager is not None:  # on the CPU every acceleration runs eagerly
        ctx.record(CASE, "smoke_rel_vs_diffusers", _rel(eager, latents["diffusers_bf16"]), target=1e-4,
                   target_kind="ours<=", unit="rel L2", notes="CPU fp32 tiny model: plumbing check")
        latents["fp32"] = latents["diffusers_bf16"]  # on the CPU the peer pipeline runs in fp32
    _release(engine)  # the parts below build their own engines from host copies: the device must be free first
    del pipe, engine, comps
    free_device()
    if cuda and "stream" in parts:
        _budget_cases(ctx, times, latents, steps, repeat)
    if any(p in parts for p in FP8_PARTS):
        fp8_cases(ctx, times, latents, size, steps, repeat, parts)

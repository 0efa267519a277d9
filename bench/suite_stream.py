"""Stream Scheduler Sampler throughput: many prompts, images per second, against prompt-by-prompt peers.

Cases (fp16 UNet and text encoders, random full-size weights, ``full`` VRAM policy, DDIM, cfg 7.5, batched CFG):
- ``sd15_512``: SD1.5 512x512, 16 prompts x 20 steps (quick: 8 x 10); targets >= 1.5x the Fused DDIM Sampler +
  decode called prompt by prompt (same acceleration, ``cuda_graph``) and >= 2.5x diffusers'
  ``StableDiffusionPipeline`` called prompt by prompt (eager fp16, SDPA, DDIMScheduler, output decoded).
- ``sdxl_1024``: SDXL 1024x1024, 8 prompts x 30 steps (quick too); target >= 1.2x the prompt-by-prompt Fused
  DDIM path; diffusers' ``StableDiffusionXLPipeline`` is recorded as well (not in quick mode: no target). The SDXL VAE runs in fp32 (the loader's
  default for SDXL, as ComfyUI's --no-half-vae), for every contender (they share the modules).
All contenders share the same modules in one process. Each run is warmed up first (ours: the whole run, so every
batch shape's CUDA graph is captured; the peers: one prompt), then timed twice; the median counts. Quick mode
times SDXL's ~10 s runs once each and takes the timeline from ours' timed run (CUDA events only, no syncs).

Correctness records: a batch-of-one stream run must equal the Fused DDIM Sampler bit for bit (same cached graph,
same per-image seed); the batched run's largest relative latent difference from the prompt-by-prompt path is
recorded (fp16 batched GEMMs round differently; no target). Memory: peak reserved of ours vs the fused path.
Budget: ``sd15_512_stream_3gb`` (and in full mode ``sdxl_1024_stream_4gb``) runs the sampler on an engine built
under the loader's ``stream`` policy with that VRAM budget (automatic batch) and records the peak reserved memory
against the budget (target: within it).
Decode share: for SDXL the peer's per-image time splits into the denoise and the decode (the VAE in fp32); the
records ``peer_decode_ms_per_image`` / ``peer_denoise_ms_per_image`` give the ceiling that overlapping alone can
reach (a decode hidden completely saves at most its share) -- the rest must come from batching the UNet.
Clocks: during the timed runs of ours and of the prompt-by-prompt peer, the mean SM clock and board power
(``gpu_clocks``, nvidia-smi; GPU only): a batch of SDXL images runs the GPU into its power limit and a lower clock.
Timeline: per stage (text, unet, vae) the GPU start/end of every batch from CUDA events on the stage's stream;
records give how much of the decoding ran while a UNet batch was running; in full and smoke mode the spans are
written to ``stream_timeline.json`` (one small artifact).
"""
from __future__ import annotations

import gc
import json
import time
from pathlib import Path

import torch

from .gpu_clocks import INTERVAL_MS, clock_sampler
from .stream_contenders import (ReservedPeak, diffusers_one_by_one, diffusers_pipe, full_parts, fused_one_by_one,
                                make_engine, release_run_memory, seconds, timeline_summary, tiny_parts)

SUITE = "stream"
SMOKE_BUDGET_S = 30
QUICK_BUDGET_S = 100  # budget case ~15 s, SD1.5 8x10 ~20 s, SDXL 8x30 ~50 s
FULL_BUDGET_S = 330

NEGATIVE = "blurry, low quality"
CFG = 7.5
SUBJECTS = ["a lighthouse on a cliff", "a red fox in snow", "a bowl of ramen", "an old library", "a sailing boat",
            "a desert at dusk", "a mountain lake", "a city street in rain", "a cup of coffee", "a vintage car",
            "a field of tulips", "a robot portrait", "a castle in fog", "a koi pond", "a hot air balloon",
            "a forest cabin", "a jellyfish", "a neon sign"]


def _prompts(n: int) -> str:
    return "\n".join(f"{SUBJECTS[i % len(SUBJECTS)]}, photo {i}" for i in range(n))


# --------------------------------------------------------------------------------------------- one case
def _case(ctx, case: str, kind: str, n_prompts: int, steps: int, size: int, targets: dict, timelines: dict,
          sweep: tuple) -> None:
    from ..sampling.stream.settings import StreamSettings

    device = ctx.device
    gpu = device.type == "cuda"
    parts = full_parts(kind, device) if gpu else tiny_parts(kind)
    engine = make_engine(parts, device)
    quick_sdxl = ctx.quick and kind == "sdxl"
    repeat = 1 if quick_sdxl or not gpu else 2
    settings = StreamSettings.from_text(_prompts(n_prompts), negative=NEGATIVE, seed=1000, steps=steps, cfg=CFG,
                                        width=size, height=size, acceleration="cuda_graph", max_batch=0)
    n = settings.n_images
    notes = f"{n} prompts x {steps} steps, {size}x{size}, cfg {CFG}, fp16 UNet, VAE {engine.vae_dtype}"

    first, ours_s, ours_peak, ours_clock, summary = _time_ours(engine, settings, device, repeat, quick_sdxl, case,
                                                               timelines)
    fused_s, ref_lat, fused_peak, fused_clock = _time_fused(engine, settings, device, repeat)
    ours_ips, fused_ips = n / ours_s, n / fused_s
    if gpu and kind == "sdxl":
        _record_decode_share(ctx, case, engine, ref_lat, 1e3 * fused_s / n)
    ctx.record(case, "images_per_s", ours_ips, fused_ips, "fused_ddim_prompt_by_prompt",
               target=targets.get("fused"), target_kind="ratio>=" if "fused" in targets else "",
               lower_is_better=False, unit="img/s",
               notes=f"{notes}; batches {list(first.batch_sizes)}; peer = Fused DDIM Sampler (cuda_graph) + "
                     f"vae_decode per prompt")
    if "diffusers" in targets or not ctx.quick:  # diffusers' pipeline; quick mode: only where it has a target
        _record_diffusers(ctx, case, kind, engine, settings, repeat, ours_ips, targets, notes)
    _record_correctness(ctx, case, engine, first, ref_lat, steps, size)
    if gpu:
        ctx.record(case, "peak_reserved_gb", ours_peak["reserved_gb"], fused_peak["reserved_gb"],
                   "fused_ddim_prompt_by_prompt", unit="GB",
                   notes="torch.cuda.max_memory_reserved during the timed runs (weights included, CUDA context "
                         "excluded), GiB; cache emptied before each contender, ours' graphs and pool buffers "
                         "released before the peer's; ours holds a batch in each stage")
    if ours_clock and fused_clock:
        _record_clocks(ctx, case, ours_clock, fused_clock)
    ctx.record(case, "decode_overlap_fraction", summary["vae_overlap_fraction"], unit="",
               notes=f"share of VAE-stage GPU time that ran while a UNet batch ran; stage ms: unet "
                     f"{summary['unet_ms']:.0f}, vae {summary['vae_ms']:.0f}, text {summary['text_ms']:.1f}, "
                     f"wall {summary['wall_ms']:.0f}")
    _record_sweep(ctx, case, engine, sweep, (n_prompts, steps, size), (n, ours_s, fused_ips), repeat, notes)

    from ..sampling.graph_runner import default_runner

    default_runner().clear(engine)
    placement = engine.placement
    del engine, parts, first, ref_lat
    if hasattr(placement, "remove"):
        placement.remove()
    gc.collect()
    if gpu:
        torch.cuda.empty_cache()


def _time_ours(engine, settings, device, repeat: int, quick_sdxl: bool, case: str, timelines: dict):
    """Ours: a warm-up run (captures each batch shape's graph), the timed runs, one timeline run (quick SDXL: the
    timeline of the timed run). Returns (first result, seconds, peak, clocks, timeline summary)."""
    from ..sampling.stream.scheduler import run_stream
    from ..sampling.stream.streams import Timeline

    first = run_stream(engine, settings, quiet=True)
    timeline = Timeline()
    with ReservedPeak(device) as ours_peak, clock_sampler(device) as ours_clock:
        ours_s = seconds(lambda: run_stream(engine, settings, quiet=True, timeline=timeline if quick_sdxl else None),
                         device, repeat)
    if not quick_sdxl:
        run_stream(engine, settings, timeline=timeline, quiet=True)
    spans = timeline.to_list()
    summary = timeline_summary(spans)
    timelines[case] = {"batch_sizes": list(first.batch_sizes), "summary": summary, "spans": spans}
    return first, ours_s, ours_peak, ours_clock, summary


def _time_fused(engine, settings, device, repeat: int):
    """The Fused DDIM Sampler + decode, prompt by prompt: (seconds, its latents, peak, clocks).

    Ours' CUDA graphs (one per batch shape, each with its memory pool) and its batch-sized pool buffers are dropped
    first, so the peer's peak memory is the peer's own: kept, they would sit reserved through the peer's runs and
    count in its peak (the peer captures its batch-1 graph in its warm-up, outside the timing)."""
    release_run_memory(engine)
    fused_one_by_one(engine, settings, limit=1)
    kept = {}
    with ReservedPeak(device) as fused_peak, clock_sampler(device) as fused_clock:
        fused_s = seconds(lambda: kept.update(out=fused_one_by_one(engine, settings)), device, repeat)
    return fused_s, kept.pop("out")[0], fused_peak, fused_clock


def _record_decode_share(ctx, case: str, engine, ref_lat, per_image: float) -> None:
    """How the peer's per-image time (``per_image`` ms) splits into the decode and the rest."""
    from ..vae.untiled import vae_decode

    with engine.session("vae"):
        dec_s = seconds(lambda: vae_decode(engine, ref_lat[:1]), ctx.device, 3)
    ctx.record(case, "peer_decode_ms_per_image", 1e3 * dec_s, unit="ms",
               notes=f"vae_decode of one latent ({engine.vae_dtype}); the peer's whole image takes "
                     f"{per_image:.0f} ms, so a perfectly hidden decode alone gives at most "
                     f"{per_image / max(per_image - 1e3 * dec_s, 1e-3):.3f}x")
    ctx.record(case, "peer_denoise_ms_per_image", per_image - 1e3 * dec_s, unit="ms",
               notes="the peer's per-image time minus the decode: text encode + steps + host copies")


def _record_diffusers(ctx, case: str, kind: str, engine, settings, repeat: int, ours_ips: float, targets: dict,
                      notes: str) -> None:
    """diffusers' pipeline called prompt by prompt, against ours' throughput."""
    pipe = diffusers_pipe(engine)
    diffusers_one_by_one(pipe, settings, limit=1)
    diff_s = seconds(lambda: diffusers_one_by_one(pipe, settings), ctx.device, repeat)
    del pipe
    ctx.record(case, "images_per_s_vs_diffusers", ours_ips, settings.n_images / diff_s,
               "diffusers_pipeline_prompt_by_prompt",
               target=targets.get("diffusers"), target_kind="ratio>=" if "diffusers" in targets else "",
               lower_is_better=False, unit="img/s",
               notes=f"{notes}; peer = "
                     f"{'StableDiffusionXLPipeline' if kind == 'sdxl' else 'StableDiffusionPipeline'}"
                     f" (DDIMScheduler, eager fp16 SDPA, output_type='pt') per prompt")


def _record_correctness(ctx, case: str, engine, first, ref_lat, steps: int, size: int) -> None:
    """The batched run against the prompt-by-prompt latents (no target), and a batch-of-one run bit for bit."""
    from ..sampling.stream.scheduler import run_stream
    from ..sampling.stream.settings import StreamSettings

    rel = max(((first.latents[i] - ref_lat[i]).abs().max() / ref_lat[i].abs().max().clamp_min(1e-6)).item()
              for i in range(len(ref_lat)))
    ctx.record(case, "batched_max_rel_latent_diff", rel, unit="",
               notes="stream (batched, fp16) vs prompt-by-prompt Fused DDIM latents, same seeds; batched fp16 "
                     "GEMMs round differently, no target")
    one = StreamSettings.from_text(_prompts(2), negative=NEGATIVE, seed=1000, steps=min(steps, 5), cfg=CFG,
                                   width=size, height=size, acceleration="cuda_graph", max_batch=1)
    got = run_stream(engine, one, quiet=True).latents
    want, _ = fused_one_by_one(engine, one)
    ctx.record(case, "batch1_max_abs_latent_diff", (got - want).abs().max().item(), target=0.0,
               target_kind="ours<=", unit="",
               notes="stream with max_batch=1 vs Fused DDIM Sampler, 2 prompts: must be bit-identical")


def _record_sweep(ctx, case: str, engine, sweep: tuple, shape: tuple, timing: tuple, repeat: int, notes: str) -> None:
    """Throughput at each explicit ``max_batch`` of ``sweep`` (no target); ``shape`` = (prompts, steps, size),
    ``timing`` = (images, ours' seconds, the fused peer's images per second)."""
    from ..sampling.stream.scheduler import run_stream
    from ..sampling.stream.settings import StreamSettings

    n_prompts, steps, size = shape
    n, ours_s, fused_ips = timing
    for mb in sweep:
        if hasattr(ctx, "has_time") and not ctx.has_time(ours_s * 3 + 5):
            if hasattr(ctx, "skip"):
                ctx.skip(f"{case}_max_batch_{mb}", "no time left")
            continue
        variant = StreamSettings.from_text(_prompts(n_prompts), negative=NEGATIVE, seed=1000, steps=steps, cfg=CFG,
                                           width=size, height=size, acceleration="cuda_graph", max_batch=mb)
        run_stream(engine, variant, quiet=True)
        t = seconds(lambda: run_stream(engine, variant, quiet=True), ctx.device, repeat)
        ctx.record(f"{case}_max_batch_{mb}", "images_per_s", n / t, fused_ips,
                   "fused_ddim_prompt_by_prompt", lower_is_better=False, unit="img/s",
                   notes=f"{notes}; explicit max_batch={mb} (no target)")


def _record_clocks(ctx, case: str, ours: dict, peer: dict) -> None:
    """SM clock and board power during the timed runs of ours and of the prompt-by-prompt peer (``gpu_clocks``)."""
    limit = max(ours["power_limit_w"], peer["power_limit_w"])
    ctx.record(case, "sm_clock_mhz", ours["sm_mhz"], peer["sm_mhz"], "fused_ddim_prompt_by_prompt",
               lower_is_better=False, unit="MHz",
               notes=f"mean SM clock during the timed runs (nvidia-smi every {INTERVAL_MS} ms; min ours "
                     f"{ours['sm_mhz_min']:.0f}, peer {peer['sm_mhz_min']:.0f} MHz); a GPU at its power limit lowers "
                     f"its clock, so the throughput ratio includes this clock ratio; no target")
    ctx.record(case, "board_power_w", ours["power_w"], peer["power_w"], "fused_ddim_prompt_by_prompt",
               lower_is_better=True, unit="W",
               notes=f"mean board power during the timed runs; power limit {limit:.0f} W; no target")


def _budget_case(ctx, case: str, kind: str, budget_gb: float, n_prompts: int, steps: int, size: int) -> None:
    """The sampler on a ``stream``-policy engine: peak reserved VRAM during a run vs the loader's budget."""
    from ..sampling.stream.scheduler import run_stream
    from ..sampling.stream.settings import StreamSettings

    device = ctx.device
    if device.type != "cuda":
        ctx.skip(case, "needs CUDA (memory budget)")
        return
    gc.collect()
    torch.cuda.empty_cache()
    with ReservedPeak(device) as peak:
        parts = full_parts(kind, device)
        engine = make_engine(parts, device, "stream", budget_gb)
        settings = StreamSettings.from_text(_prompts(n_prompts), negative=NEGATIVE, seed=1000, steps=steps, cfg=CFG,
                                            width=size, height=size, acceleration="cuda_graph", max_batch=0)
        # the full-size weights are built on the GPU and moved by the policy: only the run's own peak counts, so
        # the blocks the build left in torch's cache are returned first (they are not the run's)
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        before_gb = torch.cuda.memory_reserved(device) / 2 ** 30
        t0 = time.perf_counter()
        result = run_stream(engine, settings, quiet=True)
        torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
    ctx.record(case, "peak_reserved_gb", peak["reserved_gb"], budget_gb, "loader budget", target=budget_gb,
               target_kind="ours<=", unit="GB",
               notes=f"stream policy, vram_budget_gb {budget_gb}; {settings.n_images} images x {steps} steps at "
                     f"{size}px, automatic batches {list(result.batch_sizes)}, {settings.n_images / wall:.2f} img/s "
                     f"(first run, captures included); torch.cuda.max_memory_reserved during the run (reserved before it, "
                     f"resident weights: {before_gb:.2f} GB)")
    from ..sampling.graph_runner import default_runner

    default_runner().clear(engine)
    placement = engine.placement
    del engine, parts, result
    if hasattr(placement, "remove"):
        placement.remove()
    gc.collect()
    torch.cuda.empty_cache()


def run(ctx) -> None:
    timelines: dict = {}
    if ctx.smoke:
        plan = [("sd15_512", "sd15", 2, 2, 64, {}, ()), ("sdxl_1024", "sdxl", 2, 1, 64, {}, ())]
    elif ctx.quick:
        plan = [("sd15_512", "sd15", 8, 10, 512, {"fused": 1.5, "diffusers": 2.5}, ()),
                ("sdxl_1024", "sdxl", 8, 30, 1024, {"fused": 1.2}, ())]
    else:
        plan = [("sd15_512", "sd15", 16, 20, 512, {"fused": 1.5, "diffusers": 2.5}, (4, 16)),
                ("sdxl_1024", "sdxl", 8, 30, 1024, {"fused": 1.2}, (1, 4))]
    budgets = [] if ctx.smoke else [("sd15_512_stream_3gb", "sd15", 3.0, 4, 10, 512)]
    if not ctx.smoke and not ctx.quick:
        budgets.append(("sdxl_1024_stream_4gb", "sdxl", 4.0, 2, 10, 1024))

    def run_budgets():
        for case, kind, budget_gb, n_prompts, steps, size in budgets:
            if hasattr(ctx, "has_time") and not ctx.has_time(30):
                ctx.skip(case, "no time left")
                continue
            _budget_case(ctx, case, kind, budget_gb, n_prompts, steps, size)

    if ctx.quick:  # the short budget case first: its target must not be the one the quick call runs out of time for
        run_budgets()
    last_case_s = 0.0  # smoke: the next tiny case needs about what the last one took (more on a loaded host)
    for case, kind, n_prompts, steps, size, targets, sweep in plan:
        if hasattr(ctx, "has_time") and not ctx.has_time(30 if not ctx.smoke else max(1.0, 1.5 * last_case_s)):
            if hasattr(ctx, "skip"):
                ctx.skip(case, "no time left")
            continue
        started = time.perf_counter()
        _case(ctx, case, kind, n_prompts, steps, size, targets, timelines, sweep)
        last_case_s = time.perf_counter() - started
    if not ctx.quick:
        run_budgets()
    if timelines and not ctx.quick:
        path = ctx.artifact_path("stream_timeline.json") if hasattr(ctx, "artifact_path") else \
            Path(ctx.out_dir) / "stream_timeline.json"
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(timelines, indent=1))

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
import statistics
import tempfile
import time
from pathlib import Path

import torch

from .gpu_clocks import INTERVAL_MS, clock_sampler

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


# --------------------------------------------------------------------------------------------- models
def _tokenizer():
    from ..memory.tiny import tiny_tokenizer

    return tiny_tokenizer(Path(tempfile.mkdtemp(prefix="leandiffusion-bench-tok-")))


def _full_parts(kind: str, device):
    from ..memory.engine import ModelParts
    from .models import SCHEDULER, full_text_encoder, full_unet, full_vae

    tok = _tokenizer()
    unet = full_unet(kind, device=device)
    vae = full_vae(device=device)
    te = full_text_encoder("clip_l", device=device)
    if kind == "sd15":
        return ModelParts("sd1", unet, vae, te, tok, dict(SCHEDULER), name="sd15-random")
    te2 = full_text_encoder("clip_g", device=device)
    return ModelParts("sdxl", unet, vae, te, tok, dict(SCHEDULER), text_encoder_2=te2, tokenizer_2=tok,
                      name="sdxl-random")


def _tiny_parts(kind: str):
    from ..memory.engine import parts_from_components
    from ..memory.tiny import build_tiny_components

    return parts_from_components(build_tiny_components("sd1" if kind == "sd15" else "sdxl"), name=f"tiny-{kind}")


def _engine(parts, device, policy="full", budget_gb=4.0):
    from ..memory.load import build_engine

    return build_engine(parts, policy, budget_gb, device=device, weight_dtype="auto", vae_dtype="auto")


def _diffusers_pipe(engine):
    from diffusers import DDIMScheduler, StableDiffusionPipeline, StableDiffusionXLPipeline

    p = engine.parts
    sched = DDIMScheduler(**p.scheduler_config)
    if p.is_sdxl:
        pipe = StableDiffusionXLPipeline(vae=p.vae, text_encoder=p.text_encoder, text_encoder_2=p.text_encoder_2,
                                         tokenizer=p.tokenizer, tokenizer_2=p.tokenizer_2, unet=p.unet,
                                         scheduler=sched, force_zeros_for_empty_prompt=False,
                                         add_watermarker=False)
    else:
        pipe = StableDiffusionPipeline(vae=p.vae, text_encoder=p.text_encoder, tokenizer=p.tokenizer, unet=p.unet,
                                       scheduler=sched, safety_checker=None, feature_extractor=None,
                                       requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


# --------------------------------------------------------------------------------------------- contenders
def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds(fn, device, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _fused_one_by_one(engine, settings, limit=None):
    """The Fused DDIM Sampler + untiled decode, prompt by prompt (image n: its prompt, seed + n, batch 1)."""
    from ..sampling.loop import sample

    s = settings.validated()
    latents, images = [], []
    for job in s.jobs()[:limit]:
        lat = sample(engine, s.sampler_settings(s.prompts[job.prompt_index], job.seed), quiet=True)["samples"]
        with engine.session("vae"):
            images.append(engine.vae_decode(lat))
        latents.append(lat)
    return torch.cat(latents), torch.cat(images)


def _diffusers_one_by_one(pipe, settings, limit=None):
    s = settings.validated()
    out = []
    for job in s.jobs()[:limit]:
        # Denoise in the pipeline, decode with its VAE in the VAE's own dtype: what diffusers' SDXL pipeline does
        # for an fp16 VAE with force_upcast, written out because our shared VAE is already fp32 (the pipeline
        # would hand it fp16 latents) and the same for SD1.5. Postprocessing to 0..1 as output_type="pt" does.
        res = pipe(s.prompts[job.prompt_index], negative_prompt=s.negative, num_inference_steps=s.steps,
                   guidance_scale=s.cfg, height=s.height, width=s.width, output_type="latent",
                   generator=torch.Generator("cpu").manual_seed(job.seed))
        vae = pipe.vae
        with torch.no_grad():
            image = vae.decode(res.images.to(vae.dtype) / vae.config.scaling_factor, return_dict=False)[0]
        out.append((image.float() / 2 + 0.5).clamp(0, 1))
    return out


# --------------------------------------------------------------------------------------------- timeline
def _busy(spans, stage):
    return [(sp["start_ms"], sp["end_ms"]) for sp in spans if sp["stage"] == stage and sp["end_ms"] is not None]


def _overlap_ms(a, b) -> float:
    total = 0.0
    for s0, e0 in a:
        for s1, e1 in b:
            total += max(0.0, min(e0, e1) - max(s0, s1))
    return total


def _timeline_summary(spans) -> dict:
    vae, unet, text = _busy(spans, "vae"), _busy(spans, "unet"), _busy(spans, "text")
    vae_ms = sum(e - s for s, e in vae)
    return {"wall_ms": max((e for _, e in vae + unet + text), default=0.0),
            "unet_ms": sum(e - s for s, e in unet), "vae_ms": vae_ms, "text_ms": sum(e - s for s, e in text),
            "vae_overlapped_ms": _overlap_ms(vae, unet),
            "vae_overlap_fraction": (_overlap_ms(vae, unet) / vae_ms) if vae_ms > 0 else 0.0}


# --------------------------------------------------------------------------------------------- one case
def _case(ctx, case: str, kind: str, n_prompts: int, steps: int, size: int, targets: dict, timelines: dict,
          sweep: tuple) -> None:
    from ..sampling.stream.scheduler import run_stream
    from ..sampling.stream.settings import StreamSettings
    from ..sampling.stream.streams import Timeline

    device = ctx.device
    gpu = device.type == "cuda"
    parts = _full_parts(kind, device) if gpu else _tiny_parts(kind)
    engine = _engine(parts, device)
    quick_sdxl = ctx.quick and kind == "sdxl"
    repeat = 1 if quick_sdxl or not gpu else 2
    settings = StreamSettings.from_text(_prompts(n_prompts), negative=NEGATIVE, seed=1000, steps=steps, cfg=CFG,
                                        width=size, height=size, acceleration="cuda_graph", max_batch=0)
    n = settings.n_images
    notes = f"{n} prompts x {steps} steps, {size}x{size}, cfg {CFG}, fp16 UNet, VAE {engine.vae_dtype}"

    # ours: warm-up (captures each batch shape's graph), timed runs, one timeline run
    first = run_stream(engine, settings, quiet=True)
    timeline = Timeline()
    with _peak(device) as ours_peak, clock_sampler(device) as ours_clock:
        ours_s = _seconds(lambda: run_stream(engine, settings, quiet=True, timeline=timeline if quick_sdxl else None),
                          device, repeat)
    if not quick_sdxl:
        run_stream(engine, settings, timeline=timeline, quiet=True)
    spans = timeline.to_list()
    summary = _timeline_summary(spans)
    timelines[case] = {"batch_sizes": list(first.batch_sizes), "summary": summary, "spans": spans}

    # the Fused DDIM Sampler + decode, prompt by prompt. Ours' CUDA graphs (one per batch shape, each with its memory
    # pool) and its batch-sized pool buffers are dropped first, so the peer's peak memory is the peer's own: kept,
    # they sat reserved through the peer's runs and counted in its peak (the peer recaptures its batch-1 graph in
    # its warm-up below, outside the timing).
    _release_run_memory(engine)
    _fused_one_by_one(engine, settings, limit=1)
    kept = {}
    with _peak(device) as fused_peak, clock_sampler(device) as fused_clock:
        fused_s = _seconds(lambda: kept.update(out=_fused_one_by_one(engine, settings)), device, repeat)
    ref_lat = kept.pop("out")[0]

    ours_ips, fused_ips = n / ours_s, n / fused_s
    if gpu and kind == "sdxl":
        with engine.session("vae"):
            dec_s = _seconds(lambda: engine.vae_decode(ref_lat[:1]), device, 3)
        per_image = 1e3 * fused_s / n
        ctx.record(case, "peer_decode_ms_per_image", 1e3 * dec_s, unit="ms",
                   notes=f"engine.vae_decode of one latent ({engine.vae_dtype}); the peer's whole image takes "
                         f"{per_image:.0f} ms, so a perfectly hidden decode alone gives at most "
                         f"{per_image / max(per_image - 1e3 * dec_s, 1e-3):.3f}x")
        ctx.record(case, "peer_denoise_ms_per_image", per_image - 1e3 * dec_s, unit="ms",
                   notes="the peer's per-image time minus the decode: text encode + steps + host copies")
    ctx.record(case, "images_per_s", ours_ips, fused_ips, "fused_ddim_prompt_by_prompt",
               target=targets.get("fused"), target_kind="ratio>=" if "fused" in targets else "",
               lower_is_better=False, unit="img/s",
               notes=f"{notes}; batches {list(first.batch_sizes)}; peer = Fused DDIM Sampler (cuda_graph) + "
                     f"engine.vae_decode per prompt")

    # diffusers' pipeline, prompt by prompt (quick mode: only where it has a target)
    if "diffusers" in targets or not ctx.quick:
        pipe = _diffusers_pipe(engine)
        _diffusers_one_by_one(pipe, settings, limit=1)
        diff_s = _seconds(lambda: _diffusers_one_by_one(pipe, settings), device, repeat)
        del pipe
        ctx.record(case, "images_per_s_vs_diffusers", ours_ips, n / diff_s, "diffusers_pipeline_prompt_by_prompt",
                   target=targets.get("diffusers"), target_kind="ratio>=" if "diffusers" in targets else "",
                   lower_is_better=False, unit="img/s",
                   notes=f"{notes}; peer = "
                         f"{'StableDiffusionXLPipeline' if kind == 'sdxl' else 'StableDiffusionPipeline'}"
                         f" (DDIMScheduler, eager fp16 SDPA, output_type='pt') per prompt")

    # correctness
    rel = max(((first.latents[i] - ref_lat[i]).abs().max() / ref_lat[i].abs().max().clamp_min(1e-6)).item()
              for i in range(n))
    ctx.record(case, "batched_max_rel_latent_diff", rel, unit="",
               notes="stream (batched, fp16) vs prompt-by-prompt Fused DDIM latents, same seeds; batched fp16 "
                     "GEMMs round differently, no target")
    one = StreamSettings.from_text(_prompts(2), negative=NEGATIVE, seed=1000, steps=min(steps, 5), cfg=CFG,
                                   width=size, height=size, acceleration="cuda_graph", max_batch=1)
    got = run_stream(engine, one, quiet=True).latents
    want, _ = _fused_one_by_one(engine, one)
    ctx.record(case, "batch1_max_abs_latent_diff", (got - want).abs().max().item(), target=0.0,
               target_kind="ours<=", unit="",
               notes="stream with max_batch=1 vs Fused DDIM Sampler, 2 prompts: must be bit-identical")

    # memory and timeline
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

    for mb in sweep:
        if hasattr(ctx, "has_time") and not ctx.has_time(ours_s * 3 + 5):
            if hasattr(ctx, "skip"):
                ctx.skip(f"{case}_max_batch_{mb}", "no time left")
            continue
        variant = StreamSettings.from_text(_prompts(n_prompts), negative=NEGATIVE, seed=1000, steps=steps, cfg=CFG,
                                           width=size, height=size, acceleration="cuda_graph", max_batch=mb)
        run_stream(engine, variant, quiet=True)
        t = _seconds(lambda: run_stream(engine, variant, quiet=True), device, repeat)
        ctx.record(f"{case}_max_batch_{mb}", "images_per_s", n / t, fused_ips, "fused_ddim_prompt_by_prompt",
                   lower_is_better=False, unit="img/s", notes=f"{notes}; explicit max_batch={mb} (no target)")

    from ..sampling.graph_runner import default_runner

    default_runner().clear(engine)
    placement = engine.placement
    del engine, parts, first, ref_lat
    if hasattr(placement, "remove"):
        placement.remove()
    gc.collect()
    if gpu:
        torch.cuda.empty_cache()


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
    with _peak(device) as peak:
        parts = _full_parts(kind, device)
        engine = _engine(parts, device, "stream", budget_gb)
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


def _release_run_memory(engine) -> None:
    """Drop what a contender's runs left on the device for ``engine``: cached CUDA graphs (and their memory pools)
    and the engine's pool buffers; the next run allocates or captures again."""
    from ..sampling.graph_runner import default_runner

    default_runner().clear(engine)
    pool = getattr(engine, "pool", None)
    if pool is not None and hasattr(pool, "release"):
        pool.release()
    gc.collect()


class _peak:
    """Peak reserved memory of a block, in GiB (filled on exit). Like ``harness.peak_memory``: the allocator's
    cached free blocks are returned to the driver before the peak is reset, so blocks an earlier contender left in
    the cache do not count in this block's peak (``max_memory_reserved`` right after a reset is the memory reserved
    at that moment, cached blocks included)."""

    def __init__(self, device):
        self.device = device
        self.out = {"reserved_gb": 0.0}

    def __enter__(self):
        if self.device.type == "cuda":
            gc.collect()
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        return self.out

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.out["reserved_gb"] = torch.cuda.max_memory_reserved(self.device) / 2 ** 30
        return False


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

"""The comfyui suite's Fused KSampler cases: ``LeanKSampler`` against core KSampler (``nodes.common_ksampler``) on
the same random weights, the same CONDITIONING objects, seed, sampler and scheduler, in one process.

Cases (issue targets for ``cuda_graph``: >= 1.6x; ``none`` and ``compile+cuda_graph`` reported beside it): SD1.5 512x512 20 steps ``euler_ancestral`` / ``normal`` and SDXL
1024x1024 30 steps ``dpmpp_2m`` / ``karras``, batch 1, CFG 7.5, fp16, model fully loaded on both sides. Both sides
get embeddings (no text encoding is timed). Also recorded: the largest difference between the two LATENTs (fp16 on
the GPU: reported, not a target; the fp32 equality is the CPU integration test's).
Peers beside ComfyUI: the diffusers pipeline with the matching scheduler (``EulerAncestralDiscreteScheduler``;
``DPMSolverMultistepScheduler`` with Karras sigmas), given the same embeddings (target >= 1.6x). SDXL also runs
with fp8 weights: ``fp8_e4m3fn_fast`` (speed and latent distance from the fp16 run) under the ``balanced`` policy
with the allocator capped at 4 GB (the UNet resident in fp8; the text encoders are not needed, CONDITIONING given).
"""
from __future__ import annotations

import torch

from .comfyui_ours import drop_engine, free_cuda, make_engine, make_parts, node_fn, park_on_cpu
from .comfyui_peer import sd_cond
from .harness import peak_memory, time_ms

SETTINGS = {"sd15": (512, 20, "euler_ancestral", "normal"), "sdxl": (1024, 30, "dpmpp_2m", "karras")}
TARGET = 1.6
ACCELERATIONS = ("none", "cuda_graph", "compile+cuda_graph")  # the targets sit on cuda_graph's rows


def case_fused_ksampler(ctx, comfy, kind: str) -> None:
    dev = ctx.device
    dtype = torch.float16
    hw, steps, sampler, scheduler = SETTINGS[kind]
    repeat = 1 if ctx.quick else 3
    case = f"fused_ksampler_{kind}_{hw}px_{steps}steps_{sampler}_{scheduler}"
    parts = make_parts(kind, comfy, dev, dtype)
    park_on_cpu(parts.unet, parts.vae, parts.text_encoder, parts.text_encoder_2)
    g = torch.Generator("cpu").manual_seed(0)
    context = torch.randn(1, 77, 768 if kind == "sd15" else 2048, generator=g).to(dtype)
    pooled = torch.randn(1, 1280, generator=g).to(dtype) if kind == "sdxl" else None
    pos, neg = sd_cond(kind, context, pooled, hw), sd_cond(kind, context * 0.5, pooled, hw)
    latent = torch.zeros(1, 4, hw // 8, hw // 8)

    patcher = comfy.unet_patcher(parts.unet, dtype)
    run_comfy = lambda: comfy.ksampler(patcher, pos, neg, latent, steps, 7.5, 0, sampler, scheduler)  # noqa: E731
    comfy_ms = time_ms(run_comfy, warmup=1, repeat=repeat, device=dev)
    reference = run_comfy().float().cpu()
    comfy.unload_all()
    del patcher
    free_cuda()

    node = node_fn("LeanKSampler")
    if node is None:
        ctx.skip(case, "LeanKSampler not in this build")
        return
    engine = make_engine(parts, "full", 1e6, dev, dtype)
    ours_ms, graph_kw, graph_out = {}, None, None
    for accel in ACCELERATIONS:
        kw = dict(lean_model=engine, seed=0, steps=steps, cfg=7.5, sampler_name=sampler, scheduler=scheduler,
                  latent_image={"samples": latent}, denoise=1.0, acceleration=accel, positive=pos, negative=neg)
        ours_ms[accel] = time_ms(lambda: node(**kw), warmup=1, repeat=repeat, device=dev)
        with peak_memory(dev) as mem:
            out = node(**kw)[0]["samples"]
        if accel == "cuda_graph":
            graph_kw, graph_out = kw, out
        ctx.record(f"{case}/{accel}", "sampler_ms", ours_ms[accel], comfy_ms, f"ComfyUI {comfy.version} KSampler",
                   target=TARGET if accel == "cuda_graph" else None,
                   target_kind="ratio>=" if accel == "cuda_graph" else "", unit="ms",
                   notes=f"batch 1, CFG 7.5, fp16, same CONDITIONING; peak reserved {mem['reserved_gb']:.2f} GB")
        ctx.record(f"{case}/{accel}", "latent_max_abs_vs_comfyui", float((out - reference).abs().max()),
                   unit="abs", notes=f"fp16 on the GPU; reference max |x| {float(reference.abs().max()):.3f}")
    drop_engine(engine)
    del engine
    free_cuda()
    _diffusers_peer(ctx, parts, kind, case, context, pooled, ours_ms, repeat)
    if kind == "sdxl":
        _fp8(ctx, parts, case, graph_kw, graph_out, repeat)
    del parts
    free_cuda()


def _diffusers_peer(ctx, parts, kind: str, case: str, context, pooled, ours_ms: dict, repeat: int) -> None:
    from diffusers import (DPMSolverMultistepScheduler, EulerAncestralDiscreteScheduler, StableDiffusionPipeline,
                           StableDiffusionXLPipeline)

    dev = ctx.device
    hw, steps, _, _ = SETTINGS[kind]
    config = dict(parts.scheduler_config)
    if kind == "sd15":
        pipe = StableDiffusionPipeline(vae=parts.vae, text_encoder=parts.text_encoder, tokenizer=parts.tokenizer,
                                       unet=parts.unet, scheduler=EulerAncestralDiscreteScheduler.from_config(config),
                                       safety_checker=None, feature_extractor=None, requires_safety_checker=False)
        extra = {}
    else:
        pipe = StableDiffusionXLPipeline(vae=parts.vae, text_encoder=parts.text_encoder,
                                         text_encoder_2=parts.text_encoder_2, tokenizer=parts.tokenizer,
                                         tokenizer_2=parts.tokenizer_2, unet=parts.unet,
                                         scheduler=DPMSolverMultistepScheduler.from_config(config, use_karras_sigmas=True),
                                         add_watermarker=False)
        extra = {"pooled_prompt_embeds": pooled.to(dev), "negative_pooled_prompt_embeds": pooled.to(dev)}
    pipe.set_progress_bar_config(disable=True)
    parts.unet.to(dev)
    run = lambda: pipe(prompt_embeds=context.to(dev), negative_prompt_embeds=(context * 0.5).to(dev),  # noqa: E731
                       guidance_scale=7.5, num_inference_steps=steps, height=hw, width=hw, output_type="latent",
                       generator=torch.Generator("cpu").manual_seed(0), **extra)
    peer_ms = time_ms(run, warmup=1, repeat=repeat, device=dev)
    for accel in ACCELERATIONS[1:]:
        target = TARGET if accel == "cuda_graph" else None
        ctx.record(f"{case}/{accel}", "sampler_ms_vs_diffusers", ours_ms[accel], peer_ms,
                   f"diffusers {type(pipe.scheduler).__name__}", target=target,
                   target_kind="ratio>=" if target else "", unit="ms",
                   notes="the diffusers pipeline with the matching scheduler, same embeddings, fp16, latent out")
    park_on_cpu(parts.unet)
    del pipe, run
    free_cuda()


def _fp8(ctx, parts, case: str, kw: dict, fp16_out, repeat: int) -> None:
    from ..memory.cap import allocator_cap
    from ..memory.load import build_engine
    from ..sampling.graph_runner import default_runner

    dev = ctx.device
    node = node_fn("LeanKSampler")
    engine = build_engine(parts, "balanced", 4.0, "fp8_e4m3fn_fast", "fp16", device=dev)
    kw = dict(kw, lean_model=engine, acceleration="cuda_graph")
    ms = time_ms(lambda: node(**kw), warmup=1, repeat=repeat, device=dev)
    out = node(**kw)[0]["samples"]
    rel = float((out - fp16_out).norm() / fp16_out.norm())
    ctx.record(f"{case}/fp8_e4m3fn_fast", "sampler_ms", ms, None, unit="ms",
               notes=f"fp8 weights, fp8 matmuls, cuda_graph; latent {rel:.3g} (rel L2) from the fp16 run")
    default_runner().clear(engine)  # the capped run captures again, inside the cap
    free_cuda()
    try:
        with allocator_cap(dev, 4 * 2 ** 30), peak_memory(dev) as mem:
            node(**kw)
            node(**kw)
        ctx.record(f"{case}/fp8_4gb", "peak_reserved_gb", mem["reserved_gb"], target=4.0, target_kind="ours<=",
                   unit="GB", notes="balanced policy, UNet resident in fp8, allocator capped at 4 GB")
    except torch.cuda.OutOfMemoryError as exc:
        ctx.record(f"{case}/fp8_4gb", "peak_reserved_gb", float("inf"), target=4.0, target_kind="ours<=",
                   unit="GB", notes=f"out of memory under the cap: {str(exc).splitlines()[0][:160]}")
    drop_engine(engine)
    free_cuda()

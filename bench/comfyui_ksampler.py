"""The comfyui suite's Fused KSampler cases: ``LeanKSampler`` against core KSampler (``nodes.common_ksampler``) on
the same random weights, the same CONDITIONING objects, seed, sampler and scheduler, in one process.

Cases (issue targets for ``cuda_graph``: >= 1.6x): SD1.5 512x512 20 steps ``euler_ancestral`` / ``normal`` and SDXL
1024x1024 30 steps ``dpmpp_2m`` / ``karras``, batch 1, CFG 7.5, fp16, model fully loaded on both sides. Both sides
get embeddings (no text encoding is timed). Also recorded: the largest difference between the two LATENTs (fp16 on
the GPU: reported, not a target; the fp32 equality is the CPU integration test's).
"""
from __future__ import annotations

import torch

from .comfyui_ours import drop_engine, free_cuda, make_engine, make_parts, node_fn, park_on_cpu
from .comfyui_peer import sd_cond
from .harness import peak_memory, time_ms

SETTINGS = {"sd15": (512, 20, "euler_ancestral", "normal"), "sdxl": (1024, 30, "dpmpp_2m", "karras")}
TARGET = 1.6


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
    for accel in ("none", "cuda_graph"):
        kw = dict(lean_model=engine, seed=0, steps=steps, cfg=7.5, sampler_name=sampler, scheduler=scheduler,
                  latent_image={"samples": latent}, denoise=1.0, acceleration=accel, positive=pos, negative=neg)
        ours_ms = time_ms(lambda: node(**kw), warmup=1, repeat=repeat, device=dev)
        with peak_memory(dev) as mem:
            out = node(**kw)[0]["samples"]
        ctx.record(f"{case}/{accel}", "sampler_ms", ours_ms, comfy_ms, f"ComfyUI {comfy.version} KSampler",
                   target=TARGET if accel == "cuda_graph" else None,
                   target_kind="ratio>=" if accel == "cuda_graph" else "", unit="ms",
                   notes=f"batch 1, CFG 7.5, fp16, same CONDITIONING; peak reserved {mem['reserved_gb']:.2f} GB")
        ctx.record(f"{case}/{accel}", "latent_max_abs_vs_comfyui", float((out - reference).abs().max()),
                   unit="abs", notes=f"fp16 on the GPU; reference max |x| {float(reference.abs().max()):.3f}")
    drop_engine(engine)
    del engine, parts
    free_cuda()

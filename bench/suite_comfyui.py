"""ComfyUI's own implementations as peers (``--comfyui PATH``), on the same random weights, in one process:

- ``KSampler`` (sampler ``ddim``, scheduler ``ddim_uniform``): SD1.5 512x512 20 steps and SDXL 1024x1024 30 steps,
  batch 1, CFG 7.5, model fully loaded; against ``LeanFusedDDIMSampler`` (``none`` and ``cuda_graph``).
- ``VAEDecodeTiled`` (its defaults: tile 512, overlap 64, i.e. three offset tilings averaged) at 2048x2048, fp16;
  against ``LeanTiledVAEDecode`` (``exact`` and ``blend``) on our VAE and on ComfyUI's own VAE object.
- ``ImageUpscaleWithModel`` (spandrel model, ``comfy.utils.tiled_scale`` with tile 512 / overlap 32, the model's
  own dtype as loaded, fp32, moved to the GPU and back to the CPU on every call as the node does): RRDB x4 (ESRGAN
  x4plus architecture, random weights); against ``LeanESRGANUpscale``.
- low-VRAM partial loading: SDXL step (1024x1024, CFG batch 2) with ComfyUI behaving as on a card of 4 GiB and of
  1.5 GiB; against the pack's ``stream`` policy at the same budgets.

How ComfyUI is driven (its library modules, each node's body called directly, a smaller card emulated):
``comfyui_peer.py``. Our side goes through the pack's node classes (the public contract: node IDs and input names;
``comfyui_ours.py``); a node or the loader's ``build_engine`` that this build lacks turns its cases into
``ctx.skip`` records, and ComfyUI's number is still recorded (metric ``comfyui_*``, ours = ComfyUI's number, no
peer). Random weights are valid for time and memory only. Memory: ``max_memory_allocated`` /
``max_memory_reserved`` peaks of one run after warm-up (weights resident by then count; the CUDA context does not).
"""
from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Callable, Optional

import torch

from .comfyui_ksampler import case_fused_ksampler
from .comfyui_ours import drop_engine, free_cuda, make_engine, make_parts, node_fn, park_on_cpu, vae_only_parts
from .comfyui_peer import Comfy, sd_cond
from .harness import peak_memory, time_ms
from .models import full_vae, randomize_

SUITE = "comfyui"
REQUIRES_COMFYUI = True
SMOKE_BUDGET_S = 60
QUICK_BUDGET_S = 150
FULL_BUDGET_S = 420

logger = logging.getLogger(__name__)
GiB = 2**30


# --------------------------------------------------------------------------------------------- cases
def record_pair(ctx, case: str, metric: str, ours: Optional[float], peer: float, unit: str, notes: str,
                comfy: Comfy, why_no_ours: str = "") -> None:
    if ours is None:
        ctx.record(case, f"comfyui_{metric}", peer, unit=unit,
                   notes=f"ComfyUI {comfy.version} alone ({why_no_ours}); {notes}")
    else:
        ctx.record(case, metric, ours, peer, f"ComfyUI {comfy.version}", unit=unit, notes=notes)


def case_ksampler(ctx, comfy: Comfy, kind: str) -> None:
    dev, smoke = ctx.device, ctx.smoke
    dtype = torch.float32 if smoke else torch.float16
    hw = {"sd15": 512, "sdxl": 1024}[kind] if not smoke else 64
    steps = {"sd15": 20, "sdxl": 30}[kind] if not smoke else 2
    repeat = 1 if smoke or ctx.quick else 3
    case = f"ksampler_{kind}_{hw}px_{steps}steps"
    parts = make_parts(kind, comfy, dev, dtype)
    # Built on the GPU (fast random init), then parked on the CPU while ComfyUI runs (its peak must not hold our
    # UNet, VAE and text encoders); our engine's ``full`` placement moves them back for our side.
    park_on_cpu(parts.unet, parts.vae, parts.text_encoder, parts.text_encoder_2)
    extra_gib = sum(p.numel() * p.element_size() for m in (parts.vae, parts.text_encoder, parts.text_encoder_2)
                    if m is not None for p in m.parameters()) / 2 ** 30
    g = torch.Generator("cpu").manual_seed(0)
    ctx_dim = 768 if kind == "sd15" else 2048
    context = torch.randn(1, 77, ctx_dim, generator=g).to(dtype)
    pooled = torch.randn(1, 1280, generator=g).to(dtype) if kind == "sdxl" else None
    pos, neg = sd_cond(kind, context, pooled, hw), sd_cond(kind, context * 0.5, pooled, hw)
    latent = torch.zeros(1, 4, hw // 8, hw // 8)

    patcher = comfy.unet_patcher(parts.unet, dtype)
    comfy_ms = time_ms(lambda: comfy.ksampler(patcher, pos, neg, latent, steps, 7.5, 0), warmup=1, repeat=repeat,
                       device=dev)
    with peak_memory(dev) as comfy_mem:
        comfy.ksampler(patcher, pos, neg, latent, steps, 7.5, 0)
    comfy.unload_all()
    del patcher
    free_cuda()

    sampler = node_fn("LeanFusedDDIMSampler")
    engine = make_engine(parts, "full", 1e6, dev, dtype) if sampler is not None else None
    if sampler is not None and engine is None:
        raise RuntimeError("make_engine returned no engine for the full policy")
    notes = f"batch 1, CFG 7.5, {dtype}; ours includes encoding the two prompts, ComfyUI gets embeddings"
    if sampler is None:
        why = "LeanFusedDDIMSampler not in this build"
        ctx.skip(case, why)
        record_pair(ctx, case, "sampler_ms", None, comfy_ms, "ms", notes, comfy, why)
        if dev.type == "cuda":
            record_pair(ctx, case, "peak_reserved_gb", None, comfy_mem["reserved_gb"], "GB", notes, comfy, why)
    for accel in ("none", "cuda_graph") if sampler is not None else ():
        sub = f"{case}/{accel}"
        if accel == "cuda_graph" and dev.type != "cuda":
            ctx.skip(sub, "CUDA graphs need a GPU")
            continue
        kw = dict(lean_model=engine, positive="a photo of a cat", negative="blurry", seed=0, steps=steps, cfg=7.5,
                  eta=0.0, width=hw, height=hw, batch_size=1, timestep_spacing="leading", cfg_mode="batched",
                  acceleration=accel)
        ours_ms = time_ms(lambda: sampler(**kw), warmup=1, repeat=repeat, device=dev)
        with peak_memory(dev) as ours_mem:
            sampler(**kw)
        record_pair(ctx, sub, "sampler_ms", ours_ms, comfy_ms, "ms", notes, comfy)
        if dev.type == "cuda":
            record_pair(ctx, sub, "peak_reserved_gb", ours_mem["reserved_gb"], comfy_mem["reserved_gb"], "GB",
                        f"one run after warm-up, weights resident; ours also holds the text encoder(s) and VAE "
                        f"({extra_gib:.2f} GiB of weights, the full policy), ComfyUI only its UNet (it is given "
                        f"embeddings)", comfy)
    drop_engine(engine)
    del engine, parts
    free_cuda()


def case_vae(ctx, comfy: Comfy) -> None:
    dev, smoke = ctx.device, ctx.smoke
    dtype = torch.float32 if smoke else torch.float16
    hw = 256 if smoke else 2048
    tile, overlap = (128, 32) if smoke else (512, 64)  # 128 px: the smallest tile LeanTiledVAEDecode accepts
    case = f"vae_decode_{hw}px"
    vae = full_vae(device=dev, dtype=dtype)
    cvae = comfy.vae(vae, dtype)
    latent = torch.randn(1, 4, hw // 8, hw // 8, generator=torch.Generator("cpu").manual_seed(0))
    repeat = 1 if smoke else 3

    warm = 0 if smoke else 1
    park_on_cpu(vae)  # ComfyUI's peak must not hold our VAE's weights (ComfyUI decodes with its own copy)
    comfy_ms = time_ms(lambda: comfy.vae_decode_tiled(cvae, latent, tile, overlap), warmup=warm, repeat=repeat,
                       device=dev)
    with peak_memory(dev) as comfy_mem:
        comfy.vae_decode_tiled(cvae, latent, tile, overlap)
    comfy_mem_alloc = comfy_mem["allocated_gb"]

    decode = node_fn("LeanTiledVAEDecode")
    engine = None
    if decode is not None:
        from ..memory.engine import LeanEngine

        parts = vae_only_parts(vae)
        engine = LeanEngine(parts=parts, device=dev, dtype=dtype, vae_dtype=dtype)
    notes = f"{dtype}; ComfyUI VAEDecodeTiled tile {tile} overlap {overlap} (3 tilings averaged)"
    for source in ("ours_vae", "comfy_vae"):
        for mode in ("exact", "blend"):
            sub = f"{case}/{mode}/{source}"
            if decode is None:
                ctx.skip(sub, "LeanTiledVAEDecode not in this build")
                continue
            kw = dict(samples={"samples": latent}, tile_size=tile, overlap=overlap, seam_mode=mode)
            kw.update(lean_model=engine) if source == "ours_vae" else kw.update(vae=cvae)
            comfy.unload_all()
            if source == "ours_vae":  # only the VAE that decodes is on the GPU, as for ComfyUI's own number
                vae.to(dev)
            else:
                park_on_cpu(vae)
            ours_ms = time_ms(lambda: decode(**kw), warmup=warm, repeat=repeat, device=dev)
            with peak_memory(dev) as mem:
                decode(**kw)
            record_pair(ctx, sub, "decode_ms", ours_ms, comfy_ms, "ms", notes, comfy)
            if dev.type == "cuda":
                record_pair(ctx, sub, "peak_allocated_gb", mem["allocated_gb"], comfy_mem_alloc, "GB",
                            "max_memory_allocated of one decode", comfy)
    if decode is None:
        record_pair(ctx, case, "decode_ms", None, comfy_ms, "ms", notes, comfy, "LeanTiledVAEDecode not in this build")
        if dev.type == "cuda":
            record_pair(ctx, case, "peak_allocated_gb", None, comfy_mem_alloc, "GB", notes, comfy,
                        "LeanTiledVAEDecode not in this build")
    comfy.unload_all()
    del engine, cvae, vae
    free_cuda()


def rrdb_x4_state_dict(seed: int = 0) -> dict:
    """A random-weight ESRGAN x4plus (RRDBNet: 23 blocks, 64 features, 32 growth) state dict in spandrel's keys."""
    from spandrel.architectures.ESRGAN import ESRGAN

    net = ESRGAN(in_nc=3, out_nc=3, num_filters=64, num_blocks=23, scale=4)
    randomize_(net, seed)
    with torch.no_grad():  # keep activations O(1) through the residual-in-residual chain
        for name, p in net.named_parameters():
            if p.ndim >= 2:
                p.mul_(0.2)
    return {k: v.detach().contiguous() for k, v in net.state_dict().items()}


def case_upscale(ctx, comfy: Comfy) -> None:
    try:
        from spandrel import ImageModelDescriptor, ModelLoader
    except ImportError as exc:
        ctx.skip("upscale", f"spandrel does not import ({exc}); carry its wheel")
        return
    dev, smoke = ctx.device, ctx.smoke
    size = 32 if smoke else (512 if ctx.quick else 1024)
    case = f"upscale_rrdb_x4_{size}px"
    sd = rrdb_x4_state_dict()
    model = ModelLoader().load_from_state_dict(dict(sd)).eval()
    if not isinstance(model, ImageModelDescriptor):
        raise TypeError(f"spandrel loaded {type(model).__name__}, expected an ImageModelDescriptor")
    image = torch.rand(1, size, size, 3, generator=torch.Generator("cpu").manual_seed(0))
    tile = 512 if not smoke else 32  # 32: the smallest tile LeanESRGANUpscale accepts
    overlap = 32 if not smoke else 4
    comfy_ms = time_ms(lambda: comfy.upscale_with_model(model, image, dev, tile=tile, overlap=overlap),
                       warmup=1, repeat=1 if smoke or ctx.quick else 2, device=dev)
    with peak_memory(dev) as comfy_mem:
        comfy.upscale_with_model(model, image, dev, tile=tile, overlap=overlap)
    model.to("cpu")
    del model
    free_cuda()
    ours_precision = "fp16" if dev.type == "cuda" else "fp32"
    notes = (f"ComfyUI: spandrel model as loaded (fp32), tile {tile} overlap {overlap}; ours: {ours_precision} on "
             f"{dev.type}, tile {tile} overlap {overlap}")
    upscale = node_fn("LeanESRGANUpscale")
    if upscale is None:
        ctx.skip(case, "LeanESRGANUpscale not in this build")
        record_pair(ctx, case, "upscale_ms", None, comfy_ms, "ms", notes, comfy, "LeanESRGANUpscale not in this build")
        return
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory(prefix="leanbench_models_") as models:
        (Path(models) / "upscale_models").mkdir()
        save_file(sd, str(Path(models) / "upscale_models" / "rrdb_x4_random.safetensors"))
        old = os.environ.get("LEANDIFFUSION_MODELS")
        os.environ["LEANDIFFUSION_MODELS"] = models  # this suite's own process; restored below
        try:
            kw = dict(image=image, model_name="rrdb_x4_random.safetensors", output_scale=0.0,
                      device="gpu" if dev.type == "cuda" else "cpu", tile_size=tile, tile_overlap=overlap,
                      precision=ours_precision)
            ours_ms = time_ms(lambda: upscale(**kw), warmup=1, repeat=1 if smoke or ctx.quick else 2, device=dev)
            with peak_memory(dev) as mem:
                upscale(**kw)
        finally:
            if old is None:
                os.environ.pop("LEANDIFFUSION_MODELS", None)
            else:
                os.environ["LEANDIFFUSION_MODELS"] = old
    record_pair(ctx, case, "upscale_ms", ours_ms, comfy_ms, "ms", notes, comfy)
    if dev.type == "cuda":
        record_pair(ctx, case, "peak_allocated_gb", mem["allocated_gb"], comfy_mem["allocated_gb"], "GB",
                    "max_memory_allocated of one upscale", comfy)


def per_step_ms(run: Callable[[int], object], dev, few: int = 2, many: int = 5, repeat: int = 1) -> float:
    """Per-step time as the slope between runs of ``few`` and ``many`` steps: what a run costs besides its steps
    (prompt encoding on the CPU under a small budget, first-use placement) cancels out."""
    t_few = time_ms(lambda: run(few), warmup=1, repeat=repeat, device=dev)
    t_many = time_ms(lambda: run(many), warmup=0, repeat=repeat, device=dev)
    return (t_many - t_few) / (many - few)


def case_lowvram(ctx, comfy: Comfy) -> None:
    dev = ctx.device
    if dev.type != "cuda":
        ctx.skip("lowvram_sdxl", "partial loading needs a GPU")
        return
    dtype, hw, few, many = torch.float16, 1024, 2, 5
    repeat = 1 if ctx.quick else 2
    budgets = (4.0, 1.5)
    # Built on the GPU (fast random init), then parked on the CPU: ComfyUI's emulated card counts what torch
    # holds, so nothing of ours may stay resident while ComfyUI runs.
    parts = make_parts("sdxl", comfy, dev, dtype)
    for m in (parts.unet, parts.vae, parts.text_encoder, parts.text_encoder_2):
        m.to("cpu")
    free_cuda()
    patcher = comfy.unet_patcher(parts.unet, dtype)
    g = torch.Generator("cpu").manual_seed(0)
    context = torch.randn(1, 77, 2048, generator=g).to(dtype)
    pooled = torch.randn(1, 1280, generator=g).to(dtype)
    pos, neg = sd_cond("sdxl", context, pooled, hw), sd_cond("sdxl", context * 0.5, pooled, hw)
    latent = torch.zeros(1, 4, hw // 8, hw // 8)
    comfy_step = {}
    for budget in budgets:
        comfy.unload_all()
        with comfy.card_of(int(budget * GiB), dev):
            ms = per_step_ms(lambda n: comfy.ksampler(patcher, pos, neg, latent, n, 7.5, 0), dev, few, many, repeat)
            with peak_memory(dev) as mem:
                comfy.ksampler(patcher, pos, neg, latent, few, 7.5, 0)
        comfy_step[budget] = (ms, mem["reserved_gb"])
    comfy.unload_all()
    del patcher
    free_cuda()

    sampler = node_fn("LeanFusedDDIMSampler")
    for budget in budgets:
        base = f"lowvram_sdxl_{hw}px/budget_{budget:g}gb"
        c_ms, c_gb = comfy_step[budget]
        notes = (f"SDXL {hw}px, CFG batch 2, per step (slope between {few} and {many} steps); ComfyUI as on a "
                 f"{budget:g} GiB card; ours: stream policy at {budget:g} GB")
        engine, why = None, ""
        if sampler is None:
            why = "LeanFusedDDIMSampler not in this build"
        elif not ctx.has_time(45):
            why = "no time left in the suite budget"
        else:
            free_cuda()
            held_gb = torch.cuda.memory_allocated(dev) / GiB  # ComfyUI's leftovers in this process, if any
            engine = make_engine(parts, "stream", budget, dev, dtype)
            why = "" if engine is not None else "no stream policy in this build (memory.load.build_engine)"
        if engine is None:
            ctx.skip(base, why)
            record_pair(ctx, base, "step_ms", None, c_ms, "ms", notes, comfy, why)
            record_pair(ctx, base, "peak_reserved_gb", None, c_gb, "GB", notes, comfy, why)
            continue
        for accel in ("none", "cuda_graph"):
            if accel == "cuda_graph" and not ctx.has_time(30):
                ctx.skip(f"{base}/{accel}", "no time left in the suite budget")
                continue
            kw = dict(lean_model=engine, positive="a photo of a cat", negative="blurry", seed=0, cfg=7.5, eta=0.0,
                      width=hw, height=hw, batch_size=1, timestep_spacing="leading", cfg_mode="batched",
                      acceleration=accel)
            ms = per_step_ms(lambda n: sampler(steps=n, **kw), dev, few, many, repeat)
            with peak_memory(dev) as mem:
                sampler(steps=few, **kw)
            record_pair(ctx, f"{base}/{accel}", "step_ms", ms, c_ms, "ms", notes, comfy)
            record_pair(ctx, f"{base}/{accel}", "peak_reserved_gb", mem["reserved_gb"], c_gb, "GB", notes, comfy)
            ctx.record(f"{base}/{accel}", "peak_reserved_above_held_gb", mem["reserved_gb"] - held_gb,
                       target=budget, target_kind="ours<=", unit="GB",
                       notes=f"ours: peak reserved minus the {held_gb:.3f} GB the process held allocated before our "
                             f"engine was built (what ComfyUI left); the budget is {budget:g} GB")
        drop_engine(engine)
        del engine
        free_cuda()
    del parts
    free_cuda()


CASES = (
    ("ksampler_sd15", 40, lambda ctx, c: case_ksampler(ctx, c, "sd15")),
    ("vae_decode", 25, case_vae),
    ("upscale", 30, case_upscale),
    ("ksampler_sdxl", 60, lambda ctx, c: case_ksampler(ctx, c, "sdxl")),
    ("lowvram_sdxl", 90, case_lowvram),
    ("fused_ksampler_sd15", 40, lambda ctx, c: case_fused_ksampler(ctx, c, "sd15")),
    ("fused_ksampler_sdxl", 70, lambda ctx, c: case_fused_ksampler(ctx, c, "sdxl")),
)


def run(ctx) -> None:
    if ctx.comfyui is None:
        ctx.skip("*", "needs --comfyui PATH")
        return
    comfy = Comfy(ctx.comfyui, cpu=ctx.device.type != "cuda")
    logger.info("ComfyUI %s from %s", comfy.version, comfy.path)
    # ``LEANDIFFUSION_BENCH_COMFYUI_CASES`` (comma list of case names below) runs only those cases
    only = {c.strip() for c in os.environ.get("LEANDIFFUSION_BENCH_COMFYUI_CASES", "").split(",") if c.strip()}
    for name, need_s, fn in CASES:
        if only and name not in only:
            continue
        if ctx.smoke and name in ("ksampler_sd15", "ksampler_sdxl", "lowvram_sdxl", "fused_ksampler_sd15",
                                  "fused_ksampler_sdxl"):
            ctx.skip(name, "a full-size UNet is too heavy for the CPU smoke run")
            continue
        if not ctx.has_time(need_s if not ctx.smoke else 5):
            ctx.skip(name, f"less than {need_s}s left in the suite budget")
            continue
        fn(ctx, comfy)

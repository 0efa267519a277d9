"""Tiled VAE decode: ``exact`` and ``blend`` against the untiled decode and diffusers' ``enable_tiling()``.

Full-size SD VAE (AutoencoderKL, random weights, bench/models.full_vae), one latent per size, decoded to a CPU
IMAGE by every contender (the untiled peer includes the same 0..1 conversion and device->host copy as ours).
Cases: output 1024 / 2048 / 4096 px, fp16 (and fp32 in full mode). Records per case:
- ``time_ms`` of exact (activation budget ``EXACT_BUDGET``), exact-auto (budget from free VRAM), blend (1024 px
  tiles: exact's bands with estimated statistics for each ResNet block's second GroupNorm, ``vae/estimated_stats.py``)
  and diffusers tiled, each against the untiled decode; targets: exact <= 2.0x, blend <= 1.3x
  (written as ratio >= 0.5 / 0.77 since a ratio is peer/ours);
- ``peak_alloc_gb`` (``max_memory_allocated``, weights included, after ``reset_peak_memory_stats``) with targets
  2048 exact <= 1.5 GB, 4096 exact <= 4 GB (tile budget = min(EXACT_BUDGET, target - weights - 0.3 GiB)); ``peak_reserved_gb`` as a note;
- ``max_abs_diff`` of each tiled output against the untiled one on the 0..1 image (exact fp16 target <= 2/255).
The untiled decode may not fit at 4096 (fp32 needs ~85 GB): then it is recorded as skipped and exact is compared
against nothing but its memory target. ComfyUI's VAEDecodeTiled is measured when ``--comfyui`` is given (on
ComfyUI's own VAE object, with ours parked on the CPU so that ComfyUI's peaks do not hold our weights).
"""
from __future__ import annotations

import logging

import torch

from .harness import peak_memory, time_ms
from .models import full_vae

SUITE = "vae"
SMOKE_BUDGET_S = 20
QUICK_BUDGET_S = 85
FULL_BUDGET_S = 400
EXACT_BUDGET = {1024: 1.0, 2048: 1.0, 4096: 3.0}  # GiB of activations for exact mode (weights excluded)
MEMORY_TARGET_GB = {2048: 1.5, 4096: 4.0}  # peak allocated of exact mode
WORKSPACE_MARGIN_GIB = 0.3
BLEND_TILE = 1024
_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)

logger = logging.getLogger(__name__)


def _has_time(ctx, seconds: float) -> bool:
    fn = getattr(ctx, "has_time", None)
    return True if fn is None else fn(seconds)


def _skip(ctx, case: str, reason: str) -> None:
    fn = getattr(ctx, "skip", None)
    if fn is not None:
        fn(case, reason)
    else:
        logger.info("skip %s: %s", case, reason)


def _to_image(x: torch.Tensor) -> torch.Tensor:
    return (x.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).cpu()


def _measure(ctx, fn, repeat: int):
    """(median ms, output, peak dict) of ``fn``; None when it runs out of memory."""
    dev = ctx.device
    try:
        with peak_memory(dev) as peak:
            out = fn()
        ms = time_ms(fn, warmup=1 if dev.type == "cuda" else 0, repeat=repeat, device=dev)
    except _OOM as exc:
        logger.warning("out of memory: %s", str(exc).splitlines()[0])
        torch.cuda.empty_cache() if dev.type == "cuda" else None
        return None
    return ms, out, dict(peak)


def _comfy_vae(ctx, vae, dtype):
    """ComfyUI's VAE object over the same weights, when a ComfyUI tree was given (else None)."""
    if not ctx.comfyui:
        return None
    import sys

    sys.path.insert(0, str(ctx.comfyui))
    try:
        import comfy.sd
    except ImportError as exc:
        _skip(ctx, "comfyui", f"cannot import ComfyUI from {ctx.comfyui}: {exc}")
        return None
    sd = {k: v.detach().cpu().float() for k, v in vae.state_dict().items()}
    return comfy.sd.VAE(sd=sd, device=ctx.device, dtype=dtype)


def _case(ctx, vae, size: int, dtype: torch.dtype, repeat: int, overlap: int = 64) -> None:
    from ..vae.targets import from_comfy, from_module
    from ..vae.tiled import MIN_TILE, tiled_decode

    name = f"decode_{size}_{str(dtype).replace('torch.', '')}"
    dev = ctx.device
    g = torch.Generator().manual_seed(size)
    z = torch.randn(1, 4, size // 8, size // 8, generator=g)
    target = from_module(vae, dev, dtype)
    gib = 2**30
    budget = None
    if dev.type == "cuda":
        # the tile budget is what the memory target leaves after the weights and a margin for cuDNN workspaces
        # (fp32 weights are twice fp16's), never more than EXACT_BUDGET
        weights_gib = sum(p.numel() * p.element_size() for p in vae.parameters()) / gib
        target_gib = MEMORY_TARGET_GB.get(size)
        act_gib = EXACT_BUDGET.get(size, 1.0)
        if target_gib is not None:
            act_gib = min(act_gib, target_gib - weights_gib - WORKSPACE_MARGIN_GIB)
        budget = int(act_gib * gib)

    untiled = _measure(ctx, lambda: _to_image(vae.decode(z.to(dev, dtype)).sample), repeat)
    if untiled is None:
        _skip(ctx, f"{name}/untiled", "untiled decode ran out of memory on this device")
    ref_ms, ref = (untiled[0], untiled[1]) if untiled else (None, None)
    if untiled:
        ctx.record(name, "untiled_peak_alloc_gb", untiled[2]["allocated_gb"], unit="GB",
                   notes=f"reserved {untiled[2]['reserved_gb']:.2f} GB")

    contenders = [("exact", lambda: tiled_decode(target, z, 0, overlap, "exact", budget_bytes=budget, quiet=True)),
                  ("exact_auto", lambda: tiled_decode(target, z, 0, overlap, "exact", quiet=True)),
                  ("blend", lambda: tiled_decode(target, z, max(MIN_TILE, min(BLEND_TILE, size)), overlap, "blend", quiet=True))]
    if ctx.quick and size > 2048:  # the node's automatic sizing (no time or memory target): quick measures it at 2048
        contenders = [c for c in contenders if c[0] != "exact_auto"]

    def diffusers_tiled():
        vae.enable_tiling()
        try:
            return _to_image(vae.decode(z.to(dev, dtype)).sample)
        finally:
            vae.disable_tiling()

    if not (ctx.quick and size > 2048):  # a peer without a target: quick mode measures it at 2048 only
        contenders.append(("diffusers_tiled", diffusers_tiled))
    comfy_vae = _comfy_vae(ctx, vae, dtype) if size <= 2048 else None
    if comfy_vae is not None:
        contenders.append(("comfyui_tiled", lambda: comfy_vae.decode_tiled(z.to(dev), 64, 64, 8).cpu()))
        ct = from_comfy(comfy_vae)
        contenders.append(("exact_comfy_vae",
                           lambda: tiled_decode(ct, z, 0, 64, "exact", budget_bytes=budget, quiet=True)))
    comfy_labels = ("comfyui_tiled", "exact_comfy_vae")
    for label, fn in contenders:
        if label in comfy_labels:  # ComfyUI's VAE object decodes: our VAE's weights must not sit in its peak
            vae.to("cpu")
        if not _has_time(ctx, 4 * (ref_ms or 4000) / 1000 + 10):
            _skip(ctx, f"{name}/{label}", "no time left in the suite's budget")
            continue
        res = _measure(ctx, fn, repeat)
        if res is None:
            _skip(ctx, f"{name}/{label}", "ran out of memory")
            continue
        ms, out, peak = res
        target_ratio = {"exact": 0.5, "blend": 1 / 1.3}.get(label)
        ctx.record(f"{name}/{label}", "time_ms", ms, ref_ms, "untiled decode" if ref_ms else "",
                   target_ratio if ref_ms else None, "ratio>=" if (ref_ms and target_ratio) else "",
                   unit="ms", notes=f"ours/untiled = {ms / ref_ms:.2f}x" if ref_ms else "untiled did not fit")
        # exact_comfy_vae runs on ComfyUI's own VAE object (ours is parked on the CPU meanwhile); it is recorded
        # without the target (the "exact" row is the node's number)
        mem_target = MEMORY_TARGET_GB.get(size) if label == "exact" else None
        ctx.record(f"{name}/{label}", "peak_alloc_gb", peak["allocated_gb"], target=mem_target,
                   target_kind="ours<=" if mem_target else "", unit="GB",
                   notes=f"max_memory_allocated incl. weights; reserved {peak['reserved_gb']:.2f} GB; "
                         f"budget {budget / gib if budget and 'exact' in label and label != 'exact_auto' else 'auto'}")
        if ref is not None:
            diff = (out.float() - ref).abs().max().item()
            diff_target = 2 / 255 if (label.startswith("exact") and dtype == torch.float16) else None
            if label.startswith("exact") and dtype == torch.float32:
                diff_target = 1e-2  # TF32 convolutions on both sides
            ctx.record(f"{name}/{label}", "max_abs_diff", diff, target=diff_target,
                       target_kind="ours<=" if diff_target else "", unit="(0..1 image)",
                       notes=f"mean abs diff {(out.float() - ref).abs().mean().item():.2e} vs untiled")
        del out
    vae.to(dev)  # back for the next case, where it was parked for ComfyUI's contenders
    del ref


def run(ctx) -> None:
    dev = ctx.device
    if ctx.smoke or dev.type != "cuda":
        from ..memory.tiny import build_tiny_components

        vae = build_tiny_components("sd1")["vae"]
        _case(ctx, vae, 64, torch.float32, repeat=1, overlap=16)
        return
    dtypes = [torch.float16] if ctx.quick else [torch.float16, torch.float32]
    sizes = [2048, 4096] if ctx.quick else [2048, 4096, 1024]  # most important first; 1024 has no target
    for dtype in dtypes:
        vae = full_vae(dev, dtype)
        for size in sizes:
            if dtype == torch.float32 and size == 4096 and ctx.quick:
                continue
            if not _has_time(ctx, 30):
                _skip(ctx, f"decode_{size}_{dtype}", "no time left in the suite's budget")
                continue
            _case(ctx, vae, size, dtype, repeat=2 if ctx.quick and size > 2048 else 3)
            torch.cuda.empty_cache()
        del vae
        torch.cuda.empty_cache()

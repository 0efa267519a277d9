"""The stream suite's contenders and their measuring: the models (full-size random on a GPU, tiny on the CPU), the
prompt-by-prompt peers (the Fused DDIM Sampler + decode, diffusers' pipeline), the timeline summary of a stream
run, and the peak of reserved memory of one contender alone.
"""
from __future__ import annotations

import gc
import statistics
import tempfile
import time
from pathlib import Path

import torch


# --------------------------------------------------------------------------------------------- models
def _tokenizer():
    from ..memory.tiny import tiny_tokenizer

    return tiny_tokenizer(Path(tempfile.mkdtemp(prefix="leandiffusion-bench-tok-")))


def full_parts(kind: str, device):
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


def tiny_parts(kind: str):
    from ..memory.engine import parts_from_components
    from ..memory.tiny import build_tiny_components

    return parts_from_components(build_tiny_components("sd1" if kind == "sd15" else "sdxl"), name=f"tiny-{kind}")


def make_engine(parts, device, policy="full", budget_gb=4.0):
    """An engine over ``parts`` through the loader (``full`` residency, or ``stream`` under ``budget_gb``)."""
    from ..memory.load import build_engine

    return build_engine(parts, policy, budget_gb, device=device, weight_dtype="auto", vae_dtype="auto")


def diffusers_pipe(engine):
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


def seconds(fn, device, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def fused_one_by_one(engine, settings, limit=None):
    """The Fused DDIM Sampler + untiled decode, prompt by prompt (image n: its prompt, seed + n, batch 1)."""
    from ..sampling.loop import sample
    from ..vae.untiled import vae_decode

    s = settings.validated()
    latents, images = [], []
    for job in s.jobs()[:limit]:
        lat = sample(engine, s.sampler_settings(s.prompts[job.prompt_index], job.seed), quiet=True)["samples"]
        with engine.session("vae"):
            images.append(vae_decode(engine, lat))
        latents.append(lat)
    return torch.cat(latents), torch.cat(images)


def diffusers_one_by_one(pipe, settings, limit=None):
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


def timeline_summary(spans) -> dict:
    vae, unet, text = _busy(spans, "vae"), _busy(spans, "unet"), _busy(spans, "text")
    vae_ms = sum(e - s for s, e in vae)
    return {"wall_ms": max((e for _, e in vae + unet + text), default=0.0),
            "unet_ms": sum(e - s for s, e in unet), "vae_ms": vae_ms, "text_ms": sum(e - s for s, e in text),
            "vae_overlapped_ms": _overlap_ms(vae, unet),
            "vae_overlap_fraction": (_overlap_ms(vae, unet) / vae_ms) if vae_ms > 0 else 0.0}


def release_run_memory(engine) -> None:
    """Drop what a contender's runs left on the device for ``engine``: cached CUDA graphs (and their memory pools)
    and the engine's pool buffers; the next run allocates or captures again."""
    from ..sampling.graph_runner import default_runner

    default_runner().clear(engine)
    pool = getattr(engine, "pool", None)
    if pool is not None and hasattr(pool, "release"):
        pool.release()
    gc.collect()


class ReservedPeak:
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

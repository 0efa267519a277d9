"""The two DDIM loops the sampler benchmarks compare, over one engine: diffusers' eager pipeline loop (the peer) and
the Fused DDIM Sampler's ``sampling.loop.denoise``, with the random conditioning of the real shapes both are fed.

Invariant: both loops start from the same initial latent and the same conditioning tensors and run the same
schedule at ``CFG`` (batched), so their final latents compare like for like; neither encodes text.
"""
from __future__ import annotations

import torch

CFG = 7.5


def conditioning(engine, kind: str, batch: int, size: int, seed: int = 0):
    """Random prompt embeddings of the real shapes (SDXL: pooled + time ids) in the engine's dtype, from ``seed``."""
    from ..memory.engine import PromptEmbeds
    from ..sampling.cfg import conditioning_from_embeds

    g = torch.Generator().manual_seed(seed)
    config = engine.parts.unet.config
    dim = config.cross_attention_dim
    pooled = None  # SDXL: the add-embedding input minus the 6 time-id embeddings
    if engine.parts.is_sdxl:
        pooled = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim

    def embeds():
        ctx = torch.randn(1, 77, dim, generator=g).to(engine.device, engine.dtype)
        pool = None if pooled is None else torch.randn(1, pooled, generator=g).to(engine.device, engine.dtype)
        return PromptEmbeds(ctx, pool)

    cond, uncond = embeds(), embeds()
    return conditioning_from_embeds(engine, cond, uncond, batch, size, size)


def use_sdpa(unet) -> str:
    """Pin diffusers' SDPA attention processor (its default on torch 2) for peer and ours alike; returns its name."""
    from diffusers.models.attention_processor import AttnProcessor2_0

    unet.set_attn_processor(AttnProcessor2_0())
    names = {type(p).__name__ for p in unet.attn_processors.values()}
    return ",".join(sorted(names))


def diffusers_loop(engine, conditioning, x_init: torch.Tensor, steps: int, style: str = "pipeline"):
    """The peer: diffusers' pipeline loop (batched CFG + ``DDIMScheduler.step``), fp16 latents as the pipeline keeps.

    ``style="pipeline"``: exactly as ``StableDiffusionPipeline.__call__`` runs it - ``set_timesteps(device=cuda)``,
    so ``DDIMScheduler.step`` indexes its CPU ``alphas_cumprod`` with a CUDA timestep and tests ``prev_timestep >=
    0`` on it: host<->device synchronisations every step. ``style="nosync"``: the same operations with the
    scheduler's timesteps on the CPU (``step`` gets a CPU timestep, no synchronisation) and the UNet's timesteps
    uploaded once before the loop: the fastest honest way to run diffusers' loop eagerly. Timed region (both):
    ``set_timesteps``, the latent upload, ``steps`` x (cat, UNet, guidance, ``step``); no text encoding.
    """
    from diffusers import DDIMScheduler

    unet = engine.parts.unet
    sched = DDIMScheduler(**engine.parts.scheduler_config)
    c, u = conditioning.cond, conditioning.uncond
    context = torch.cat([u.context, c.context])
    added = None
    if conditioning.time_ids is not None:
        added = {"text_embeds": torch.cat([u.pooled, c.pooled]),
                 "time_ids": torch.cat([conditioning.time_ids, conditioning.time_ids])}
    kwargs = {"added_cond_kwargs": added} if added else {}
    if style not in ("pipeline", "nosync"):
        raise ValueError(f"style={style!r}: expected 'pipeline' or 'nosync'")

    @torch.no_grad()
    def run() -> torch.Tensor:
        if style == "pipeline":
            sched.set_timesteps(steps, device=engine.device)
            pairs = [(t, t) for t in sched.timesteps]
        else:
            sched.set_timesteps(steps)
            pairs = list(zip(sched.timesteps, sched.timesteps.to(engine.device)))
        latents = x_init.to(engine.device, engine.dtype)
        for t_sched, t_unet in pairs:
            model_in = torch.cat([latents] * 2)
            pred = unet(model_in, t_unet, encoder_hidden_states=context, return_dict=False, **kwargs)[0]
            pu, pc = pred.chunk(2)
            pred = pu + CFG * (pc - pu)
            latents = sched.step(pred, t_sched, latents, return_dict=False)[0]
        return latents

    return run


def ours_loop(engine, conditioning, x_init, schedule, acceleration, runner):
    from ..sampling.loop import denoise

    def run() -> torch.Tensor:
        with engine.session("unet"):
            return denoise(engine, conditioning, x_init, schedule, CFG, "batched", acceleration, runner=runner,
                           quiet=True)

    return run

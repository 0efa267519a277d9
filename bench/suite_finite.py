"""What the non-finite input checks cost, against one SDXL UNet step (target: at most 1% of the step).

Ours: the checks the Fused DDIM Sampler runs on its tensor inputs before it samples, through the functions it calls
(``sampling.latent_input.check_latent`` on ``latent_image``, ``sampling.conditioning.single_pair`` on
``positive_cond`` and ``negative_cond``), on SDXL's input set at 1024x1024, batch 2: a LATENT [2, 4, 128, 128] and
per side a CONDITIONING [2, 77, 2048] with its ``pooled_output`` [2, 1280], float32 as ComfyUI hands them over.
Each input costs one fp32 sum per tensor and one host read-back (``torchfile.any_non_finite``): three in all.
- ``checks_ms``: the inputs on the GPU (where ComfyUI ``--gpu-only`` keeps them), so each read-back waits for the
  device. Timed from an idle GPU with CUDA events around the calls (host work and syncs included), the median of
  many repeats. Target: ratio (step / checks) >= 100x, i.e. the checks cost <= 1% of one step.
- ``checks_cpu_inputs_ms``: the same inputs on the CPU (ComfyUI's default: LATENT and CONDITIONING live there), host
  time; no target.
- ``refused_nan_inputs``: the timed checks are live: a NaN put into each of the three inputs is refused (target 3).
Peer: one SDXL UNet call at 1024x1024, batch 2 (one image's CFG pair; two images run batch 4, twice this), fp16,
the full-size SDXL architecture with random weights (``models.full_engine``), replayed from a CUDA graph (the
samplers' default mode: the shortest step, so the largest share); the eager call is in the notes.
Not timed: the loader's weight check (``torchfile.refuse_non_finite``) runs on the CPU on the converted modules,
before they are placed on a device, so none of it runs on the GPU.
Smoke: the tiny SDXL model on the CPU, a 64x64 image, eager; the numbers mean nothing.
"""
from __future__ import annotations

import logging

import torch

from .harness import BenchContext, graph_replay, time_ms
from .models import full_engine, tiny_engine

logger = logging.getLogger(__name__)

SUITE = "finite"
SMOKE_BUDGET_S = 5
QUICK_BUDGET_S = 35  # imports, building the SDXL UNet and capturing its step dominate; the checks take milliseconds
FULL_BUDGET_S = 35
TARGET_RATIO = 100.0  # step / checks >= 100: the checks cost at most 1% of one step
BATCH = 2
INPUTS = ("latent_image", "positive_cond", "negative_cond")


def sampler_inputs(engine, size: int, device: torch.device, seed: int = 0) -> dict:
    """The Fused DDIM Sampler's tensor inputs for ``engine`` at ``size`` px, batch ``BATCH``, float32 on ``device``:
    ``{"latent_image": LATENT, "positive_cond": CONDITIONING, "negative_cond": CONDITIONING}``."""
    from ..sampling.loop import vae_scale_factor

    g = torch.Generator().manual_seed(seed)
    config = engine.parts.unet.config
    pooled = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
    side = size // vae_scale_factor(engine)

    def conditioning():
        return [[torch.randn(BATCH, 77, config.cross_attention_dim, generator=g).to(device),
                 {"pooled_output": torch.randn(BATCH, pooled, generator=g).to(device)}]]

    latent = torch.randn(BATCH, engine.parts.latent_channels, side, side, generator=g).to(device)
    return {"latent_image": {"samples": latent}, "positive_cond": conditioning(), "negative_cond": conditioning()}


def sampler_checks(engine, inputs: dict):
    """The checks the Fused DDIM Sampler runs on ``inputs`` (``sampler_inputs``), as one call."""
    from ..sampling import conditioning, latent_input

    def run() -> None:
        latent_input.check_latent(engine, inputs["latent_image"])
        conditioning.single_pair(inputs["positive_cond"], "positive_cond")
        conditioning.single_pair(inputs["negative_cond"], "negative_cond")

    return run


def unet_step(engine, inputs: dict, size: int):
    """One UNet call on the inputs' latent and positive conditioning (SDXL's pooled output and time ids)."""
    dev, dtype = engine.device, engine.dtype
    context, extras = inputs["positive_cond"][0]
    kwargs = {"sample": inputs["latent_image"]["samples"].to(dev, dtype), "timestep": torch.tensor(500, device=dev),
              "encoder_hidden_states": context.to(dev, dtype),
              "added_cond_kwargs": {"text_embeds": extras["pooled_output"].to(dev, dtype),
                                    "time_ids": torch.tensor([[size, size, 0, 0, size, size]] * BATCH, device=dev,
                                                             dtype=dtype)}}

    @torch.no_grad()
    def call() -> torch.Tensor:
        return engine.parts.unet(**kwargs, return_dict=False)[0]

    return call


def refused_nan_inputs(engine, inputs: dict) -> int:
    """How many of the inputs the checks refuse, by name, when a NaN is put into each in turn."""
    refused = 0
    for name in INPUTS:
        poisoned = dict(inputs)
        if name == "latent_image":
            samples = inputs[name]["samples"].clone()
            samples.view(-1)[7] = float("nan")
            poisoned[name] = {"samples": samples}
        else:
            cond, extras = inputs[name][0]
            cond = cond.clone()
            cond.view(-1)[7] = float("nan")
            poisoned[name] = [[cond, extras]]
        try:
            sampler_checks(engine, poisoned)()
        except ValueError as exc:
            refused += str(exc).startswith(f"{name}: holds 1 NaN")
    return refused


def _step_ms(engine, inputs: dict, size: int, repeat: int) -> tuple[float, str, float]:
    """(the peer's step ms, its name, the eager step ms): the CUDA-graph replay on a GPU, else the eager call."""
    call = unet_step(engine, inputs, size)
    eager = time_ms(call, warmup=1 if repeat == 1 else 2, repeat=repeat, device=engine.device)
    if engine.device.type != "cuda":
        return eager, "SDXL UNet step (eager)", eager
    try:
        with torch.no_grad():
            replay, _ = graph_replay(call, engine.device)
    except RuntimeError as exc:  # the eager step is then the peer: longer, so a less strict share
        logger.warning("capturing the SDXL step failed (%s); the peer is the eager step", exc)
        return eager, "SDXL UNet step (eager; capture failed)", eager
    return time_ms(replay, warmup=2, repeat=repeat, device=engine.device), "SDXL UNet step (CUDA graph)", eager


def _case(ctx: BenchContext, engine, size: int, case: str) -> None:
    dev = engine.device
    repeat = 1 if ctx.smoke else (5 if ctx.quick else 10)
    checks_repeat = 5 if ctx.smoke else (50 if ctx.quick else 200)
    inputs = sampler_inputs(engine, size, dev)
    step, peer, eager = _step_ms(engine, inputs, size, repeat)
    gpu = time_ms(sampler_checks(engine, inputs), warmup=5, repeat=checks_repeat, device=dev)
    host_inputs = sampler_inputs(engine, size, torch.device("cpu"))
    host = time_ms(sampler_checks(engine, host_inputs), warmup=5, repeat=checks_repeat, device=torch.device("cpu"))
    shapes = (f"latent {list(inputs['latent_image']['samples'].shape)}, 2 x CONDITIONING "
              f"{list(inputs['positive_cond'][0][0].shape)} + pooled "
              f"{list(inputs['positive_cond'][0][1]['pooled_output'].shape)}, float32")
    ctx.record(case, "checks_ms", gpu, step, peer, TARGET_RATIO, "ratio>=", unit="ms",
               notes=f"target: the checks <= 1% of one step (here {100 * gpu / step:.3f}%); the Fused DDIM Sampler's "
                     f"checks of latent_image, positive_cond, negative_cond on {dev.type} tensors ({shapes}): one "
                     f"fp32 sum per tensor, one read-back per input; peer: UNet batch {BATCH} at {size}x{size}, "
                     f"{str(engine.dtype).replace('torch.', '')}, eager {eager:.2f} ms")
    ctx.record(case, "checks_cpu_inputs_ms", host, step, peer, unit="ms",
               notes=f"the same checks on CPU tensors (ComfyUI's default place for LATENT and CONDITIONING): host "
                     f"time, {100 * host / step:.3f}% of the step")
    ctx.record(case, "refused_nan_inputs", refused_nan_inputs(engine, inputs), target=len(INPUTS),
               target_kind="ours>=", unit="inputs",
               notes="the timed checks are live: a NaN in each of latent_image, positive_cond, negative_cond is "
                     "refused by name")


def run(ctx: BenchContext) -> None:
    if ctx.smoke:
        _case(ctx, tiny_engine("sdxl"), 64, "tiny-sdxl-64-b2")
        return
    if ctx.device.type != "cuda":
        raise RuntimeError("the finite suite needs a CUDA device outside smoke mode")
    engine = full_engine("sdxl", ctx.device)
    _case(ctx, engine, 1024, "sdxl-1024-b2")

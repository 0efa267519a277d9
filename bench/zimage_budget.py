"""The zimage suite's budget cases: full-size Z-Image-Turbo under a VRAM budget with the allocator capped at it, our
``stream`` policy against diffusers' leaf-level group offload (with streams) under the same cap.

Invariants
- Each side gets its own host copy of the same weights (a placement owns where its modules live; group offload
  installs hooks on its modules), built on the GPU and moved to the host before either side runs.
- The cap is ``memory.cap.allocator_cap`` at the budget (PyTorch's ``set_per_process_memory_fraction``): a side that
  needs more fails with out of memory instead of passing quietly. Peak reserved memory is read back as well.
- Times are prompt -> latent end to end, 9 steps at 1024x1024, cfg 1, as the resident case; the ratio targets compare
  with the resident ``cuda_graph`` time of the same run (``resident_ms``). Ours asks for ``cuda_graph`` as a user
  would; a DiT that streams steps eagerly whatever it asks (``sampling.dit_steps.streams_weights``), and bf16
  weights cross packed where the plan says so (``memory/packed_weights.py``).
- The e2e row's notes split the time: the text stage alone (timed after the runs, same engine and cap) and the
  DiT steps' share, and the pinned host-to-device bandwidth of the machine (what a streamed run is bound by).
- ``decode_gb_per_s``: the packed-weights decode kernel (``kernels/bf16_unpack.py``) alone on one DiT-block-sized
  unit of bf16 Gaussian weights (bf16 bytes out per second, best of three), checked bit-exact: its SM time per
  step competes with the streamed step's compute. GPU only.
- Smoke mode (the CPU): the tiny Z-Image of the suite's resident part (same seed) through the same code; no cap.
"""
from __future__ import annotations

import gc
import logging

import torch

from .harness import BenchContext, peak_memory, time_ms
from .suite_device import pinned_host_to_device_gbps
from ..sampling.flow.text import encode_prompts
from .zimage_models import PROMPT, ours_run, peer_run

logger = logging.getLogger(__name__)

GiB = 2 ** 30


def on_gpu(ctx: BenchContext) -> bool:
    return not ctx.smoke and ctx.device.type == "cuda"


def host_components(ctx: BenchContext, dtype: torch.dtype = torch.bfloat16) -> dict:
    """A fresh components dict on the host: the full-size random Z-Image (built on the GPU, where filling the
    weights is fast, then moved), or in smoke mode the suite's tiny Z-Image (seed 0, fp32)."""
    if not on_gpu(ctx):
        from ..memory.tiny_zimage import build_tiny_zimage

        return build_tiny_zimage(seed=0)
    from .zimage_models import full_zimage_components

    comps = full_zimage_components(ctx.device, dtype)
    for key in ("transformer", "text_encoder", "vae"):
        comps[key] = comps[key].to("cpu")
    torch.cuda.empty_cache()
    return comps


def free_device() -> None:
    """Collect garbage and return the caching allocator's free blocks (a no-op for CUDA without a GPU)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _ours(ctx: BenchContext, comps: dict, budget_gb: float, weight_dtype: str, size: int, steps: int, repeat: int):
    from ..memory.cap import allocator_cap
    from ..memory.engine import parts_from_components
    from ..memory.load import build_engine

    engine = build_engine(parts_from_components(comps, name="zimage-random"), "stream", vram_budget_gb=budget_gb,
                          weight_dtype=weight_dtype, vae_dtype="bf16" if on_gpu(ctx) else "fp32", device=ctx.device)
    logger.info("%s", engine.placement.report())
    run = ours_run(engine, size, steps, "cuda_graph")
    with allocator_cap(ctx.device, int(budget_gb * GiB)), peak_memory(ctx.device) as mem:
        ms = time_ms(run, warmup=1, repeat=repeat, device=ctx.device)
        latent = run().float().cpu()
    with allocator_cap(ctx.device, int(budget_gb * GiB)):
        text_ms = time_ms(lambda: encode_prompts(engine, [PROMPT]), warmup=0, repeat=2, device=ctx.device)
    del engine, run
    free_device()
    return ms, mem["reserved_gb"], latent, text_ms


DECODE_WORDS = 170_000_000  # about one Z-Image DiT block in bf16


def _decode_rate(device: torch.device) -> tuple[float, bool]:
    """(GB/s of bf16 out, bit-exact) of the decode kernel on one block-sized packed unit (module docstring)."""
    from ..memory.packed_weights import pack_words

    gen = torch.Generator(device).manual_seed(0)
    words = (torch.randn(DECODE_WORDS, device=device, generator=gen) * 0.02).to(torch.bfloat16).view(torch.int16)
    unit = pack_words(words, device=device)
    slot = unit.host.tensor.to(device)
    out = torch.empty(2 * DECODE_WORDS, dtype=torch.uint8, device=device)
    ms = min(time_ms(lambda: unit.unpack_into(slot, out), warmup=1, repeat=5, device=device) for _ in range(3))
    exact = torch.equal(out.view(torch.int16), words)
    unit.host.release()
    del words, slot, out
    free_device()
    return 2 * DECODE_WORDS / ms / 1e6, exact


def _peer(ctx: BenchContext, comps: dict, budget_gb: float, size: int, steps: int, repeat: int):
    from diffusers.hooks import apply_group_offloading

    from ..memory.cap import allocator_cap
    from .zimage_models import zimage_pipeline

    pipe = zimage_pipeline(comps)
    for module in (pipe.transformer, pipe.text_encoder):
        apply_group_offloading(module, onload_device=ctx.device, offload_device=torch.device("cpu"),
                               offload_type="leaf_level", use_stream=True, record_stream=True)
    pipe.vae.to(ctx.device)
    run = peer_run(pipe, size, steps)
    with allocator_cap(ctx.device, int(budget_gb * GiB)), peak_memory(ctx.device) as mem:
        ms = time_ms(run, warmup=1, repeat=repeat, device=ctx.device)
    del pipe, run
    free_device()
    return ms, mem["reserved_gb"]


def budget_case(ctx: BenchContext, case: str, budget_gb: float, weight_dtype: str, resident_ms: float,
                resident_latent, steps: int, repeat: int, with_peer: bool, size: int = 1024) -> None:
    """Our ``stream`` at ``budget_gb`` (and, ``with_peer``, diffusers' group offload under the same cap)."""
    dtype = torch.bfloat16
    comps = host_components(ctx, dtype)
    try:
        ms, peak, latent, text_ms = _ours(ctx, comps, budget_gb, weight_dtype, size, steps, repeat)
    except torch.cuda.OutOfMemoryError as exc:
        ctx.record(case, "peak_reserved_gb", float("inf"), target=budget_gb, target_kind="ours<=", unit="GB",
                   notes=f"out of memory under the cap: {str(exc).splitlines()[0][:160]}")
        return
    ctx.record(case, "peak_reserved_gb", peak, target=budget_gb, target_kind="ours<=", unit="GB",
               notes="allocator capped at the budget; every stage of the sampler node (text, DiT)")
    split = f"text stage {text_ms:.0f} ms, DiT steps ~{(ms - text_ms) / steps:.0f} ms each"
    if on_gpu(ctx):
        rate = pinned_host_to_device_gbps(ctx.device, 512 << 20, 10)
        split += f"; pinned host-to-device {rate:.0f} GB/s"
    ctx.record(case, "e2e_ms_vs_resident", ms, resident_ms, f"resident {weight_dtype} cuda_graph", target=0.8,
               target_kind="ratio>=", unit="ms",
               notes=f"target: <= 1.25x the fully resident time (ratio >= 0.8); {split}")
    if on_gpu(ctx) and weight_dtype == "bf16":
        rate, exact = _decode_rate(ctx.device)
        ctx.record(case, "decode_gb_per_s", rate, unit="GB/s", lower_is_better=False,
                   notes=f"packed-weights decode kernel alone, one block-sized unit; bit-exact: {exact}")
    if resident_latent is not None:
        rel = ((latent.double() - resident_latent.double()).norm() / resident_latent.double().norm()).item()
        ctx.record(case, "rel_vs_resident", rel, target=2e-2, target_kind="ours<=", unit="rel L2",
                   notes="the streamed run against the resident run of the same weights")
    if with_peer and ctx.has_time(60):
        comps = host_components(ctx, dtype)
        peer_ms, peer_peak = _peer(ctx, comps, budget_gb, size, steps, repeat)
        ctx.record(case, "e2e_ms_vs_group_offload", ms, peer_ms, "diffusers leaf group offload + streams",
                   target=1.45, target_kind="ratio>=", unit="ms", notes=f"peer peak reserved {peer_peak:.2f} GB")

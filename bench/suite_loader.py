"""Loader suite: the ``stream`` VRAM policy on a full-size SDXL UNet against full residency and offload peers.

Case ``sdxl_128_b2``: random-weight SDXL UNet, fp16, 128x128 latent (1024x1024 image), batch 2 (one CFG pair),
one UNet call per step, all in one process on one GPU. Measured per configuration: step time (median of CUDA-event
timed calls after warm-up) and ``max_memory_reserved`` from placing the weights through the timed calls (the CUDA
context is not allocator memory, so it is excluded by construction).

Configurations: ``full`` eager and ``full`` CUDA graph (the references, diffusers' own UNet), the ``full`` CUDA graph
with the engine's UNet patches in place (one-pass GEGLU, GroupNorm kernels: what every UNet session of the samplers
runs; recorded with its distance from the plain graph), ``stream`` at 4 GB and 1.5 GB budgets
(eager and CUDA graph), diffusers group offload (leaf_level, use_stream=True, record_stream=True) and
``accelerate.cpu_offload`` (sequential offload).

Targets: stream@4GB peak reserved <= 4.0 GB and step <= 1.25x full eager; stream@1.5GB step <= 0.6x diffusers'
group offload; at both budgets peak reserved <= the budget, eager and under CUDA graphs. Parity records: stream
outputs vs full (fp16, max abs diff / max abs, target <= 1e-3) and graph replay vs eager.

``ctx.smoke``: the tiny SD1 model on the CPU through the same code (numbers are meaningless; checks plumbing).
"""
from __future__ import annotations

import gc
import logging

import torch

from .harness import BenchContext, graph_replay, peak_memory, time_ms

logger = logging.getLogger(__name__)

SUITE = "loader"
QUICK_BUDGET_S = 65  # the SDXL UNet is built three times; the accelerate offload peer is slow
CASE = "sdxl_128_b2"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


def _parts_with(unet, family="sdxl"):
    from ..memory.engine import parts_from_components
    from ..memory.tiny import build_tiny_components

    comps = build_tiny_components(family)
    comps["unet"] = unet
    return parts_from_components(comps, name=f"{family}-random")


def _fresh_unet(device):
    from .models import full_unet

    unet = full_unet("sdxl", device=device, dtype=torch.float16).to("cpu")
    torch.cuda.empty_cache()
    return unet


def _free():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def run(ctx: BenchContext) -> None:
    if ctx.smoke:
        _smoke(ctx)
        return
    from ..memory.unet_layout import unet_input
    from .models import unet_inputs

    dev = ctx.device
    repeat = 3 if ctx.quick else 7
    inputs = unet_inputs("sdxl", batch=2, latent_hw=128, device=dev, dtype=torch.float16)

    def call(unet, engine_layout: bool = False):
        if engine_layout:  # LeanEngine.unet's call: the input in the layout unet_layout picks, the output contiguous
            return lambda: unet(**dict(inputs, sample=unet_input(unet, inputs["sample"]))).sample.contiguous()
        return lambda: unet(**inputs).sample

    results = {}
    with torch.no_grad():
        parts = _parts_with(_fresh_unet(dev))
        ref = _measure_full(parts, call, dev, repeat, results)
        for budget in (4.0, 1.5):
            _measure_stream(ctx, parts, call, ref, budget, repeat, results)
        del parts
        _free()
        _measure_offload_peers(ctx, call, ref, repeat, results)
    _record_results(ctx, results)


def _measure_full(parts, call, dev, repeat: int, results: dict) -> torch.Tensor:
    """``full`` residency, eager and CUDA graph (the references); returns the eager output."""
    from ..memory.policies import apply_vram_policy

    with peak_memory(dev) as peak:
        placement = apply_vram_policy(parts, "full", device=dev, dtype=torch.float16)
        ref = call(parts.unet)().clone()
        full_ms = time_ms(call(parts.unet), warmup=2, repeat=repeat, device=dev)
    results["full eager"] = (full_ms, peak["reserved_gb"])
    replay, _ = graph_replay(call(parts.unet), dev)
    results["full cuda graph"] = (time_ms(replay, warmup=2, repeat=repeat, device=dev), None)
    del replay
    results["pack kernels"] = _measure_pack_kernels(parts.unet, call, ref, dev, repeat)
    placement.remove()
    _free()
    return ref


def _measure_pack_kernels(unet, call, ref, dev, repeat: int) -> tuple:
    """The CUDA-graph step inside the engine's UNet patches and layout: (ms, max-abs distance of its output from
    ``ref``, the plain eager step, relative to ``ref``'s largest value)."""
    from ..memory.unet_layout import layout_following_transformers
    from ..memory.unet_norms import fused_norms
    from ..memory.unet_patches import fused_geglus

    with fused_geglus(unet), fused_norms(unet), layout_following_transformers(unet):
        replay, out = graph_replay(call(unet, engine_layout=True), dev)
        ms = time_ms(replay, warmup=2, repeat=repeat, device=dev)
        replay()
        torch.cuda.synchronize(dev)
        rel = _rel(out, ref)
    del replay
    return ms, rel


def _measure_stream(ctx, parts, call, ref, budget: float, repeat: int, results: dict) -> None:
    """``stream`` at ``budget`` GB: eager, then CUDA graph (the sampler's mode), each checked against its reference."""
    from ..memory.policies import apply_vram_policy

    dev = ctx.device
    with peak_memory(dev) as peak:
        placement = apply_vram_policy(parts, "stream", device=dev, dtype=torch.float16, vram_budget_gb=budget)
        out = call(parts.unet)().clone()
        ms = time_ms(call(parts.unet), warmup=2, repeat=repeat, device=dev)
    name = f"stream {budget:g}GB"
    results[name] = (ms, peak["reserved_gb"])
    ctx.record(CASE, f"parity_{name.replace(' ', '_')}", _rel(out, ref), target=1e-3, target_kind="ours<=",
               unit="rel", notes="max|stream - full| / max|full|, fp16")
    logger.info("%s", placement.report())
    plan = placement.plan
    ctx.record(CASE, f"plan_{name.replace(' ', '_')}_streamed_gb", plan.unet_streamed_bytes / 2**30, unit="GB",
               notes=f"resident {(plan.unet_fixed_bytes + plan.unet_resident_bytes) / 2**30:.2f} GB, arena "
                     f"{plan.arena_bytes / 2**30:.2f} GB, activation estimate "
                     f"{plan.unet_activation_bytes / 2**30:.2f} GB, est step {plan.est_step_ms:.0f} ms")
    with peak_memory(dev) as gpeak:
        replay, gout = graph_replay(call(parts.unet), dev)
        gms = time_ms(replay, warmup=2, repeat=repeat, device=dev)
    replay()
    eager = call(parts.unet)()
    torch.cuda.synchronize(dev)
    ctx.record(CASE, f"parity_{name.replace(' ', '_')}_graph_vs_eager", _rel(gout, eager), target=1e-3,
               target_kind="ours<=", unit="rel", notes="CUDA graph replay of the streamed UNet vs eager")
    results[f"{name} cuda graph"] = (gms, gpeak["reserved_gb"])
    del replay, gout
    placement.remove()
    _free()


def _measure_offload_peers(ctx, call, ref, repeat: int, results: dict) -> None:
    """diffusers' group offload (leaf level, stream, record_stream) and accelerate's sequential CPU offload."""
    dev = ctx.device
    unet = _fresh_unet(dev)
    with peak_memory(dev) as peak:
        unet.enable_group_offload(onload_device=dev, offload_device=torch.device("cpu"), offload_type="leaf_level",
                                  use_stream=True, record_stream=True)
        gout = call(unet)().clone()
        go_ms = time_ms(call(unet), warmup=2, repeat=repeat, device=dev)
    # ``peak`` is filled when the ``with`` block exits: read it after, never inside.
    results["diffusers group offload"] = (go_ms, peak["reserved_gb"])
    ctx.record(CASE, "parity_group_offload_vs_full", _rel(gout, ref), unit="rel", notes="peer sanity check")
    del unet, gout
    _free()

    from accelerate import cpu_offload

    unet = _fresh_unet(dev)
    with peak_memory(dev) as peak:
        cpu_offload(unet, execution_device=dev)
        ac_ms = time_ms(call(unet), warmup=1, repeat=2 if ctx.quick else 3, device=dev)
    results["accelerate cpu_offload"] = (ac_ms, peak["reserved_gb"])
    del unet
    _free()


def _record_results(ctx, results: dict) -> None:
    """One step-time and one peak record per configuration, with the targets on the stream rows."""
    full_ms = results["full eager"][0]
    go_ms = results["diffusers group offload"][0]
    for name, (ms, gb) in results.items():
        if name == "pack kernels":
            ctx.record(CASE, "step_ms_full_cuda_graph_pack_kernels", ms, results["full cuda graph"][0],
                       "full cuda graph (diffusers' UNet as is)", unit="ms",
                       notes=f"inside the engine's UNet patches (one-pass GEGLU, GroupNorm kernels with each resnet's "
                             f"add and SiLU, unet_layout's activation layout); output max|d|/max|plain eager| "
                             f"{gb:.2g}")
        elif name == "stream 4GB":
            ctx.record(CASE, "step_ms_stream_4GB", ms, full_ms, "full eager", target=1 / 1.25, target_kind="ratio>=",
                       unit="ms", notes="target: <= 1.25x the full eager step")
            ctx.record(CASE, "peak_reserved_gb_stream_4GB", gb, target=4.0, target_kind="ours<=", unit="GB",
                       notes="target: peak <= budget")
        elif name == "stream 1.5GB":
            ctx.record(CASE, "step_ms_stream_1.5GB", ms, go_ms, "diffusers group offload (leaf, stream)",
                       target=1 / 0.6, target_kind="ratio>=", unit="ms", notes="target: <= 0.6x group offload step")
            ctx.record(CASE, "peak_reserved_gb_stream_1.5GB", gb, target=1.5, target_kind="ours<=", unit="GB",
                       notes="target: peak <= budget")
        elif name.startswith("stream ") and name.endswith(" cuda graph"):
            budget = float(name.split()[1][:-2])
            ctx.record(CASE, f"step_ms_{name.replace(' ', '_')}", ms, unit="ms", notes="the sampler's mode")
            ctx.record(CASE, f"peak_reserved_gb_{name.replace(' ', '_')}", gb, target=budget, target_kind="ours<=",
                       unit="GB", notes="target: peak <= budget (capture warm-up, capture and replays)")
        else:
            ctx.record(CASE, f"step_ms_{name.replace(' ', '_')}", ms, unit="ms", notes="reference/peer")
            if gb is not None:
                ctx.record(CASE, f"peak_reserved_gb_{name.replace(' ', '_')}", gb, unit="GB")


def _smoke(ctx: BenchContext) -> None:
    """Tiny SD1 on the CPU: full vs stream through the same code paths (plumbing check, seconds)."""
    from ..memory.plan import GiB, module_bytes
    from ..memory.policies import apply_vram_policy, stream_working_minimum_gb
    from ..memory.tiny import build_tiny_components
    from ..memory.engine import parts_from_components

    def parts():
        return parts_from_components(build_tiny_components("sd1"), name="tiny-sd1")

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 8, 8, generator=g)
    c = torch.randn(2, 77, 64, generator=g)
    with torch.no_grad():
        p_full = parts()
        apply_vram_policy(p_full, "full", device="cpu")
        ref = p_full.unet(x, 500, encoder_hidden_states=c).sample
        full_ms = time_ms(lambda: p_full.unet(x, 500, encoder_hidden_states=c), warmup=1, repeat=2,
                          device=torch.device("cpu"))
        p_str = parts()
        budget = stream_working_minimum_gb(p_str, "cpu") + 0.3 * module_bytes(p_str.unet, torch.float32) / GiB
        placement = apply_vram_policy(p_str, "stream", device="cpu", vram_budget_gb=budget)
        out = p_str.unet(x, 500, encoder_hidden_states=c).sample
        ms = time_ms(lambda: p_str.unet(x, 500, encoder_hidden_states=c), warmup=1, repeat=2,
                     device=torch.device("cpu"))
    ctx.record("tiny_sd1_cpu", "step_ms_stream", ms, full_ms, "full", unit="ms", notes="smoke: CPU, meaningless")
    ctx.record("tiny_sd1_cpu", "parity_stream", (out - ref).abs().max().item(), target=1e-5, target_kind="ours<=",
               unit="abs", notes=f"{len(placement.schedule.streamed)} of {len(placement.schedule.order)} blocks streamed")
    placement.remove()

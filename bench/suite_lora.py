"""LoRA injector benchmark: SDXL UNet, fp16, 1024x1024 (128x128 latent), batch 2 (a CFG pair), random weights,
rank-32 LoRA on every attention (to_q/k/v/out) and feed-forward (ff.net.0.proj, ff.net.2) Linear.

Cases (ours and peers in the same process):
- per-step ms, no LoRA / unmerged / merged, eager and replaying a plain ``torch.cuda.CUDAGraph`` of one UNet call
  captured inside the view's ``session("unet")``; peer for unmerged: PEFT's LoRA layers (what diffusers'
  ``load_lora_weights`` installs), same weights, same capture. Target: unmerged <= 10% over no LoRA under graphs.
  Each unmerged injection strategy (``lora.unmerged.STRATEGIES``: hook, geglu) is timed side by side
  (``step_ms_unmerged_hook`` / ``step_ms_unmerged_geglu``, eager and graph, peer no LoRA) with its replay checked
  against the hook path's (``geglu_vs_hook_rel_diff``); ``step_ms_unmerged`` / ``unmerged_overhead_pct`` are the
  default strategy's (``geglu`` unless ``$LEANDIFFUSION_LORA_STRATEGY`` says otherwise).
- strength change: the synchronized wall time of a session of a view with another strength (attach rewrites the
  scaled up-buffers, detach), after which the *same* graph replays (same graph_key, recorded); peer: recapturing
  the graph. Target: < 1 ms, no recapture. The replay time after the change is recorded next to the replay time
  before it, and the replayed output is checked against an eager run at the new strength (rel diff).
- load: a ~220 MB kohya SDXL file (UNet attention+ff in LDM naming + both text encoders, fp16) written to a temp
  folder, loaded onto the GPU with ``lora.load_lora`` (cache cleared; the file is in the OS page cache since it was
  just written, stated in the notes). Peer: ``safetensors.torch.load_file(device="cuda")`` (raw read, no parsing).
  Target: < 1.5 s.
- ``merged_session_ms``: entering a merged view's session at another strength (save the touched weights, merge),
  synchronized; the view is built before the timing (its build time is in the notes).
- correctness on the GPU: merged vs unmerged, graph replay vs eager, ours vs PEFT (relative max abs diff).

Smoke mode: the tiny SDXL-like UNet on the CPU in fp32, rank 4, eager only (numbers meaningless).
"""
from __future__ import annotations

import logging
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .harness import time_ms
from .lora_setup import kohya_text, kohya_unet, unet_and_inputs, unet_engine

logger = logging.getLogger(__name__)

SUITE = "lora"
SMOKE_BUDGET_S = 30
QUICK_BUDGET_S = 40
FULL_BUDGET_S = 240


def _call(unet, inputs):
    return unet(inputs["sample"], inputs["timestep"], encoder_hidden_states=inputs["encoder_hidden_states"],
                added_cond_kwargs=inputs["added_cond_kwargs"], return_dict=False)[0]


def _capture(unet, inputs):
    """A CUDA graph of one UNet call (warm-up on a side stream first, as torch's docs prescribe)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            _call(unet, inputs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _call(unet, inputs)
    torch.cuda.synchronize()
    return graph, out


def _rel_diff(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


@dataclass
class _Setup:
    """What every case shares: the UNet and its inputs, the engine, the LoRA file and the views over it."""

    unet: torch.nn.Module
    inputs: dict
    engine: object
    unet_file: Path
    per_strategy: dict  # strategy -> unmerged view at strength 1.0
    default: str  # the strategy "auto" resolves to
    merged: object
    shape: str  # "rank R, N Linear layers ..." for the notes
    n_layers: int
    repeat: int
    warm: int

    @property
    def unmerged(self):
        return self.per_strategy[self.default]

    def call(self):
        return _call(self.unet, self.inputs)


# --------------------------------------------------------------------------------------------- cases
@torch.no_grad()
def run(ctx) -> None:
    from safetensors.torch import save_file

    from ..lora import inject_lora
    from ..lora.unmerged import STRATEGIES, resolve_strategy

    has_time = getattr(ctx, "has_time", lambda seconds: True)
    dev = ctx.device
    gpu = dev.type == "cuda"
    unet, inputs, rank, dtype = unet_and_inputs(ctx)
    engine = unet_engine(unet, dev, dtype)
    tmp = Path(tempfile.mkdtemp(prefix="leandiffusion-bench-lora-"))
    unet_sd = kohya_unet(unet, rank, dev)
    unet_file = tmp / "sdxl_attn_ff.safetensors"
    save_file(unet_sd, str(unet_file))
    n_layers = len(unet_sd) // 3
    default = resolve_strategy("auto")
    per_strategy = {s: inject_lora(engine, unet_file, 1.0, 0.0, mode="unmerged", strategy=s) for s in STRATEGIES}
    setup = _Setup(unet, inputs, engine, unet_file, per_strategy, default,
                   merged=inject_lora(engine, unet_file, 1.0, 0.0, mode="merged"),
                   shape=f"rank {rank}, {n_layers} Linear layers (attention + feed-forward)", n_layers=n_layers,
                   repeat=1 if ctx.smoke else (10 if ctx.quick else 20), warm=1 if ctx.smoke else 2)
    ptrs = [p.data_ptr() for p in unet.parameters()]

    eager, outs = _eager_cases(ctx, setup)
    if gpu:
        graphs = _graph_cases(ctx, setup, eager, outs)
        _strength_change(ctx, setup, graphs["unmerged"])
        ctx.record("strength_change", "base_weights_moved", float(ptrs != [p.data_ptr() for p in unet.parameters()]),
                   target=0.0, target_kind="ours<=", notes="1 if any base weight data_ptr changed")
        del graphs

        merged_switch_ms, inject_ms = _merged_session_ms(engine, unet_file, 0.6, torch.cuda.synchronize)
        ctx.record("strength_change", "merged_session_ms", merged_switch_ms, unit="ms",
                   notes=f"merged mode: save touched weights + merge at attach (restore at detach not included), "
                         f"synchronized; building the view (inject_lora, file cached) took {inject_ms:.1f} ms more")
    if has_time(30):
        _load_case(ctx, unet_sd, rank, dtype, tmp, setup.repeat)
    if gpu and has_time(60):  # peer: PEFT unmerged (diffusers' LoRA path)
        _peft_peer(ctx, unet, inputs, unet_file, outs["unmerged"], eager, setup.repeat, setup.shape)
    for f in tmp.iterdir():
        f.unlink()
    tmp.rmdir()


def _eager_cases(ctx, s: _Setup) -> tuple[dict, dict]:
    """Eager step times of no LoRA / unmerged (every strategy) / merged, and their outputs compared;
    returns ({label: ms}, {label: output})."""
    dev = ctx.device
    gpu = dev.type == "cuda"
    eager = {}
    outs = {}
    for label, view in (("none", s.engine), ("unmerged", s.unmerged), ("merged", s.merged)):
        with view.session("unet"):
            eager[label] = time_ms(s.call, warmup=s.warm, repeat=s.repeat, device=dev)
            outs[label] = s.call().clone()
    ctx.record("sdxl_eager", "step_ms_unmerged", eager["unmerged"], eager["none"], "no LoRA", unit="ms",
               notes=f"{s.shape}; strategy {s.default}")
    for strat, view in s.per_strategy.items():
        with view.session("unet"):
            if strat == s.default:
                ms, out = eager["unmerged"], outs["unmerged"]
            elif ctx.smoke:  # one timed call (smoke numbers are plumbing only)
                t0 = time.perf_counter()
                out = s.call().clone()
                ms = (time.perf_counter() - t0) * 1e3
            else:
                ms = time_ms(s.call, warmup=s.warm, repeat=s.repeat, device=dev)
                out = s.call().clone()
        outs[f"unmerged_{strat}"] = out
        ctx.record("sdxl_eager", f"step_ms_unmerged_{strat}", ms, eager["none"], "no LoRA", unit="ms",
                   notes=s.shape)
    for strat in s.per_strategy:
        if strat != "hook":
            ctx.record("sdxl_eager", f"{strat}_vs_hook_rel_diff",
                       _rel_diff(outs[f"unmerged_{strat}"], outs["unmerged_hook"]), target=1e-2 if gpu else 1e-5,
                       target_kind="ours<=", unit="rel", notes="eager output of this strategy vs the hook path's")
    ctx.record("sdxl_eager", "step_ms_merged", eager["merged"], eager["none"], "no LoRA", unit="ms", notes=s.shape)
    ctx.record("sdxl_eager", "merged_vs_unmerged_rel_diff", _rel_diff(outs["merged"], outs["unmerged"]),
               target=2e-2 if gpu else 1e-4, target_kind="ours<=", unit="rel",
               notes="max|merged-unmerged| / max|unmerged|; fp16 GPU rounding differs by design (merge rounds W once)")
    return eager, outs


def _graph_cases(ctx, s: _Setup, eager: dict, outs: dict) -> dict:
    """Replay times of a CUDA graph of one UNet call per view (added to ``eager`` as ``graph_<label>``), the
    target on the unmerged overhead, and every strategy under graphs; returns {label: (graph, static output)}."""
    dev = ctx.device
    graphs = {}
    for label, view in (("none", s.engine), ("unmerged", s.unmerged), ("merged", s.merged)):
        with view.session("unet"):
            graph, out = _capture(s.unet, s.inputs)
            graphs[label] = (graph, out)
            step = time_ms(graph.replay, warmup=3, repeat=s.repeat * 2, device=dev)
            eager[f"graph_{label}"] = step
            if label == "unmerged":
                graph.replay()
                ctx.record("sdxl_cuda_graph", "replay_vs_eager_rel_diff", _rel_diff(out, outs["unmerged"]),
                           target=1e-2, target_kind="ours<=", unit="rel", notes="graph replay vs eager, unmerged")
    base = eager["graph_none"]
    ctx.record("sdxl_cuda_graph", "step_ms_unmerged", eager["graph_unmerged"], base, "no LoRA", unit="ms",
               notes=f"{s.shape}; strategy {s.default}")
    ctx.record("sdxl_cuda_graph", "unmerged_overhead_pct", 100 * (eager["graph_unmerged"] / base - 1),
               target=10.0, target_kind="ours<=", unit="%",
               notes=f"unmerged step vs no-LoRA step, both graphs; strategy {s.default}")
    ctx.record("sdxl_cuda_graph", "step_ms_merged", eager["graph_merged"], base, "no LoRA", unit="ms", notes=s.shape)
    _strategies_under_graphs(ctx, s.unet, s.inputs, s.per_strategy, s.default, graphs["unmerged"], eager, outs, base,
                             s.repeat, s.shape)
    return graphs


def _strength_change(ctx, s: _Setup, captured: tuple) -> None:
    """A session at strength 0.6 around the unmerged graph captured at 1.0: its cost against a recapture, the same
    graph_key, the replay time after the change, and the replay against an eager run at the new strength."""
    from ..lora import inject_lora

    dev = ctx.device
    graph, out = captured
    other = inject_lora(s.engine, s.unet_file, 0.6, 0.0, mode="unmerged")
    same_key = other.adapters[0].graph_key == s.unmerged.adapters[0].graph_key
    views = [other, s.unmerged]

    def switch_ms(alternate: bool = True) -> float:
        """Median wall time of a session with the other strength (attach rewrites the buffers, detach),
        synchronized: everything a strength change adds before the unchanged graph replays. With
        ``alternate=False`` the same view each time (no rewrite: what any session costs)."""
        times = []
        for i in range(4 + s.repeat * 4):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with views[i % 2 if alternate else 0].session("unet"):
                pass
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times[4:])

    def replay_in(view):
        with view.session("unet"):
            return time_ms(graph.replay, warmup=1, repeat=s.repeat, device=dev)

    plain = time_ms(graph.replay, warmup=3, repeat=s.repeat * 2, device=dev)
    switch = switch_ms()
    same_ms = switch_ms(alternate=False)
    after = replay_in(other)
    t0 = time.perf_counter()
    with other.session("unet"):
        _capture(s.unet, s.inputs)
    recapture_ms = (time.perf_counter() - t0) * 1e3
    ctx.record("strength_change", "extra_ms", switch, recapture_ms, "recapture", target=1.0, target_kind="ours<=",
               unit="ms", notes=f"session with a new strength (rewrite {s.n_layers} scaled up-buffers, attach, "
                                f"detach), synchronized wall time; the same graph then replays (no recapture)")
    ctx.record("strength_change", "session_ms_same_strength", same_ms, unit="ms",
               notes="the same session without a strength change (attach, detach; no rewrite), synchronized")
    ctx.record("strength_change", "same_graph_key", float(same_key), target=1.0, target_kind="ours>=",
               notes="1 if views of strengths 1.0 and 0.6 have one graph_key (the sampler replays, never recaptures)")
    ctx.record("strength_change", "replay_ms_after_change", after, plain, "replay before the change", unit="ms",
               notes="the captured unmerged graph replayed inside the 0.6 session vs replayed before")
    with other.session("unet"):
        graph.replay()
        replayed = out.clone()
        fresh = s.call()
    ctx.record("strength_change", "replay_vs_eager_rel_diff", _rel_diff(replayed, fresh), target=1e-2,
               target_kind="ours<=", unit="rel", notes="same graph replayed after switching strength 1.0 -> 0.6")


def _load_case(ctx, unet_sd: dict, rank: int, dtype, tmp: Path, repeat: int) -> None:
    """Loading a kohya SDXL file (UNet + both text encoders) onto the device, against safetensors' raw read."""
    from safetensors.torch import load_file, save_file

    from ..lora import clear_cache, load_lora

    dev = ctx.device
    gpu = dev.type == "cuda"
    full = dict(unet_sd)
    full.update(kohya_text(rank, dev, ctx.smoke))
    full_file = tmp / "sdxl_kohya_full.safetensors"
    save_file(full, str(full_file))
    size_mb = full_file.stat().st_size / 1e6
    del full

    def ours():
        clear_cache()
        loaded = load_lora(full_file, dev, dtype)
        if gpu:
            torch.cuda.synchronize()
        return loaded

    def raw():
        tensors = load_file(str(full_file), device=str(dev))
        if gpu:
            torch.cuda.synchronize()
        return tensors

    load_ms = time_ms(ours, warmup=1, repeat=repeat if ctx.smoke else 3, device=torch.device("cpu"))
    raw_ms = time_ms(raw, warmup=1, repeat=repeat if ctx.smoke else 3, device=torch.device("cpu"))
    ctx.record("load", "load_ms", load_ms, raw_ms, "safetensors load_file", target=1500.0, target_kind="ours<=",
               unit="ms", notes=f"{size_mb:.0f} MB kohya SDXL file (unet+te1+te2), fp16, page cache warm")


def _merged_session_ms(engine, unet_file, strength: float, sync) -> tuple[float, float]:
    """(ms to enter a merged view's ``session("unet")``, ms to build the view): the session's attach (save the
    touched weights, merge) is timed alone, between synchronizations; ``inject_lora`` (cached load, key
    resolution) happens before it, as the unmerged strength change's views are built before their timing."""
    from ..lora import inject_lora

    t0 = time.perf_counter()
    view = inject_lora(engine, unet_file, strength, 0.0, mode="merged")
    sync()
    t1 = time.perf_counter()
    with view.session("unet"):
        sync()
        t2 = time.perf_counter()
    return (t2 - t1) * 1e3, (t1 - t0) * 1e3


def _strategies_under_graphs(ctx, unet, inputs, per_strategy, default, default_graph, eager, outs, base, repeat,
                             shape) -> None:
    """One graph per unmerged strategy (the default's is reused), timed like the others; each replay is checked
    against the hook path's replay and against its own eager output. Graphs are freed one by one (SDXL memory)."""
    dev = ctx.device
    replayed = {}
    for strat, view in per_strategy.items():
        with view.session("unet"):
            if strat == default:
                graph, out = default_graph
                ms = eager["graph_unmerged"]
            else:
                graph, out = _capture(unet, inputs)
                ms = time_ms(graph.replay, warmup=3, repeat=repeat * 2, device=dev)
            graph.replay()
            torch.cuda.synchronize()
            replayed[strat] = out.clone()
        del graph, out
        ctx.record("sdxl_cuda_graph", f"step_ms_unmerged_{strat}", ms, base, "no LoRA", unit="ms",
                   notes=f"{shape}; overhead {100 * (ms / base - 1):.1f}%" + ("; default" if strat == default else ""))
        ctx.record("sdxl_cuda_graph", f"replay_vs_eager_rel_diff_{strat}",
                   _rel_diff(replayed[strat], outs[f"unmerged_{strat}"]), target=1e-2, target_kind="ours<=",
                   unit="rel", notes=f"strategy {strat}: graph replay vs its eager run")
    for strat, out in replayed.items():
        if strat != "hook" and "hook" in replayed:
            ctx.record("sdxl_cuda_graph", f"{strat}_vs_hook_rel_diff", _rel_diff(out, replayed["hook"]),
                       target=1e-2, target_kind="ours<=", unit="rel",
                       notes="replayed output of this strategy vs the hook path's (same LoRA, fp16 summation order)")


def _peft_peer(ctx, unet, inputs, unet_file, ours_out, eager, repeat, shape) -> None:
    """Load the same file with diffusers' loader into the UNet (PEFT layers) and time it the same way."""
    from diffusers import StableDiffusionXLPipeline

    try:
        sd, alphas = StableDiffusionXLPipeline.lora_state_dict(str(unet_file), unet_config=unet.config)
        StableDiffusionXLPipeline.load_lora_into_unet(sd, alphas, unet, adapter_name="peer")
    except (ImportError, ValueError, TypeError, KeyError, RuntimeError) as exc:  # optional peer: record why not
        logger.warning("PEFT peer unavailable: %s", exc)
        ctx.record("peer_peft", "available", 0.0, notes=f"diffusers/PEFT could not load the file: {exc}")
        return
    dev = ctx.device
    peft_eager = time_ms(lambda: _call(unet, inputs), warmup=2, repeat=repeat, device=dev)
    peer_out = _call(unet, inputs).clone()
    graph, out = _capture(unet, inputs)
    peft_graph = time_ms(graph.replay, warmup=3, repeat=repeat * 2, device=dev)
    ctx.record("sdxl_eager", "unmerged_vs_peft_step_ms", eager["unmerged"], peft_eager, "PEFT (diffusers)",
               unit="ms", notes=shape)
    ctx.record("sdxl_cuda_graph", "unmerged_vs_peft_step_ms", eager["graph_unmerged"], peft_graph,
               "PEFT (diffusers)", unit="ms", notes=shape)
    ctx.record("peer_peft", "ours_vs_peft_rel_diff", _rel_diff(ours_out, peer_out), target=2e-2,
               target_kind="ours<=", unit="rel", notes="same file through diffusers' load_lora_into_unet, fp16")

"""LoRA injector benchmark: SDXL UNet, fp16, 1024x1024 (128x128 latent), batch 2 (a CFG pair), random weights,
rank-32 LoRA on every attention (to_q/k/v/out) and feed-forward (ff.net.0.proj, ff.net.2) Linear.

Cases (ours and peers in the same process, GUIDE section 5):
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
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch

from .harness import time_ms

logger = logging.getLogger(__name__)

SUITE = "lora"
SMOKE_BUDGET_S = 30
QUICK_BUDGET_S = 40  # measured 38 s (H200, 2026-11-22)
FULL_BUDGET_S = 240
ATTN_FF = re.compile(r"(attn[12]\.(to_q|to_k|to_v|to_out\.0)|ff\.net\.(0\.proj|2))$")
TE_LINEARS = re.compile(r"(self_attn\.(q_proj|k_proj|v_proj|out_proj)|mlp\.(fc1|fc2))$")


# --------------------------------------------------------------------------------------------- set-up
def _model(ctx):
    """(unet, inputs dict, rank, dtype) for the mode: full SDXL fp16 on the GPU, tiny SDXL fp32 in smoke."""
    if ctx.smoke:
        from diffusers import UNet2DConditionModel

        from ..memory.tiny import unet_config

        torch.manual_seed(0)
        unet = UNet2DConditionModel(**unet_config("sdxl")).eval().requires_grad_(False)
        g = torch.Generator().manual_seed(0)
        inputs = {"sample": torch.randn(2, 4, 8, 8, generator=g), "timestep": torch.tensor(500),
                  "encoder_hidden_states": torch.randn(2, 77, 192, generator=g),
                  "added_cond_kwargs": {"text_embeds": torch.randn(2, 128, generator=g),
                                        "time_ids": torch.tensor([[64.0, 64, 0, 0, 64, 64]] * 2)}}
        return unet, inputs, 4, torch.float32
    from .models import full_unet, unet_inputs

    unet = full_unet("sdxl", device=ctx.device, dtype=torch.float16)
    return unet, unet_inputs("sdxl", batch=2, latent_hw=128, device=ctx.device), 32, torch.float16


def _engine(unet, device, dtype):
    from ..memory.engine import LeanEngine, ModelParts

    parts = ModelParts(family="sdxl", unet=unet, vae=None, text_encoder=None, tokenizer=None, scheduler_config={},
                       name="bench-sdxl-unet")
    return LeanEngine(parts=parts, device=torch.device(device), dtype=dtype)


def _factors(module, rank, gen, device):
    fan_in, out = module.in_features, module.out_features
    down = torch.randn(rank, fan_in, generator=gen, device=device) / fan_in ** 0.5
    up = 0.25 * torch.randn(out, rank, generator=gen, device=device) / rank ** 0.5
    return down, up


def _kohya_unet(unet, rank, device) -> dict:
    """kohya SDXL layout (LDM names), fp16, alpha = rank, every attention / feed-forward Linear."""
    from ..lora.keymap import ldm_unet_names

    ldm = ldm_unet_names(unet)
    gen = torch.Generator(device=device).manual_seed(1)
    sd = {}
    for name, m in unet.named_modules():
        if isinstance(m, torch.nn.Linear) and ATTN_FF.search(name):
            key = "lora_unet_" + ldm[name].replace(".", "_")
            down, up = _factors(m, rank, gen, device)
            sd[key + ".lora_down.weight"] = down.half().cpu()
            sd[key + ".lora_up.weight"] = up.half().cpu()
            sd[key + ".alpha"] = torch.tensor(float(rank), dtype=torch.float16)
    return sd


def _kohya_text(rank, device, smoke) -> dict:
    """Text-encoder layers of the same file (CLIP-L as lora_te1_, CLIP-G as lora_te2_), as SDXL trainers write."""
    from .models import CLIP_G, CLIP_L

    gen = torch.Generator(device=device).manual_seed(2)
    sd = {}
    for prefix, cfg in (("lora_te1_", CLIP_L), ("lora_te2_", CLIP_G)):
        hidden, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
        if smoke:
            hidden, inter, layers = 64, 256, 2
        shapes = {"self_attn_q_proj": (hidden, hidden), "self_attn_k_proj": (hidden, hidden),
                  "self_attn_v_proj": (hidden, hidden), "self_attn_out_proj": (hidden, hidden),
                  "mlp_fc1": (hidden, inter), "mlp_fc2": (inter, hidden)}
        for i in range(layers):
            for mod, (fan_in, out) in shapes.items():
                key = f"{prefix}text_model_encoder_layers_{i}_{mod}"
                sd[key + ".lora_down.weight"] = torch.randn(rank, fan_in, generator=gen, device=device).half().cpu()
                sd[key + ".lora_up.weight"] = torch.randn(out, rank, generator=gen, device=device).half().cpu()
                sd[key + ".alpha"] = torch.tensor(float(rank), dtype=torch.float16)
    return sd


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


# --------------------------------------------------------------------------------------------- cases
@torch.no_grad()
def run(ctx) -> None:
    from ..lora import clear_cache, inject_lora, load_lora

    has_time = getattr(ctx, "has_time", lambda seconds: True)
    dev = ctx.device
    gpu = dev.type == "cuda"
    repeat = 1 if ctx.smoke else (10 if ctx.quick else 20)
    warm = 1 if ctx.smoke else 2
    unet, inputs, rank, dtype = _model(ctx)
    engine = _engine(unet, dev, dtype)
    tmp = Path(tempfile.mkdtemp(prefix="leandiffusion-bench-lora-"))
    unet_sd = _kohya_unet(unet, rank, dev)
    unet_file = tmp / "sdxl_attn_ff.safetensors"
    from safetensors.torch import load_file, save_file

    save_file(unet_sd, str(unet_file))
    n_layers = len(unet_sd) // 3
    shape = f"rank {rank}, {n_layers} Linear layers (attention + feed-forward)"

    from ..lora.unmerged import STRATEGIES, resolve_strategy

    default = resolve_strategy("auto")
    per_strategy = {s: inject_lora(engine, unet_file, 1.0, 0.0, mode="unmerged", strategy=s) for s in STRATEGIES}
    unmerged = per_strategy[default]
    merged = inject_lora(engine, unet_file, 1.0, 0.0, mode="merged")
    ptrs = [p.data_ptr() for p in unet.parameters()]

    # ---------------------------------------------------------------- eager
    eager = {}
    outs = {}
    for label, view in (("none", engine), ("unmerged", unmerged), ("merged", merged)):
        with view.session("unet"):
            eager[label] = time_ms(lambda: _call(unet, inputs), warmup=warm, repeat=repeat, device=dev)
            outs[label] = _call(unet, inputs).clone()
    ctx.record("sdxl_eager", "step_ms_unmerged", eager["unmerged"], eager["none"], "no LoRA", unit="ms",
               notes=f"{shape}; strategy {default}")
    for strat, view in per_strategy.items():
        with view.session("unet"):
            if strat == default:
                ms, out = eager["unmerged"], outs["unmerged"]
            elif ctx.smoke:  # one timed call (smoke numbers are plumbing only)
                t0 = time.perf_counter()
                out = _call(unet, inputs).clone()
                ms = (time.perf_counter() - t0) * 1e3
            else:
                ms = time_ms(lambda: _call(unet, inputs), warmup=warm, repeat=repeat, device=dev)
                out = _call(unet, inputs).clone()
        outs[f"unmerged_{strat}"] = out
        ctx.record("sdxl_eager", f"step_ms_unmerged_{strat}", ms, eager["none"], "no LoRA", unit="ms", notes=shape)
    for strat in per_strategy:
        if strat != "hook":
            ctx.record("sdxl_eager", f"{strat}_vs_hook_rel_diff",
                       _rel_diff(outs[f"unmerged_{strat}"], outs["unmerged_hook"]), target=1e-2 if gpu else 1e-5,
                       target_kind="ours<=", unit="rel", notes="eager output of this strategy vs the hook path's")
    ctx.record("sdxl_eager", "step_ms_merged", eager["merged"], eager["none"], "no LoRA", unit="ms", notes=shape)
    ctx.record("sdxl_eager", "merged_vs_unmerged_rel_diff", _rel_diff(outs["merged"], outs["unmerged"]),
               target=2e-2 if gpu else 1e-4, target_kind="ours<=", unit="rel",
               notes="max|merged-unmerged| / max|unmerged|; fp16 GPU rounding differs by design (merge rounds W once)")

    # ---------------------------------------------------------------- cuda graph
    if gpu:
        graphs = {}
        for label, view in (("none", engine), ("unmerged", unmerged), ("merged", merged)):
            with view.session("unet"):
                graph, out = _capture(unet, inputs)
                graphs[label] = (graph, out)
                step = time_ms(graph.replay, warmup=3, repeat=repeat * 2, device=dev)
                eager[f"graph_{label}"] = step
                if label == "unmerged":
                    graph.replay()
                    ctx.record("sdxl_cuda_graph", "replay_vs_eager_rel_diff", _rel_diff(out, outs["unmerged"]),
                               target=1e-2, target_kind="ours<=", unit="rel", notes="graph replay vs eager, unmerged")
        base = eager["graph_none"]
        ctx.record("sdxl_cuda_graph", "step_ms_unmerged", eager["graph_unmerged"], base, "no LoRA", unit="ms",
                   notes=f"{shape}; strategy {default}")
        ctx.record("sdxl_cuda_graph", "unmerged_overhead_pct", 100 * (eager["graph_unmerged"] / base - 1),
                   target=10.0, target_kind="ours<=", unit="%",
                   notes=f"unmerged step vs no-LoRA step, both graphs; strategy {default}")
        ctx.record("sdxl_cuda_graph", "step_ms_merged", eager["graph_merged"], base, "no LoRA", unit="ms", notes=shape)
        _strategies_under_graphs(ctx, unet, inputs, per_strategy, default, graphs["unmerged"], eager, outs, base,
                                 repeat, shape)

        # ------------------------------------------------------------ strength change on the captured graph
        graph, out = graphs["unmerged"]
        other = inject_lora(engine, unet_file, 0.6, 0.0, mode="unmerged")
        same_key = other.adapters[0].graph_key == unmerged.adapters[0].graph_key
        views = [other, unmerged]

        def switch_ms(alternate: bool = True) -> float:
            """Median wall time of a session with the other strength (attach rewrites the buffers, detach),
            synchronized: everything a strength change adds before the unchanged graph replays. With
            ``alternate=False`` the same view each time (no rewrite: what any session costs)."""
            times = []
            for i in range(4 + repeat * 4):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                with views[i % 2 if alternate else 0].session("unet"):
                    pass
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(times[4:])

        def replay_in(view):
            with view.session("unet"):
                return time_ms(graph.replay, warmup=1, repeat=repeat, device=dev)

        plain = time_ms(graph.replay, warmup=3, repeat=repeat * 2, device=dev)
        switch = switch_ms()
        same_ms = switch_ms(alternate=False)
        after = replay_in(other)
        t0 = time.perf_counter()
        with other.session("unet"):
            _capture(unet, inputs)
        recapture_ms = (time.perf_counter() - t0) * 1e3
        ctx.record("strength_change", "extra_ms", switch, recapture_ms, "recapture", target=1.0, target_kind="ours<=",
                   unit="ms", notes=f"session with a new strength (rewrite {n_layers} scaled up-buffers, attach, "
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
            fresh = _call(unet, inputs)
        ctx.record("strength_change", "replay_vs_eager_rel_diff", _rel_diff(replayed, fresh), target=1e-2,
                   target_kind="ours<=", unit="rel", notes="same graph replayed after switching strength 1.0 -> 0.6")
        ctx.record("strength_change", "base_weights_moved", float(ptrs != [p.data_ptr() for p in unet.parameters()]),
                   target=0.0, target_kind="ours<=", notes="1 if any base weight data_ptr changed")
        del graphs, graph, out

        merged_switch_ms, inject_ms = _merged_session_ms(engine, unet_file, 0.6, torch.cuda.synchronize)
        ctx.record("strength_change", "merged_session_ms", merged_switch_ms, unit="ms",
                   notes=f"merged mode: save touched weights + merge at attach (restore at detach not included), "
                         f"synchronized; building the view (inject_lora, file cached) took {inject_ms:.1f} ms more")

    # ---------------------------------------------------------------- load
    if has_time(30):
        full = dict(unet_sd)
        full.update(_kohya_text(rank, dev, ctx.smoke))
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

    # ---------------------------------------------------------------- peer: PEFT unmerged (diffusers' LoRA path)
    if gpu and has_time(60):
        _peft_peer(ctx, unet, inputs, unet_file, outs["unmerged"], eager, repeat, shape)
    for f in tmp.iterdir():
        f.unlink()
    tmp.rmdir()


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

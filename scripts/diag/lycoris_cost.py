"""What LoHa, LoKr and DoRA cost per step next to a plain LoRA, and whether their CUDA-graph replays stay right.

SDXL UNet, fp16, 1024 px (128x128 latent), batch 2, random weights; every attention and feed-forward Linear (700
layers) carries the adapter (kohya/LyCORIS layout, LDM names, fp16 file in a temp folder). Per case: the unmerged
(default strategy) and merged graph-replay ms of one UNet call next to no adapter, the first attach (DoRA
computes its gains there) and where each layer's term runs, the attach time of a strength
change (same graph replayed after it, checked against eager at the new strength), merged vs unmerged, strength 0 vs
the base, the file's load time and the GPU memory the loaded adapter and its binding hold. Cases: plain LoRA r32 (the yardstick), LoHa r8 / r16 (run as rank-64 / 256
LoRAs by the Khatri-Rao identity) and r32 (built densely on most layers), LoKr with LyCORIS' default factorisation
(factor -1, W2 low-rank r16) and factor 8, DoRA on the r32 LoRA on the input and the output axis.
Usage (device machine, pack importable as ``leandiffusion``): python scripts/diag/lycoris_cost.py [case,...];
writes $OUT/lycoris_cost.json. Budget: under 4 minutes on an H100.
"""
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from diag_timing import Recorder, graph_of, timed
from leandiffusion.bench.models import full_unet, unet_inputs
from leandiffusion.bench.suite_lora import ATTN_FF, _call, _engine
from leandiffusion.lora import clear_cache, inject_lora, load_lora
from leandiffusion.lora.keymap import ldm_unet_names

dev = torch.device("cuda")
rec = Recorder("lycoris_cost.json")
CASES = ["lora_r32", "loha_r8", "loha_r16", "loha_r32", "lokr_default", "lokr_f8", "dora_in_r32", "dora_out_r32"]


def split(n, factor):
    """LyCORIS' factorisation: ``factor`` x n/factor when it divides, else the divisor pair nearest sqrt(n)."""
    if factor > 0 and n % factor == 0:
        return factor, n // factor
    a = max(d for d in range(1, int(n ** 0.5) + 1) if n % d == 0)
    return a, n // a


def factors(case, m, g):
    out, n = m.out_features, m.in_features
    rnd = lambda *s: torch.randn(*s, generator=g, device=dev)  # noqa: E731
    if case.startswith("lora") or case.startswith("dora"):
        return {"lora_down.weight": rnd(32, n) / n ** 0.5, "lora_up.weight": 0.25 * rnd(out, 32) / 32 ** 0.5,
                "alpha": torch.tensor(32.0)}
    if case.startswith("loha"):
        r = int(case.split("_r")[1])
        return {"hada_w1_a": 0.25 * rnd(out, r) / (r * n) ** 0.5, "hada_w1_b": rnd(r, n),
                "hada_w2_a": rnd(out, r) / r ** 0.5, "hada_w2_b": rnd(r, n), "alpha": torch.tensor(float(r))}
    f = 8 if case == "lokr_f8" else -1
    (o1, o2), (i1, i2) = split(out, f), split(n, f)
    return {"lokr_w1": rnd(o1, i1), "lokr_w2_a": 0.25 * rnd(o2, 16) / (16 * n) ** 0.5, "lokr_w2_b": rnd(16, i2),
            "alpha": torch.tensor(16.0)}


def write_file(case, unet, folder):
    ldm = ldm_unet_names(unet)
    g = torch.Generator(device=dev).manual_seed(1)
    sd = {}
    for name, m in unet.named_modules():
        if not (isinstance(m, torch.nn.Linear) and ATTN_FF.search(name)):
            continue
        key = "lora_unet_" + ldm[name].replace(".", "_")
        fs = factors(case, m, g)
        if case.startswith("dora"):
            delta = fs["lora_up.weight"] @ fs["lora_down.weight"]
            w = m.weight.float() + delta
            norm = w.norm(dim=0, keepdim=True) if "_in_" in case else w.norm(dim=1, keepdim=True)
            fs["dora_scale"] = norm * (1 + 0.1 * torch.randn(norm.shape, generator=g, device=dev))
        sd.update({f"{key}.{k}": (v.half() if k != "dora_scale" else v.float()).cpu().contiguous()
                   for k, v in fs.items()})
    path = Path(folder) / f"{case}.safetensors"
    save_file(sd, str(path))
    return path


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def replay_ms(view, unet, inputs):
    with view.session("unet"):
        graph, out = graph_of(lambda: _call(unet, inputs))
        ms = timed(graph.replay, 20)
        res = out.clone()
    return graph, out, ms, res


@torch.no_grad()
def main():
    cases = sys.argv[1].split(",") if len(sys.argv) > 1 else CASES
    unet = full_unet("sdxl", device=dev)
    engine = _engine(unet, dev, torch.float16)
    inputs = unet_inputs("sdxl", batch=2, latent_hw=128, device=dev)
    graph, _, base_ms, base = replay_ms(engine, unet, inputs)
    del graph
    rec("base", {"graph_ms": round(base_ms, 2)})
    with tempfile.TemporaryDirectory() as folder:
        for case in cases:
            t0 = time.perf_counter()
            path = write_file(case, unet, folder)
            clear_cache()
            gc.collect()
            torch.cuda.empty_cache()
            mem0 = torch.cuda.memory_allocated()
            t1 = time.perf_counter()
            load_lora(path, dev, torch.float16)
            load_s = time.perf_counter() - t1
            row = {"file_mb": round(path.stat().st_size / 2**20, 1), "load_s": round(load_s, 2)}
            view = inject_lora(engine, path, 1.0, mode="unmerged")
            # the loaded factors plus the binding's own tensors (strength buffers, Khatri-Rao factors, shared downs)
            row["unmerged_resident_mb"] = round((torch.cuda.memory_allocated() - mem0) / 2**20, 1)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            with view.session("unet"):  # the first attach (a DoRA computes its gains here)
                torch.cuda.synchronize()
                row["first_attach_ms"] = round((time.perf_counter() - t1) * 1000, 1)
                where = view.adapters[0].binding.installed("unet")
            terms = {}
            for (_, _, term, ov), w in zip(view.adapters[0].binding._slots["unet"], where):
                kind = type(ov).__name__ if w == "override" else type(term).__name__
                terms[kind] = terms.get(kind, 0) + 1
            row["terms"] = terms
            graph, out, ms, unmerged = replay_ms(view, unet, inputs)
            row.update(graph_ms=round(ms, 2), overhead_pct=round(100 * (ms / base_ms - 1), 1))
            other = inject_lora(engine, path, 0.6, mode="unmerged")
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            with other.session("unet"):
                torch.cuda.synchronize()
                row["strength_change_attach_ms"] = round((time.perf_counter() - t2) * 1000, 3)
                graph.replay()
                torch.cuda.synchronize()
                row["replay_after_change_vs_eager"] = rel(out, _call(unet, inputs))
            zero = inject_lora(engine, path, 0.0, mode="unmerged")
            with zero.session("unet"):
                graph.replay()
                torch.cuda.synchronize()
                row["strength0_vs_base"] = rel(out, base)
            del graph, out
            gc.collect()
            torch.cuda.empty_cache()
            merged = inject_lora(engine, path, 1.0, mode="merged")
            graph, _, mms, mres = replay_ms(merged, unet, inputs)
            row.update(merged_graph_ms=round(mms, 2), merged_vs_unmerged=rel(unmerged, mres),
                       effect_vs_base=rel(unmerged, base), wall_s=round(time.perf_counter() - t0, 1))
            del graph, view, other, zero, merged
            gc.collect()
            torch.cuda.empty_cache()
            rec(case, row)


if __name__ == "__main__":
    main()

"""Where the unmerged LoRA's per-step cost goes, and what a fused no-LoRA GEGLU would do to the base step.

SDXL UNet, fp16, 1024 px (128x128 latent), batch 2, random weights; a rank-32 LoRA on the 700 attention and
feed-forward Linears (``bench.suite_lora``'s file). Records:
- ``graph_ms``: one UNet call replayed from a CUDA graph: no LoRA (diffusers' GEGLU), no LoRA with a one-pass GEGLU
  (probe: diffusers' ``GEGLU.forward`` patched in this process), the LoRA under each strategy.
- ``kernels_none`` / ``kernels_lora`` / ``kernels_extra``: per kernel name, calls and GPU microseconds of one eager
  call (torch profiler), and what the LoRA call runs beyond the no-LoRA call.
- ``micro``: graph-replayed microseconds of the LoRA's GEMM shapes alone (100 calls per graph): the down GEMM
  ``x [M, C] @ down.T [C, r]``, the up ``out.addmm_(h, up.T)``, the base Linear of the same layer.
Usage (device machine, pack importable as ``leandiffusion``, from this folder: it imports ``diag_timing`` and
``geglu_probe``): cd scripts/diag && python lora_overhead_profile.py [parts, default graph,kernels,micro]; writes
$OUT/lora_overhead_profile.json. Budget: ~2 minutes on an H100. Session 18 (docs/bench/lora-overhead-s18/): no LoRA
43.21 ms, with the one-pass GEGLU 39.70; LoRA (geglu) 46.56, hook 53.05; the LoRA adds ~1110 kernel launches,
skinny GEMMs of ~5 us each (a down 4.7-8.9 us, an up 5.0-8.1 us, against 12.5-39 us for the base Linear).
"""
import gc
import sys
import tempfile
from pathlib import Path

import torch
from diffusers.models.activations import GEGLU
from safetensors.torch import save_file

from diag_timing import Recorder, graph_of, kernel_table, timed
from geglu_probe import fused as fused_forward
from leandiffusion.bench.models import full_unet, unet_inputs
from leandiffusion.bench.suite_lora import _call, _engine, _kohya_unet
from leandiffusion.lora import inject_lora

dev = torch.device("cuda")
rec = Recorder("lora_overhead_profile.json")


def top(table, n=25):
    rows = sorted(table.items(), key=lambda kv: -kv[1][1])[:n]
    return [{"kernel": k[:120], "calls": c, "us": round(us, 1)} for k, (c, us) in rows]


def micro():
    res = []
    for m, c in ((2048, 1280), (8192, 640), (2048, 5120), (8192, 2560)):
        x = torch.randn(m, c, device=dev, dtype=torch.float16)
        out_c = 1280 if c in (1280, 5120) else 640
        w = torch.randn(out_c, c, device=dev, dtype=torch.float16) / c ** 0.5
        out = torch.randn(m, out_c, device=dev, dtype=torch.float16)
        for r in (32, 96):
            down = torch.randn(r, c, device=dev, dtype=torch.float16) / c ** 0.5
            up = torch.randn(out_c, 32, device=dev, dtype=torch.float16) * 0.01
            h = torch.nn.functional.linear(x, down)
            cases = {"down": lambda: torch.nn.functional.linear(x, down),
                     "up_addmm": lambda: out.addmm_(h[:, :32], up.t()),
                     "base_linear": lambda: torch.nn.functional.linear(x, w)}
            for name, fn in cases.items():
                if name == "base_linear" and r != 32:
                    continue
                if name == "up_addmm" and r != 32:
                    continue
                g, _ = graph_of(lambda: [fn() for _ in range(100)])
                us = timed(g.replay, 5) * 10  # ms per 100 calls -> us per call
                res.append({"M": m, "C": c, "r": r, "op": name, "us": round(us, 2)})
                del g
    return res


@torch.no_grad()
def main():
    parts = sys.argv[1].split(",") if len(sys.argv) > 1 else ["graph", "kernels", "micro"]
    unet = full_unet("sdxl", device=dev)
    engine = _engine(unet, dev, torch.float16)
    inputs = unet_inputs("sdxl", batch=2, latent_hw=128, device=dev)
    orig = GEGLU.forward
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "lora.safetensors"
        save_file(_kohya_unet(unet, 32, dev), str(path))
        views = {s: inject_lora(engine, path, 1.0, 0.0, mode="unmerged", strategy=s) for s in ("geglu", "hook")}
        if "graph" in parts:
            res = {}
            cases = (("none", engine, False), ("none_fused_geglu", engine, True),
                     ("lora_geglu", views["geglu"], False), ("lora_hook", views["hook"], False),
                     ("lora_geglu_base_fused", views["geglu"], True), ("none_again", engine, False))
            for label, view, patched in cases:
                GEGLU.forward = fused_forward if patched else orig
                with view.session("unet"):
                    g, out = graph_of(lambda: _call(unet, inputs))
                    res[label] = round(timed(g.replay, 20), 2)
                    del g, out
                GEGLU.forward = orig
                gc.collect()
                torch.cuda.empty_cache()
                rec("graph_ms", res)
        if "kernels" in parts:
            with engine.session("unet"):
                none = kernel_table(lambda: _call(unet, inputs))
            with views["geglu"].session("unet"):
                lora = kernel_table(lambda: _call(unet, inputs))
            rec("kernels_none", top(none))
            rec("kernels_lora", top(lora))
            extra = {k: (c - none.get(k, (0, 0))[0], us - none.get(k, (0, 0.0))[1]) for k, (c, us) in lora.items()}
            rec("kernels_extra", top({k: v for k, v in extra.items() if abs(v[1]) > 5}, 30))
            rec("totals_us", {"none": round(sum(v[1] for v in none.values()), 1),
                              "lora": round(sum(v[1] for v in lora.values()), 1),
                              "none_calls": sum(v[0] for v in none.values()),
                              "lora_calls": sum(v[0] for v in lora.values())})
    if "micro" in parts:
        rec("micro", micro())


if __name__ == "__main__":
    main()

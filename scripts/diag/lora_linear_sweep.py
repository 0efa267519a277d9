"""Two ideas for the unmerged LoRA's step cost, against the pack's hook (two cuBLAS GEMMs per Linear term, the
siblings' downs shared), on the SDXL LoRA's shapes and in the SDXL step.

SDXL UNet, fp16, 1024 px (128x128 latent), batch 2 (one CFG pair), random weights; a rank-32 LoRA on the 700
attention and feed-forward Linears (``bench.suite_lora``'s file). Records:
- ``check``: per layer shape, the one-launch kernel (``lora_linear_probe``, ``pick_config``) against the reference
  (max |diff|, and both against fp64; strength 0 exact).
- ``micro``: graph-replayed microseconds per call of each shape: ``plain`` (``F.linear(x, down)`` then
  ``out.addmm_``), ``shared`` (siblings: one down GEMM for the group, one ``addmm_`` each, per member), ``picked``
  (the kernel with ``pick_config``) and the best of a config grid; ``per_step_us`` weighs them by how often the
  step runs each shape.
- ``step_ms``: one UNet call replayed from a CUDA graph, medians over interleaved rounds: no LoRA; the LoRA
  (``geglu`` strategy) as the pack runs it (``lora_reference``); with the one-launch kernel for every Linear term,
  for all but the wide-K ones, for the unshared narrow ones (``lora_fused_*``); ``lora_overlap``: each down GEMM
  forked onto a side stream by a forward pre-hook while capturing, beside the base GEMM, joined in the hook.
  ``step_out_diff``: each output against ``lora_reference``.
Usage (device machine, pack importable as ``leandiffusion``): cd scripts/diag && python lora_linear_sweep.py
[parts, default check,micro,step]; writes $OUT/lora_linear_sweep.json. Budget: ~4 minutes on an H100 (the micro
grid stops after $SWEEP_SECONDS, default 400).
"""
import gc
import itertools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from diag_timing import Recorder, graph_of, timed
from leandiffusion.bench.models import full_unet, unet_inputs
from leandiffusion.bench.suite_lora import _call, _engine, _kohya_unet
import lora_linear_probe as ll
from leandiffusion.lora import inject_lora, unmerged

dev = torch.device("cuda")
rec = Recorder("lora_linear_sweep.json")
R = 32
# (name, M, K, N, siblings sharing the down, calls per step): 60 blocks at 1280 channels / 2048 rows, 10 at 640 / 8192
SHAPES = [("qkv1280", 2048, 1280, 1280, 3, 180), ("proj1280", 2048, 1280, 1280, 1, 180),
          ("ff2_1280", 2048, 5120, 1280, 1, 60), ("kv_text1280", 154, 2048, 1280, 2, 120),
          ("qkv640", 8192, 640, 640, 3, 30), ("proj640", 8192, 640, 640, 1, 30),
          ("ff2_640", 8192, 2560, 640, 1, 10), ("kv_text640", 154, 2048, 640, 2, 20)]
DEADLINE = time.time() + float(os.environ.get("SWEEP_SECONDS", "400"))
GRID = [ll.Config(bm, bk, bn, 1, w, s) for bm, bk, bn, w, s in
        itertools.product((32, 64, 128), (64, 128), (64, 128), (4, 8), (2, 3))]


def _tensors(m, k, n, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(m, k, device=dev, generator=g).half()
    down = (torch.randn(R, k, device=dev, generator=g) / k ** 0.5).half()
    up = (torch.randn(n, R, device=dev, generator=g) * 0.05).half()
    out = torch.randn(m, n, device=dev, generator=g).half()
    return x, down, up, out


def per_call_us(fn, calls=100):
    g, _ = graph_of(lambda: [fn() for _ in range(calls)])
    us = statistics.median(timed(g.replay, 5) for _ in range(3)) * 1000 / calls
    del g
    return us


def check():
    res = {}
    for name, m, k, n, _, _ in SHAPES:
        x, down, up, out = _tensors(m, k, n)
        ref = ll.lora_add_reference(out.clone(), x, down, up)
        got = ll.lora_add_triton(out.clone(), x, down, up)
        h64 = (x.double() @ down.double().t()).half().double()
        exact = out.double() + h64 @ up.double().t()
        zero = ll.lora_add_triton(out.clone(), x, down, torch.zeros_like(up))
        res[name] = {"kernel_vs_ref": (got.float() - ref.float()).abs().max().item(),
                     "kernel_vs_fp64": (got.double() - exact).abs().max().item(),
                     "ref_vs_fp64": (ref.double() - exact).abs().max().item(),
                     "strength0_exact": bool(torch.equal(zero, out))}
    rec("check", res)


def micro():
    res, per_step = {}, {"plain": 0.0, "picked": 0.0, "best": 0.0}
    for name, m, k, n, sib, count in SHAPES:
        x, down, up, out = _tensors(m, k, n)
        row = {}
        row["plain"] = per_call_us(lambda: out.addmm_(F.linear(x, down), up.t()))
        if sib > 1:
            downs = torch.cat([down] * sib)
            row["shared"] = per_call_us(lambda: [out.addmm_(F.linear(x, downs)[:, i * R:(i + 1) * R], up.t())
                                                 for i in range(sib)], calls=100 // sib * sib) / sib
        row["picked"] = per_call_us(lambda: ll.lora_add_triton(out, x, down, up))
        row["picked_cfg"] = list(ll.pick_config(m, k, n))
        best = (1e9, None)
        rows = -(-m // 32)
        for cfg in GRID:
            for split in (1, 2, 4, 8, 16):
                if -(-m // cfg.bm) * split > 1056 or split * cfg.bn > 2 * n or (split > 1 and rows > 128):
                    continue
                c = cfg._replace(split=split)
                if time.time() > DEADLINE:
                    break
                try:
                    us = per_call_us(lambda: ll.lora_add_triton(out, x, down, up, c), calls=50)
                except Exception as e:  # a config the GPU cannot run (shared memory): skip it
                    row.setdefault("failed", []).append(f"{list(c)}: {type(e).__name__}")
                    continue
                if us < best[0]:
                    best = (us, list(c))
        row["best"], row["best_cfg"] = best
        res[name] = {k_: (round(v, 2) if isinstance(v, float) else v) for k_, v in row.items()}
        base = row.get("shared", row["plain"])
        per_step["plain"] += count * base
        per_step["picked"] += count * row["picked"]
        per_step["best"] += count * row["best"]
        rec("micro", res)
    rec("per_step_us", {k: round(v, 1) for k, v in per_step.items()})


def _fused(wide_k: bool, shared: bool):
    """A hook running the probe kernel (``pick_config``) for the terms chosen, the pack's hook for the rest:
    ``shared`` includes siblings (each then computes its own down), ``wide_k`` includes layers with K >= 4 N (the
    feed-forward's output projection, where the sweep's kernel lost)."""
    def call(self, module, args, output):
        x = args[0]
        chosen = (shared or self.shared is None) and (wide_k or x.shape[-1] < 4 * output.shape[-1])
        if chosen and self.fits(x) and unmerged.can_add_in_place(output, self.up_s.dtype):
            ll.lora_add_triton(output.view(-1, output.shape[-1]), x.reshape(-1, x.shape[-1]), self.down, self.up_s)
            return None
        return _plain_call(self, module, args, output)
    return call


_plain_call = unmerged._LinearTerm.__call__
_side = {}
_pending = {}  # id(term) or id(shared group) -> (x, h, event): a down GEMM running on the side stream


def _overlap_pre(term):
    """Forward pre-hook (capture only): the term's down GEMM forked onto a side stream, beside the base GEMM."""
    def hook(module, args):
        if not torch.cuda.is_current_stream_capturing():
            return
        x = args[0]
        x2 = x.reshape(-1, x.shape[-1])
        down, key = (term.shared.down, id(term.shared)) if term.shared is not None else (term.down, id(term))
        if term.shared is not None and term.rows.start != 0:
            return
        main = torch.cuda.current_stream()
        side = _side.setdefault("s", torch.cuda.Stream())
        h = torch.empty(x2.shape[0], down.shape[0], dtype=x.dtype, device=x.device)  # a main-stream block
        side.wait_stream(main)
        with torch.cuda.stream(side):
            torch.mm(x2, down.t(), out=h)
            ev = torch.cuda.Event()
            ev.record(side)
        _pending[key] = (x, h, ev)
    return hook


def _overlap_call(self, module, args, output):
    key = id(self.shared) if self.shared is not None else id(self)
    got = _pending.get(key)
    if got is None or got[0] is not args[0]:
        return _plain_call(self, module, args, output)
    x, h, ev = got
    if self.shared is None or self.rows.stop == self.shared.down.shape[0]:
        del _pending[key]
    torch.cuda.current_stream().wait_event(ev)
    output.view(-1, output.shape[-1]).addmm_(h[:, self.rows], self.up_s.t())
    return None


@torch.no_grad()
def step():
    unet = full_unet("sdxl", device=dev)
    engine = _engine(unet, dev, torch.float16)
    inputs = unet_inputs("sdxl", batch=2, latent_hw=128, device=dev)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "lora.safetensors"
        save_file(_kohya_unet(unet, R, dev), str(path))
        view = inject_lora(engine, path, 1.0, 0.0, mode="unmerged", strategy="geglu")
        cases = (("none", engine, None), ("lora_reference", view, None),
                 ("lora_fused_all", view, _fused(True, True)), ("lora_fused_narrow", view, _fused(False, True)),
                 ("lora_fused_unshared_narrow", view, _fused(False, False)), ("lora_overlap", view, _overlap_call))
        graphs, outs = {}, {}
        for label, v, call in cases:
            unmerged._LinearTerm.__call__ = call or _plain_call
            handles = []
            with v.session("unet"):
                if call is _overlap_call:
                    binding = view.adapters[-1].binding
                    for comp, slots in binding._slots.items():
                        targets = [t for t in binding.targets if t.component == comp]
                        handles += [t.module.register_forward_pre_hook(_overlap_pre(term))
                                    for (_, _, term, ov), t in zip(slots, targets)
                                    if isinstance(term, unmerged._LinearTerm) and ov is None]
                graphs[label], outs[label] = graph_of(lambda: _call(unet, inputs))
                graphs[label].replay()
                torch.cuda.synchronize()
                outs[label] = outs[label].clone()
            for hd in handles:
                hd.remove()
            rec(f"pending_after_{label}", len(_pending))
            unmerged._LinearTerm.__call__ = _plain_call
        ref = outs["lora_reference"].float()
        rec("step_out_diff", {k: (o.float() - ref).abs().max().item() for k, o in outs.items()})
        times = {k: [] for k in graphs}
        t_end = time.time() + 60
        for _ in range(7):
            for label, g in graphs.items():
                times[label].append(timed(g.replay, 20))
            if time.time() > t_end:
                break
        med = {k: round(statistics.median(v), 2) for k, v in times.items()}
        med.update({f"overhead_{k}": round(med[k] / med["none"] - 1, 4) for k in graphs if k != "none"})
        rec("step_ms", med)
        rec("step_rounds", {k: [round(t, 2) for t in v] for k, v in times.items()})
        del graphs, outs
        gc.collect()


def main():
    parts = sys.argv[1].split(",") if len(sys.argv) > 1 else ["check", "micro", "step"]
    t0 = time.time()
    if "check" in parts:
        check()
    if "step" in parts:
        step()
    if "micro" in parts:
        micro()
    rec("wall_s", round(time.time() - t0, 1))


if __name__ == "__main__":
    main()

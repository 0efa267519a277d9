"""Does the tiled VAE hold its activation budget on the GPU? Peak memory of tiled decode / encode against the budget
and against the tiler's own count, per case and per stage, with the SDPA backend the mid-block attention ran.

Cases (full-size random-weight SD and SDXL VAEs, ``bench.models``; SDXL's config differs only in its scaling factor):
decode and encode, ``exact`` and ``blend``, fp32 and fp16, images of 1024 / 2048 / 4096 px, activation budgets of
0.75 / 1.0 / 1.5 GiB (4096 px: 1.5 GiB; the attention's keys and values alone are 1 GiB in fp32 there). Most
important first (fp32 SDXL decode); a time guard (``--seconds``) skips the rest and lists them.

Per case: ``peak_alloc_gib`` / ``peak_reserved_gib`` = ``max_memory_allocated`` / ``max_memory_reserved`` after
``reset_peak_memory_stats`` minus what was allocated before the call (the weights, stated as ``weights_gib``, and
cuBLAS's workspaces), the budget, ``over_budget_gib``; exact: per pass the bands (``rows``, count), the work budget
and the tiler's estimate for its chosen rows (``_estimate``: the formula on main, the tensor count on the fix);
blend: the tile. The SDPA backend: ``torch._fused_sdp_choice`` at every ``scaled_dot_product_attention`` call (under
the caller's backend restriction) with the query shape and dtype. With ``--stages`` (default on for the budget 1.0
cases) a second run resets the peak at each stage and records each stage's peak above its start, and one case per
dtype records the allocations live at the peak (``torch.cuda.memory`` history), grouped by the pack's / torch's
Python frame that made them: a cuDNN workspace shows as an allocation inside a convolution that is not its output.

Before / after in one device call: carry an export of main as ``.carry/main/leandiffusion`` (e.g.
``git archive main | tar -x -C .carry/main/leandiffusion``) and run this script twice from the fix's checkout:
    python3 scripts/diag/vae_budget_fp32.py --label fix
    python3 scripts/diag/vae_budget_fp32.py --label main --pack .carry/main
``--pack DIR`` imports ``leandiffusion`` from ``DIR`` (first on ``sys.path``); the script uses only names both
versions have (``exact._Pass``, ``_run_chain``, ``_run_attention``, ``_estimate``, ``tiled._blend_tile``).
Writes ``$OUT/vae_budget_fp32_<label>.json``; about 100 s per run on an H100 with the default ``--seconds 110``.
"""
import argparse
import collections
import inspect
import json
import os
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--label", default="run")
parser.add_argument("--pack", default=None, help="folder holding the leandiffusion package to measure")
parser.add_argument("--seconds", type=float, default=110.0, help="stop starting new cases after this")
parser.add_argument("--no-stages", action="store_true")
parser.add_argument("--only", default="", help="run only the cases whose name contains this text")
parser.add_argument("--cpu-check", action="store_true", help="run the instrumentation on the CPU at 64-256 px "
                    "(checks the script against a checkout; measures nothing)")
args = parser.parse_args()
if args.pack:
    sys.path.insert(0, os.path.abspath(args.pack))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import leandiffusion  # noqa: E402
from leandiffusion.bench.models import SD_VAE, _materialise  # noqa: E402
from leandiffusion.vae import exact, tiled  # noqa: E402
from leandiffusion.vae.targets import from_module  # noqa: E402

GiB = 2 ** 30
dev = torch.device("cpu" if args.cpu_check else "cuda")
t_start = time.perf_counter()
out_path = os.path.join(os.environ.get("OUT", "/tmp"), f"vae_budget_fp32_{args.label}.json")
results = {"label": args.label, "pack": os.path.dirname(os.path.abspath(leandiffusion.__file__)),
           "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version(), "tf32_conv": torch.backends.cudnn.allow_tf32,
           "cases": [], "skipped": [], "stages": {}, "peak_blocks": {}}


def save():
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)


def vae_of(kind, dtype):
    from diffusers import AutoencoderKL

    cfg = dict(SD_VAE, scaling_factor=0.13025) if kind == "sdxl" else SD_VAE
    return _materialise(AutoencoderKL, cfg, dev, dtype, seed=0)


# ---- instrumentation (names present on main and on the fix) ----
passes, sdpa_seen = [], collections.Counter()
_orig_pass_init = exact._Pass.__init__
_pass_params = list(inspect.signature(_orig_pass_init).parameters)


def _pass_init(self, *a, **k):
    _orig_pass_init(self, *a, **k)
    bound = dict(zip(_pass_params[1:], a), **k)
    try:
        if "cost" in bound:  # the fix
            est = exact._estimate(self.stage, self.shapes, self.length, self.rows, bound["cost"])
        else:  # main
            eb = torch.empty((), dtype=bound["cfg"].dtype).element_size()
            in_eb = torch.empty((), dtype=bound["in_dtype"]).element_size()
            est = exact._estimate(self.stage, self.shapes, self.length, self.rows, eb, in_eb)
    except Exception as exc:  # noqa: BLE001 - a diagnostic records what it could not compute
        est = f"n/a: {exc}"
    passes.append({"stage": self.stage.name, "length": self.length, "rows": self.rows, "bands": len(self.bands),
                   "work_gib": bound.get("work_budget", 0) / GiB,
                   "estimate_gib": est / GiB if isinstance(est, int) else est})


exact._Pass.__init__ = _pass_init
_orig_sdpa = F.scaled_dot_product_attention


def _sdpa(q, k, v, *a, **kw):
    try:
        from torch.nn.attention import SDPBackend

        choice = SDPBackend(torch._fused_sdp_choice(q, k, v, *a, **kw)).name
    except Exception as exc:  # noqa: BLE001
        choice = f"unknown ({type(exc).__name__})"
    sdpa_seen[f"{choice} q={tuple(q.shape)} {str(q.dtype).replace('torch.', '')}"] += 1
    return _orig_sdpa(q, k, v, *a, **kw)


F.scaled_dot_product_attention = _sdpa

stage_peaks = []


def _stage_wrapper(orig):
    def run(ps, *a, **k):
        cuda = dev.type == "cuda"
        sync()
        base = torch.cuda.memory_allocated() if cuda else 0
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        r = orig(ps, *a, **k)
        sync()
        peak = torch.cuda.max_memory_allocated() - base if cuda else 0
        stage_peaks.append({"stage": ps.stage.name, "out_on_device": ps.out_on_device,
                            "start_gib": base / GiB, "peak_above_start_gib": peak / GiB})
        return r
    return run


def call(mode, kind, target, size, budget):
    if kind == "decode":
        z = torch.randn(1, 4, size // 8, size // 8, generator=torch.Generator().manual_seed(size))
        return tiled.tiled_decode(target, z, 0, 64, mode, budget_bytes=budget, quiet=True)
    px = torch.rand(1, size, size, 3, generator=torch.Generator().manual_seed(size))
    return tiled.tiled_encode(target, px, 0, 64, mode, budget_bytes=budget, quiet=True)


def measure(fn):
    """ms, and the peaks above what was allocated / reserved before the call (after emptying the cache)."""
    sync()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
    reserved = torch.cuda.memory_reserved() if dev.type == "cuda" else 0
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    fn()
    sync()
    ms = (time.perf_counter() - t0) * 1000
    if dev.type != "cuda":
        return {"ms": ms, "base_gib": 0.0, "peak_alloc_gib": 0.0, "peak_reserved_gib": 0.0}
    return {"ms": ms, "base_gib": base / GiB, "peak_alloc_gib": (torch.cuda.max_memory_allocated() - base) / GiB,
            "peak_reserved_gib": (torch.cuda.max_memory_reserved() - reserved) / GiB}


def sync():
    if dev.type == "cuda":
        torch.cuda.synchronize()


def peak_blocks(fn, top=14):
    """Allocations live at the peak of ``fn()``, grouped by the innermost pack / torch.nn frame that made them."""
    mem = torch.cuda.memory
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    mem._record_memory_history(max_entries=400000)
    try:
        fn()
        torch.cuda.synchronize()
        snap = mem._snapshot()
    finally:
        mem._record_memory_history(enabled=None)
    live, cur, best, best_live = {}, 0, -1, {}
    for ev in snap["device_traces"][0]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
            cur += ev["size"]
            if cur > best:
                best, best_live = cur, dict(live)
        elif ev["action"] == "free_completed" and ev["addr"] in live:
            cur -= live.pop(ev["addr"])["size"]
    groups = collections.Counter()
    for ev in best_live.values():
        where = "?"
        for fr in ev.get("frames", []):
            fn_ = fr.get("filename", "")
            if "leandiffusion" in fn_ or "/vae/" in fn_ or "torch/nn/" in fn_ or "diffusers" in fn_:
                where = f"{os.path.basename(fn_)}:{fr.get('line')} {fr.get('name')}"
                break
        groups[where] += ev["size"]
    return {"peak_in_trace_gib": best / GiB,
            "by_frame_gib": {k: round(v / GiB, 4) for k, v in groups.most_common(top)}}


CASES = []  # (vae kind, dtype, direction, mode, size, budget GiB): most important first
for vkind, dtype in (("sdxl", torch.float32), ("sd", torch.float16), ("sd", torch.float32), ("sdxl", torch.float16)):
    if args.cpu_check and (vkind, dtype) != ("sd", torch.float32):
        continue
    for direction in ("decode", "encode"):
        for size, budgets in ((2048, (1.0, 0.75, 1.5)), (1024, (1.0, 0.75)), (4096, (1.5,))):
            for budget in budgets:
                CASES.append((vkind, dtype, direction, "exact", size, budget))
        for size in (2048, 1024, 4096):
            CASES.append((vkind, dtype, direction, "blend", size, 1.0))

vaes = {}
snapped = set()
for vkind, dtype, direction, mode, size, budget_gib in CASES:
    name = f"{vkind}_{str(dtype).replace('torch.', '')}_{direction}_{mode}_{size}_{budget_gib}"
    if args.only not in name:
        continue
    if args.cpu_check:
        size, budget_gib = size // 16, budget_gib / 2000
    if time.perf_counter() - t_start > args.seconds:
        results["skipped"].append(name)
        continue
    key = (vkind, dtype)
    if key not in vaes:
        vaes.clear()
        torch.cuda.empty_cache()
        vaes[key] = vae_of(vkind, dtype)
    vae = vaes[key]
    target = from_module(vae, dev, dtype)
    weights = sum(p.numel() * p.element_size() for p in vae.parameters())
    budget = int(budget_gib * GiB)
    passes.clear()
    sdpa_seen.clear()
    try:
        call(mode, direction, target, min(size, 512), budget)  # warm-up: cuDNN plans, cuBLAS handles
        passes.clear()
        sdpa_seen.clear()
        rec = measure(lambda: call(mode, direction, target, size, budget))
    except torch.cuda.OutOfMemoryError as exc:
        results["cases"].append({"case": name, "error": str(exc).splitlines()[0]})
        continue
    rec.update(case=name, vae=vkind, dtype=str(dtype), direction=direction, mode=mode, size=size,
               budget_gib=budget_gib, weights_gib=weights / GiB,
               over_budget_gib=rec["peak_alloc_gib"] - budget_gib if mode == "exact" else None,
               sdpa=dict(sdpa_seen))
    if mode == "exact":
        rec["passes"] = list({f"{p['stage']}[:{p['length']}]": p for p in passes}.values())
    else:
        rec["blend_tile_px"] = tiled._blend_tile(budget, dtype, size)
    results["cases"].append(rec)
    print(f"{name}: peak {rec['peak_alloc_gib']:.3f} GiB alloc, {rec['peak_reserved_gib']:.3f} reserved "
          f"(budget {budget_gib}), {rec['ms']:.0f} ms, sdpa {dict(sdpa_seen)}", flush=True)
    if mode == "exact" and (name.endswith("_2048_1.0") or args.only) and not args.no_stages:
        chain, att = exact._run_chain, exact._run_attention
        exact._run_chain, exact._run_attention = _stage_wrapper(chain), _stage_wrapper(att)
        stage_peaks.clear()
        try:
            call(mode, direction, target, size, budget)
        finally:
            exact._run_chain, exact._run_attention = chain, att
        results["stages"][name] = list(stage_peaks)
        if (dtype, direction) not in snapped:
            snapped.add((dtype, direction))
            try:
                if dev.type != "cuda":
                    raise RuntimeError("no CUDA")
                results["peak_blocks"][name] = peak_blocks(lambda: call(mode, direction, target, size, budget))
            except Exception as exc:  # noqa: BLE001
                results["peak_blocks"][name] = f"n/a: {type(exc).__name__}: {exc}"
    save()
results["seconds"] = time.perf_counter() - t_start
save()
print("wrote", out_path, "in %.0f s; skipped %d cases" % (results["seconds"], len(results["skipped"])))

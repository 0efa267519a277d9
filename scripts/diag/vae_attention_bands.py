"""The exact tiled VAE's mid-block attention in bands (``vae.attention_bands``) on the GPU: time, memory and error of
each scheme against the whole-map block the executor ran before, and the whole tiled decode under budgets below
that block's floor.

Part ``attn`` (this checkout only): the SD / SDXL VAE mid-block attention (512 channels, 32 groups, random weights
with q / k scaled so the scores spread over several units) on a random map of 1/8 of a 1024 / 2048 / 4096 px image,
fp32 and fp16, input in a device store (and a host store for the streamed case at 4096 px). Variants:
``whole`` (``attention.run_attention``, what ``exact._run_attention`` called before), ``resident`` in one band,
``resident`` in several bands (budget: keys + values + 25%), ``streamed`` (budget: half / a quarter of the keys and
values), ``resident_online`` (the resident keys attended in chunks with TF32 matmuls; budget 1.5x / 3x the keys
and values); for fp32 also ``whole_tf32`` (the untiled decode's TF32 score chunks). The online form runs with TF32
matmuls, as ``exact._run_attention`` passes on CUDA. Per variant: median ms over ``--reps`` after a warm-up, the
allocated peak above the start (``max_memory_allocated``), the plan's estimate, and the max abs error against the
same block in fp64 (computed once per map; an fp16 variant is compared in the same way, its error is fp16
rounding; the TF32 variants' error is TF32 rounding, as the untiled decode's). ``--heads H`` splits the same
block into H heads (a multi-head VAE's shape: 512 / H channels per head, which the flash kernels take from 2 heads
on) to measure ``attention_bands.prefers_online``'s rule for narrow heads; ``--dtypes fp16`` skips the fp32 maps.

Part ``decode`` (any checkout, ``--pack DIR`` for another): ``tiled.tiled_decode`` of the SDXL VAE in ``exact``
mode at budgets below and above the old floor (fp32 2048 px at 0.5-1.5 GiB, 4096 px at 1.0 / 1.5 / 3.0 GiB; fp16
2048 px at 1.0 GiB, 4096 px at 0.75 / 1.0 / 3.0 GiB): ms after a warm-up call of the same size, allocated and
reserved peak above the weights; at 2048 px the max abs difference from the
untiled decode of the same latent (0..1 image).

Writes ``$OUT/vae_attention_bands_<label>.json``. Commands (about 3 min on an H100 together):
    python3 scripts/diag/vae_attention_bands.py --label new --parts attn,decode
    python3 scripts/diag/vae_attention_bands.py --label main --parts decode --pack .carry/main
    python3 scripts/diag/vae_attention_bands.py --label heads8 --parts attn --heads 8 --dtypes fp16
"""
import argparse
import json
import os
import statistics
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--label", default="run")
parser.add_argument("--parts", default="attn,decode")
parser.add_argument("--pack", default=None, help="folder holding the leandiffusion package to measure")
parser.add_argument("--reps", type=int, default=3)
parser.add_argument("--decode-reps", type=int, default=1, help="timed decodes per case (median)")
parser.add_argument("--only", default="", help="decode cases named <dtype>_<px>_<budget> containing this text")
parser.add_argument("--sizes", default="1024,2048,4096")
parser.add_argument("--heads", type=int, default=1, help="attention heads of the block (part attn; the SD VAE has 1)")
parser.add_argument("--dtypes", default="fp32,fp16", help="part attn's compute dtypes")
parser.add_argument("--cpu-check", action="store_true", help="tiny sizes on the CPU (checks the script only)")
args = parser.parse_args()
if args.pack:
    sys.path.insert(0, os.path.abspath(args.pack))

import torch  # noqa: E402

import leandiffusion  # noqa: E402
from leandiffusion.bench.models import SD_VAE, _materialise  # noqa: E402
from leandiffusion.vae import tiled  # noqa: E402
from leandiffusion.vae.targets import from_module  # noqa: E402

GiB = 2 ** 30
dev = torch.device("cpu" if args.cpu_check else "cuda")
cuda = dev.type == "cuda"
parts = set(args.parts.split(","))
out_path = os.path.join(os.environ.get("OUT", "/tmp"), f"vae_attention_bands_{args.label}.json")
results = {"label": args.label, "pack": os.path.dirname(os.path.abspath(leandiffusion.__file__)),
           "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
           "attn": [], "decode": []}


def save():
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)


def sync():
    if cuda:
        torch.cuda.synchronize()


def timed(fn, reps):
    """(median ms, allocated peak above the start in GiB, last result) of ``fn()``, after one warm-up call."""
    fn()
    sync()
    times, peak, r = [], 0.0, None
    for _ in range(reps):
        r = None
        sync()
        base = torch.cuda.memory_allocated() if cuda else 0
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        r = fn()
        sync()
        times.append((time.perf_counter() - t0) * 1000)
        if cuda:
            peak = max(peak, (torch.cuda.max_memory_allocated() - base) / GiB)
    return statistics.median(times), peak, r


def vae_of(dtype, scaling=0.13025):
    from diffusers import AutoencoderKL

    return _materialise(AutoencoderKL, dict(SD_VAE, scaling_factor=scaling), dev, dtype, seed=0)


def part_attn():
    from leandiffusion.vae.attention import run_attention, spec_from_diffusers
    from leandiffusion.vae.attention_bands import MapCost, plan_bands, resident_bytes, run_banded
    from leandiffusion.vae.stats import GroupStats
    from leandiffusion.vae.stores import DeviceStore, HostStore, Streams

    base = vae_of(torch.float32).decoder.mid_block.attentions[0]
    base.heads = args.heads  # a multi-head VAE's block: the same projections split into narrower heads
    with torch.no_grad():  # scores spread over several units, as in a trained VAE
        base.to_q.weight.mul_(4.0)
        base.to_k.weight.mul_(4.0)
    for px in [int(s) for s in args.sizes.split(",")]:
        n = px // 8 if not args.cpu_check else px // 128
        gen = torch.Generator(device=dev).manual_seed(px)
        x64 = torch.randn((1, 512, n, n), generator=gen, device=dev, dtype=torch.float64)
        block64 = spec_from_diffusers(base.double())
        t0 = time.perf_counter()
        with torch.no_grad():
            ref = run_attention(block64, x64)
        ref_s = time.perf_counter() - t0
        base.float()
        scale = ref.abs().max().item()
        for dtype in [{"fp32": torch.float32, "fp16": torch.float16}[d] for d in args.dtypes.split(",")]:
            block = base.to(dtype)
            spec = spec_from_diffusers(block)
            x = x64.to(dtype).contiguous(memory_format=torch.channels_last)
            eb = x.element_size()
            kv = resident_bytes(MapCost(512, n, n, eb, eb, True, args.heads), 1) - 4 * 512 * n * eb
            stats = GroupStats(32)
            stats.add(x)
            fp32 = dtype == torch.float32
            tf32 = cuda  # what exact._run_attention passes on CUDA (fp32: TF32 convolutions, PyTorch's default)
            variants = [("whole", None, True, False), ("resident_1band", 10 ** 15, True, False),
                        ("resident_bands", int(1.25 * kv), True, False), ("streamed_half", kv // 2, True, False),
                        ("streamed_quarter", kv // 4, True, False)]
            variants[1:1] = [("resident_online_bands", int(1.5 * kv), True, True),
                             ("resident_online_roomy", 3 * kv, True, True)]
            if fp32:
                variants[1:1] = [("whole_tf32", None, True, True)]
            if px >= 4096:
                variants.append(("streamed_half_host_store", kv // 2, False, False))
            for name, budget, on_device, online in variants:
                rec = {"px": px, "dtype": str(dtype), "variant": name, "budget_gib": (budget or 0) / GiB,
                       "heads": args.heads}
                try:
                    if budget is None:
                        def fn():
                            with torch.no_grad():
                                return run_attention(spec, x, tf32=online and cuda)
                    else:
                        hwc = x[0].permute(1, 2, 0).contiguous()
                        streams = Streams(dev)
                        if on_device:
                            store = DeviceStore(n, n, 512, dtype, dev, streams)
                            store.data.copy_(hwc)
                        else:
                            store = HostStore(n, n, 512, dtype, dev, streams, data=hwc.cpu().pin_memory()
                                              if cuda else hwc.cpu())
                        del hwc
                        cost = MapCost(512, n, n, eb, eb, on_device, args.heads)
                        bp = plan_bands(cost, budget, online=online)
                        rec.update(scheme=bp.scheme, rows=bp.rows, online=bp.online, estimate_gib=bp.estimate / GiB)
                        out = torch.empty_like(x)

                        def sink(a, y):
                            out[:, :, a:a + y.shape[2]] = y

                        def fn():
                            with torch.no_grad():
                                run_banded(spec, store.prefetch, stats, (512, n, n), bp, sink, dtype, tf32=tf32)
                            return out
                    ms, peak, y = timed(fn, args.reps if px < 4096 else 1)
                    rec.update(ms=ms, peak_alloc_gib=peak,
                               max_abs_err=(y.double() - ref).abs().max().item(), ref_scale=scale)
                    del y
                except torch.cuda.OutOfMemoryError as exc:
                    rec["error"] = str(exc).splitlines()[0]
                results["attn"].append(rec)
                print({k: (round(v, 5) if isinstance(v, float) else v) for k, v in rec.items()}, flush=True)
                save()
                store = out = None
                if cuda:
                    torch.cuda.empty_cache()
        results.setdefault("fp64_reference_s", {})[px] = ref_s
        del ref, x64


def part_decode():
    cases = [(torch.float32, 2048, 0.5), (torch.float32, 2048, 0.75), (torch.float32, 2048, 1.0),
             (torch.float32, 2048, 1.5), (torch.float32, 4096, 1.0), (torch.float32, 4096, 1.5),
             (torch.float32, 4096, 3.0), (torch.float16, 2048, 1.0), (torch.float16, 4096, 0.75),
             (torch.float16, 4096, 1.0), (torch.float16, 4096, 3.0)]
    untiled = {}
    for dtype in (torch.float32, torch.float16):
        vae = vae_of(dtype)
        target = from_module(vae, dev, dtype)
        weights = sum(p.numel() * p.element_size() for p in vae.parameters())
        for cdtype, px, budget_gib in cases:
            if cdtype != dtype or not any(o in f"{str(dtype)[6:]}_{px}_{budget_gib}" for o in args.only.split(",")):
                continue
            if args.cpu_check:
                px, budget_gib = px // 16, budget_gib / 2000
            z = torch.randn(1, 4, px // 8, px // 8, generator=torch.Generator().manual_seed(px))
            rec = {"dtype": str(dtype), "px": px, "budget_gib": budget_gib, "weights_gib": weights / GiB}
            try:
                sync()
                if cuda:
                    torch.cuda.empty_cache()
                reserved = torch.cuda.memory_reserved() if cuda else 0
                ms, peak, img = timed(lambda: tiled.tiled_decode(target, z, 0, 64, "exact",
                                                                 budget_bytes=int(budget_gib * GiB), quiet=True),
                                    args.decode_reps)  # after a warm-up call of the same size (cuDNN plans)
                rec.update(ms=ms, peak_alloc_gib=peak,
                           peak_reserved_gib=((torch.cuda.max_memory_reserved() - reserved) / GiB) if cuda else 0)
                if px <= 2048:
                    if (dtype, px) not in untiled:
                        with torch.no_grad():
                            y = vae.decode(z.to(dev, dtype)).sample
                        untiled[(dtype, px)] = ((y.float() + 1) / 2).clamp(0, 1)[0].permute(1, 2, 0).cpu()
                        del y
                    rec["max_abs_diff_vs_untiled"] = (img - untiled[(dtype, px)]).abs().max().item()
                del img
            except torch.cuda.OutOfMemoryError as exc:
                rec["error"] = str(exc).splitlines()[0][:300]
            results["decode"].append(rec)
            print(rec, flush=True)
            save()
            if cuda:
                torch.cuda.empty_cache()
        untiled.clear()
        vae = target = None


t_start = time.perf_counter()
if "attn" in parts:
    part_attn()
if "decode" in parts:
    part_decode()
results["seconds"] = time.perf_counter() - t_start
save()
print("wrote", out_path, "in %.0f s" % results["seconds"])

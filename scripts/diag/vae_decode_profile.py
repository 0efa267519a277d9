"""Where an untiled VAE decode spends GPU time, with PyTorch's GroupNorm and with vae.group_norm's parallel one.

Usage (device machine, pack importable as leandiffusion): python scripts/diag/vae_decode_profile.py [profile]
Writes $OUT/vae_decode_profile.json: per case (SDXL fp32 1024 px, SD1.5 fp16 512 and 1024 px, one image) the
decode time with PyTorch's GroupNorm and inside ``parallel_group_norms`` for each row-length threshold in
$GN_THRESHOLDS (default: the module's), three alternating rounds; the max abs difference on the image; and (with
``profile``) the kernel-time breakdown of both.
"""
import json
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from diag_timing import timed
from leandiffusion.bench.models import full_vae
from leandiffusion.vae import group_norm as gn

OUT = os.environ.get("OUT", "/tmp")
dev = torch.device("cuda")
res = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}


def rec(k, v):
    res[k] = v
    print(k, json.dumps(v)[:1500], flush=True)
    json.dump(res, open(f"{OUT}/vae_decode_profile.json", "w"), indent=1)


def timed_ms(fn, n=5):
    fn()
    return timed(fn, n)


def kernels(fn):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    ks = {}
    for e in p.key_averages():
        t = getattr(e, "device_time_total", 0)
        if t and e.device_type == torch.autograd.DeviceType.CUDA:
            ks[e.key[:110]] = round(t / 1000, 2)
    top = sorted(ks.items(), key=lambda kv: -kv[1])[:12]
    return {"total_ms": round(sum(ks.values()), 2), "top": top}


THRESHOLDS = [int(v) for v in os.environ.get("GN_THRESHOLDS", str(gn.MIN_GROUP_ELEMENTS)).split(",")]
with torch.no_grad():
    for name, dtype, hw in (("sdxl_fp32_1024", torch.float32, 128), ("sd15_fp16_512", torch.float16, 64),
                            ("sd15_fp16_1024", torch.float16, 128)):
        vae = full_vae(device=dev, dtype=dtype)
        z = torch.randn(1, 4, hw, hw, device=dev, generator=torch.Generator(dev).manual_seed(0)).to(dtype)

        def native():
            return vae.decode(z, return_dict=False)[0]

        def parallel():
            with gn.parallel_group_norms(vae):
                return vae.decode(z, return_dict=False)[0]

        a = native().float()
        row = {"native_ms": [], "image_absmax": a.abs().max().item()}
        for t in THRESHOLDS:
            gn.MIN_GROUP_ELEMENTS = t
            b = parallel().float()
            row[f"max_abs_diff@{t}"] = (a - b).abs().max().item()
        for _ in range(3):  # alternate, so drift and warm-up hit every variant alike
            row["native_ms"].append(round(timed_ms(native), 2))
            for t in THRESHOLDS:
                gn.MIN_GROUP_ELEMENTS = t
                row.setdefault(f"parallel_ms@{t}", []).append(round(timed_ms(parallel), 2))
        rec(name, row)
        if "profile" in sys.argv[1:]:
            gn.MIN_GROUP_ELEMENTS = THRESHOLDS[0]
            rec(name + "_kernels", {"native": kernels(native), "parallel": kernels(parallel)})
        del vae
        torch.cuda.empty_cache()

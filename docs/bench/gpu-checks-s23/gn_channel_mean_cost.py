"""Session 23: cost and effect of vae.group_norm's fp32 channel means (fixed) against half ones (old), same run.
Run from the repository root on the device: python docs/bench/gpu-checks-s23/gn_channel_mean_cost.py -> $OUT/gn_fix.json
"""
import json, os, sys
sys.path.insert(0, "scripts/diag")
import torch
from diag_timing import timed
from leandiffusion.bench.models import full_vae
from leandiffusion.vae import group_norm as gn
OUT = os.environ.get("OUT", "/tmp"); dev = torch.device("cuda")
fixed = gn.var_and_wide_mean
def old(x, dims, acc):
    return torch.var_mean(x, dim=dims, correction=0)
res = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
with torch.no_grad():
    for name, dtype, hw in (("sd15_fp16_512", torch.float16, 64), ("sd15_fp16_1024", torch.float16, 128)):
        vae = full_vae(device=dev, dtype=dtype)
        z = torch.randn(1, 4, hw, hw, device=dev, generator=torch.Generator(dev).manual_seed(0)).to(dtype)
        def native(): return vae.decode(z, return_dict=False)[0]
        def par(): 
            with gn.parallel_group_norms(vae): return vae.decode(z, return_dict=False)[0]
        a = native().float()
        ref = None
        row = {}
        for tag, f in (("fixed", fixed), ("old", old)):
            gn.var_and_wide_mean = f
            b = par().float(); row[f"diff_vs_native_{tag}"] = (a - b).abs().max().item()
        row["image_absmax"] = a.abs().max().item()
        for _ in range(3):
            row.setdefault("native_ms", []).append(round(timed(native, 5), 2))
            for tag, f in (("fixed", fixed), ("old", old)):
                gn.var_and_wide_mean = f; par()
                row.setdefault(f"{tag}_ms", []).append(round(timed(par, 5), 2))
        gn.var_and_wide_mean = fixed
        res[name] = row; print(name, json.dumps(row), flush=True)
        vae = None; torch.cuda.empty_cache()
json.dump(res, open(f"{OUT}/gn_fix.json", "w"), indent=1)

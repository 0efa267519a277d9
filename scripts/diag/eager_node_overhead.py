"""Why the Fused DDIM Sampler node with ``acceleration=none`` is slower than ComfyUI's KSampler at SD1.5 512 px.

The comfyui suite (session 12, H100) measured the node at 888 ms for 20 steps against KSampler's 606 ms, while the
sampler suite's eager loop matches diffusers'. This script separates the node's cost into its parts, in one process:

- phase ``before``: ComfyUI not importable; the node (``none``, ``cuda_graph``), the bare ``denoise`` loop on the
  node's own conditioning, one eager UNet call (CFG batch 2), the prompt encoding alone;
- phase ``after``: the same after ComfyUI's modules are imported and its KSampler ran once (what the suite does);
- a CPU profile of one ``none`` node call (top ops by self CPU time) in each phase.

Usage (repo root, pack importable): ``python scripts/diag/eager_node_overhead.py <comfyui path>``; writes
``$OUT/eager_node_overhead.json``.
"""
import os
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
from diag_timing import Recorder  # noqa: E402

from leandiffusion.bench import suite_comfyui as sc  # noqa: E402
from leandiffusion.bench.harness import time_ms  # noqa: E402

COMFY = Path(sys.argv[1]).resolve()
rec = Recorder("eager_node_overhead.json")
SMOKE = os.environ.get("DIAG_SMOKE") == "1"  # CPU plumbing check: fp32, 2 steps, 64 px
dev, dtype = (torch.device("cpu"), torch.float32) if SMOKE else (torch.device("cuda"), torch.float16)
STEPS, HW = (2, 64) if SMOKE else (20, 512)
_n = iter(range(10 ** 6))  # distinct prompts: the prompt cache must miss

parts = sc.make_parts("sd15", types.SimpleNamespace(path=COMFY), dev, dtype)
engine = sc.make_engine(parts, "full", 1e6, dev, dtype)
sampler = sc.node_fn("LeanFusedDDIMSampler")
rec("attn_processors", sorted({type(p).__name__ for p in parts.unet.attn_processors.values()}))


def node_kw(accel):
    return dict(lean_model=engine, positive="a photo of a cat", negative="blurry", seed=0, steps=STEPS, cfg=7.5,
                eta=0.0, width=HW, height=HW, batch_size=1, timestep_spacing="leading", cfg_mode="batched",
                acceleration=accel)


def loop_fn():
    from leandiffusion.sampling import ddim
    from leandiffusion.sampling.cfg import encode_conditioning
    from leandiffusion.sampling.loop import denoise

    cond = encode_conditioning(engine, "a photo of a cat", "blurry", 1, True, HW, HW)
    rec("encode_ms", time_ms(lambda: encode_conditioning(engine, "a cat %d" % next(_n), "blurry", 1, True, HW, HW),
                             warmup=1, repeat=3, device=dev))
    config = ddim.config_with(ddim.pipeline_config(parts.scheduler_config, False), timestep_spacing="leading")
    schedule = ddim.make_schedule(config, STEPS, 0.0, "leading")
    x = torch.randn(1, 4, HW // 8, HW // 8, generator=torch.Generator().manual_seed(0))

    def run():
        with engine.session("unet"):
            return denoise(engine, cond, x, schedule, 7.5, "batched", "none", quiet=True)

    return run, cond


def unet_call(cond):
    x = torch.randn(2, 4, HW // 8, HW // 8, device=dev, dtype=dtype)
    t = torch.tensor([500.0, 500.0], device=dev)
    ctx = torch.randn(2, 77, 768, device=dev, dtype=dtype)

    @torch.no_grad()
    def run():
        return parts.unet(x, t, encoder_hidden_states=ctx, return_dict=False)[0]

    return run


def profile_top(fn, n=25):
    from torch.profiler import ProfilerActivity, profile

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    fn()
    sync()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
        sync()
    rows = []
    for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:n]:
        rows.append([e.key, e.count, round(e.self_cpu_time_total / 1000, 2), round(e.cpu_time_total / 1000, 2)])
    return rows


def phase(name):
    for accel in ("none", "cuda_graph"):
        rec(f"{name}/node_{accel}_ms", time_ms(lambda: sampler(**node_kw(accel)), warmup=1, repeat=3, device=dev))
    try:
        run, cond = loop_fn()
        rec(f"{name}/denoise_none_ms", time_ms(run, warmup=1, repeat=3, device=dev))
        rec(f"{name}/unet_eager_call_ms", time_ms(unet_call(cond), warmup=2, repeat=20, device=dev))
    except Exception as exc:  # a helper's signature differs: keep the node numbers
        rec(f"{name}/loop_error", repr(exc))
    rec(f"{name}/profile_node_none", profile_top(lambda: sampler(**node_kw("none"))))


phase("before")
comfy = sc.Comfy(COMFY, cpu=SMOKE)
g = torch.Generator("cpu").manual_seed(0)
context = torch.randn(1, 77, 768, generator=g).to(dtype)
pos, neg = sc.sd_cond("sd15", context, None, HW), sc.sd_cond("sd15", context * 0.5, None, HW)
sc.park_on_cpu(parts.unet, parts.vae, parts.text_encoder)
patcher = comfy.unet_patcher(parts.unet, dtype)
latent = torch.zeros(1, 4, HW // 8, HW // 8)
rec("comfy/ksampler_ms", time_ms(lambda: comfy.ksampler(patcher, pos, neg, latent, STEPS, 7.5, 0), warmup=1,
                                   repeat=3, device=dev))
rec("comfy/profile_ksampler", profile_top(lambda: comfy.ksampler(patcher, pos, neg, latent, STEPS, 7.5, 0)))
comfy.unload_all()
del patcher
sc.free_cuda()
for m in (parts.unet, parts.vae, parts.text_encoder):
    m.to(dev)
phase("after")
print("done", flush=True)

"""Session-4 diag: SDXL UNet batching efficiency, VAE decode variants, decode/UNet concurrency, stream 8x30."""
import json, os, sys, time, gc
import torch
from leandiffusion.bench.models import full_unet, full_vae, unet_inputs
OUT = os.environ.get("OUT", "/tmp"); dev = torch.device("cuda")
res = {}
PARTS = sys.argv[1].split(",") if len(sys.argv) > 1 else ["unet", "vae", "conc", "stream"]
def rec(k, v):
    res[k] = v; print(k, v, flush=True); json.dump(res, open(f"{OUT}/s4.json", "w"), indent=1)

from diag_timing import graph_of, timed

unet = full_unet("sdxl", device=dev)
def unet_graph(B, cl=False):
    inp = unet_inputs("sdxl", 2 * B, 128, device=dev)
    if cl: inp["sample"] = inp["sample"].contiguous(memory_format=torch.channels_last)
    return graph_of(lambda: unet(**inp, return_dict=False))[0]

if "unet" in PARTS:
    from torch.nn.attention import sdpa_kernel, SDPBackend
    for cl in (False, True):
        if cl: unet.to(memory_format=torch.channels_last)
        for B in (1, 2, 4, 8):
            try:
                g = unet_graph(B, cl); ms = timed(g.replay, 10 if B < 8 else 5)
                rec(f"unet_cl{int(cl)}_B{B}", {"ms_per_call": round(ms, 2), "ms_per_image": round(ms / B, 2)})
                del g
            except Exception as e:
                rec(f"unet_cl{int(cl)}_B{B}", repr(e)[:300])
            gc.collect(); torch.cuda.empty_cache()
        if cl: unet.to(memory_format=torch.contiguous_format)
    for be in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"):
        for B in (1, 8):
            try:
                with sdpa_kernel([getattr(SDPBackend, be)]):
                    g = unet_graph(B)
                ms = timed(g.replay, 10 if B < 8 else 5); del g
                rec(f"unet_{be}_B{B}", {"ms_per_image": round(ms / B, 2)})
            except Exception as e:
                rec(f"unet_{be}_B{B}", repr(e)[:300])
            gc.collect(); torch.cuda.empty_cache()

vae = full_vae(device=dev, dtype=torch.float32)
def decode_ms(B, dtype=torch.float32, cl=False, n=3):
    v = vae if dtype == torch.float32 else full_vae(device=dev, dtype=dtype)
    if cl: v.to(memory_format=torch.channels_last)
    z = torch.randn(B, 4, 128, 128, device=dev, dtype=dtype)
    if cl: z = z.contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        f = lambda: v.decode(z, return_dict=False)
        f(); ms = timed(f, n)
    if cl: v.to(memory_format=torch.contiguous_format)
    return ms / B
if "vae" in PARTS:
    for name, kw in [("fp32_B1", dict(B=1)), ("fp32_B4", dict(B=4)), ("fp32_cl_B1", dict(B=1, cl=True)),
                     ("bf16_B1", dict(B=1, dtype=torch.bfloat16)), ("fp16_B1", dict(B=1, dtype=torch.float16))]:
        try:
            rec(f"vae_{name}_ms_per_image", round(decode_ms(**kw), 2))
        except Exception as e:
            rec(f"vae_{name}", repr(e)[:300])
        gc.collect(); torch.cuda.empty_cache()
    torch.backends.cudnn.benchmark = True
    rec("vae_fp32_B1_cudnn_benchmark_ms", round(decode_ms(1), 2)); rec("vae_fp32_B1_cudnn_benchmark_ms_again", round(decode_ms(1), 2))
    torch.backends.cudnn.benchmark = False

if "conc" in PARTS:
    with torch.no_grad():
        g = unet_graph(4); z = torch.randn(4, 4, 128, 128, device=dev)
        side = torch.cuda.Stream()
        dec = lambda: vae.decode(z, return_dict=False)
        dec()
        u = timed(lambda: [g.replay() for _ in range(10)], 1)
        d = timed(dec, 1)
        torch.cuda.synchronize(); t0 = time.perf_counter()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side): dec()
        for _ in range(10): g.replay()
        torch.cuda.synchronize(); both = (time.perf_counter() - t0) * 1000
        rec("conc_B4", {"unet10_ms": round(u, 1), "decode4_ms": round(d, 1), "both_ms": round(both, 1),
                        "hidden_share": round((u + d - both) / d, 3)})
        del g; gc.collect(); torch.cuda.empty_cache()

del unet, vae; gc.collect(); torch.cuda.empty_cache()
if "stream" in PARTS:
    from leandiffusion.bench import suite_stream as SS
    from leandiffusion.sampling.stream.scheduler import run_stream
    from leandiffusion.sampling.stream.settings import StreamSettings
    from leandiffusion.sampling.stream.streams import Timeline
    parts = SS._full_parts("sdxl", dev); eng = SS._engine(parts, dev)
    N, STEPS = 8, int(os.environ.get("S4_STEPS", "30"))
    def st(mb): return StreamSettings.from_text(SS._prompts(N), negative=SS.NEGATIVE, seed=1000, steps=STEPS, cfg=SS.CFG,
                                                width=1024, height=1024, acceleration="cuda_graph", max_batch=mb)
    SS._fused_one_by_one(eng, st(0), limit=1)
    peer = SS._seconds(lambda: SS._fused_one_by_one(eng, st(0)), dev, 1); rec("stream_peer_s", peer)
    for mb in [int(x) for x in os.environ.get("S4_MB", "0,4").split(",")]:
        r = run_stream(eng, st(mb), quiet=True)
        t = SS._seconds(lambda: run_stream(eng, st(mb), quiet=True), dev, 1)
        tl = Timeline(); run_stream(eng, st(mb), timeline=tl, quiet=True); summ = SS._timeline_summary(tl.to_list())
        rec(f"stream_mb{mb}", {"s": t, "ratio": peer / t, "batches": list(r.batch_sizes), "tl": {k: round(v, 1) for k, v in summ.items()}})
    rec("stream_peer2_s", SS._seconds(lambda: SS._fused_one_by_one(eng, st(0)), dev, 1))

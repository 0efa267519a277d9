"""Where the SDXL 8 x 30 stream run's time goes against its peer, phase by phase, with the GPU's clocks.

A probe, not pack code. Builds the stream suite's SDXL engine (full-size random weights, ``full`` policy,
``cuda_graph``), warms both contenders, then in alternating rounds times: the prompt-by-prompt peer (per prompt:
sampling and decode, synchronised), the stream run (wall, stage timeline), and the bare replays of the two cached
step graphs (batch 1 and batch 8, 30 back-to-back) -- so the UNet stage's cost in the run can be compared with the
same graph replayed alone. nvidia-smi samples SM clock, power and temperature every 100 ms in the background; each
phase records its mean. Usage (device, pack importable): python scripts/diag/stream_sdxl_gap.py [rounds];
writes $OUT/stream_gap.json and $OUT/smi.csv.
"""
import json
import os
import subprocess
import sys
import time

import torch

from leandiffusion.bench import suite_stream as SS
from leandiffusion.sampling.graph_runner import default_runner
from leandiffusion.sampling.loop import sample
from leandiffusion.sampling.stream.scheduler import run_stream
from leandiffusion.sampling.stream.settings import StreamSettings
from leandiffusion.sampling.stream.streams import Timeline

OUT = os.environ.get("OUT", "/tmp")
dev = torch.device("cuda")
res = {"device": torch.cuda.get_device_name(), "phases": []}
SMI = f"{OUT}/smi.csv"
smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active",
                        "--format=csv,noheader,nounits", "-lms", "100"], stdout=open(SMI, "w"),
                       stderr=subprocess.DEVNULL)
T0 = time.time()


def save():
    json.dump(res, open(f"{OUT}/stream_gap.json", "w"), indent=1)


def smi_mean(t_start, t_end):
    clocks, power = [], []
    for line in open(SMI):
        parts = [p.strip() for p in line.split(",")]
        try:
            ts = time.mktime(time.strptime(parts[0].split(".")[0], "%Y/%m/%d %H:%M:%S")) + float("0." + parts[0].split(".")[1])
        except (ValueError, IndexError):
            continue
        if t_start <= ts <= t_end:
            clocks.append(float(parts[1]))
            power.append(float(parts[2]))
    if not clocks:
        return None
    return {"sm_mhz": round(sum(clocks) / len(clocks)), "min_sm_mhz": min(clocks),
            "power_w": round(sum(power) / len(power)), "samples": len(clocks)}


def phase(name, fn):
    torch.cuda.synchronize()
    a = time.time()
    t0 = time.perf_counter()
    extra = fn()
    torch.cuda.synchronize()
    s = time.perf_counter() - t0
    b = time.time()
    entry = {"phase": name, "s": round(s, 4), **(extra or {})}
    res["phases"].append((entry, (a, b)))
    print(entry, flush=True)
    return s


parts = SS._full_parts("sdxl", dev)
eng = SS._engine(parts, dev)
N, STEPS = 8, 30
settings = StreamSettings.from_text(SS._prompts(N), negative=SS.NEGATIVE, seed=1000, steps=STEPS, cfg=SS.CFG,
                                    width=1024, height=1024, acceleration="cuda_graph", max_batch=0)


def peer():
    s = settings.validated()
    samp, dec = 0.0, 0.0
    for job in s.jobs():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        lat = sample(eng, s.sampler_settings(s.prompts[job.prompt_index], job.seed), quiet=True)["samples"]
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        with eng.session("vae"):
            eng.vae_decode(lat)
        torch.cuda.synchronize()
        samp += t1 - t0
        dec += time.perf_counter() - t1
    return {"sample_ms_per_image": round(1e3 * samp / N, 1), "decode_ms_per_image": round(1e3 * dec / N, 1)}


def stream():
    tl = Timeline()
    r = run_stream(eng, settings, quiet=True, timeline=tl)
    summ = SS._timeline_summary(tl.to_list())
    return {"batches": list(r.batch_sizes), **{k: round(v, 1) for k, v in summ.items()},
            "unet_ms_per_image_step": round(summ["unet_ms"] / (N * STEPS), 2)}


def bare(batch):
    entry = default_runner()._cache[eng.parts]
    step = [c for c in entry.graphs.values() if c.program.latent_shape[0] == batch][0]

    def fn():
        for _ in range(STEPS):
            step.replay()
    return fn


peer()
run_stream(eng, settings, quiet=True)
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
for r in range(rounds):
    p = phase(f"peer_r{r}", peer)
    s = phase(f"stream_r{r}", stream)
    res.setdefault("ratios", []).append(round(p / s, 4))
    for b in (1, 8):
        t = phase(f"bare_B{b}_r{r}", bare(b))
        res["phases"][-1][0]["ms_per_image_step"] = round(1e3 * t / (STEPS * b), 2)
    save()
time.sleep(0.5)
smi.terminate()
smi.wait()
res["phases"] = [{**e, "smi": smi_mean(a, b)} for e, (a, b) in res["phases"]]
save()
print(json.dumps(res, indent=1))

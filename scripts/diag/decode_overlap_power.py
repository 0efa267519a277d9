"""Can the SDXL fp32 decode hide behind batched UNet replays when the GPU is at its power limit?

A probe, not pack code (issue 10's SDXL line). The Stream Scheduler's 8 x 30 SDXL run is one batch of 8, so its
8 decodes (~505 ms of ~8580 ms) run after the last step, alone. A schedule that staggers the batch (half of it
starting a few steps early, so its decode overlaps the other half's last steps) only pays if a decode beside
UNet work costs less than the decode alone. At the power limit that depends on how much power the decode draws.

For the engine's SDXL UNet (fp16, one-pass GEGLU, CUDA graph of one call at 1, 4 and 8 images, CFG rows 2 / 8 /
16) and its fp32 untiled decode of one 1024 px latent, each measured with the board power and SM clock
(``bench.gpu_clocks``): ms per image-step and per decode alone; then ``R`` UNet replays at 8 images with ``D``
decodes on a side stream (normal and high priority), against the two run back to back. ``hidden`` is the share
of the decodes' time that the overlap saved. (``stream_sdxl_bounds.py conc``, session 4, made the same overlap
test with diffusers' decode, no stream priority and no power readings.) Usage (device, pack importable):
``python scripts/diag/decode_overlap_power.py``; writes ``$OUT/decode_overlap.json``.
"""
import time

import torch

from diag_timing import Recorder, graph_of
from leandiffusion.bench import suite_stream as SS
from leandiffusion.bench.gpu_clocks import clock_sampler
from leandiffusion.bench.models import unet_inputs
from leandiffusion.vae import untiled

dev = torch.device("cuda")
rec = Recorder("decode_overlap.json")


def run_measured(fn):
    """Wall ms of ``fn()`` with the board power and clock sampled meanwhile."""
    torch.cuda.synchronize()
    with clock_sampler(dev) as clocks:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1000
    return {"ms": round(ms, 1), "W": round(clocks.get("power_w", 0), 1), "MHz": round(clocks.get("sm_mhz", 0)),
            "MHz_min": clocks.get("sm_mhz_min")}


def main():
    parts = SS._full_parts("sdxl", dev)
    eng = SS._engine(parts, dev)
    with torch.no_grad(), eng.session("unet"), eng.session("vae"), untiled.fast_vae(parts.vae):
        vae = parts.vae
        z = torch.randn(1, 4, 128, 128, device=dev, dtype=eng.vae_dtype)

        def decode():
            return untiled.decode(vae, z)

        for _ in range(3):
            decode()
        graphs = {}
        for images in (1, 4, 8):
            inp = unet_inputs("sdxl", 2 * images, 128, device=dev)
            graph, out = graph_of(lambda inp=inp: parts.unet(**inp, return_dict=False))
            graphs[images] = (graph, out, inp)  # the replays read and write these: keep them alive

        def replays(images, n):
            for _ in range(n):
                graphs[images][0].replay()

        # warm the GPU into its steady state before anything is timed
        run_measured(lambda: replays(8, 10))
        for images, n in ((1, 60), (4, 16), (8, 8), (1, 60), (4, 16), (8, 8)):
            r = run_measured(lambda: replays(images, n))
            r["ms_per_image_step"] = round(r["ms"] / n / images, 2)
            rec(f"unet_B{images}_{n}", r)
        d = run_measured(lambda: [decode() for _ in range(24)])
        d["ms_per_decode"] = round(d["ms"] / 24, 2)
        rec("decode_x24", d)

        R, D = 8, 4
        for rnd in range(2):
            u = run_measured(lambda: replays(8, R))
            dd = run_measured(lambda: [decode() for _ in range(D)])
            seq = run_measured(lambda: (replays(8, R), [decode() for _ in range(D)]))
            rec(f"round{rnd}_alone", {"unet": u, "decodes": dd, "back_to_back": seq})
            for prio in (0, -1):
                side = torch.cuda.Stream(priority=prio)

                def both():
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        for _ in range(D):
                            decode()
                    replays(8, R)
                    torch.cuda.current_stream().wait_stream(side)

                b = run_measured(both)
                b["hidden"] = round((seq["ms"] - b["ms"]) / dd["ms"], 3)
                rec(f"round{rnd}_overlap_prio{prio}", b)


if __name__ == "__main__":
    main()

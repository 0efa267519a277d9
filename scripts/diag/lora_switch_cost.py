"""Where the wall time of a LoRA strength change goes (the bench's ``strength_change/extra_ms``, issue 5: < 1 ms).

SDXL UNet fp16 on the GPU, random weights, a rank-32 LoRA on the 700 attention and feed-forward Linears
(``bench.suite_lora``'s file); two unmerged views of it, strengths 1.0 and 0.6. Medians (ms) of 40 synchronized
rounds each, after 4 warm-up rounds:
- ``switch``: a session alternating the two views (what the bench times: attach with the buffer rewrite, detach);
- ``same``: a session of one view again and again (attach without a rewrite, detach);
- ``engine``: a session of the engine without a LoRA;
- ``write``: ``write_strength`` alone, alternating 1.0 / 0.6 (since session 26: the flat buffer zeroed, then one
  ``_foreach_add_`` over the spans where buffers and the loader's packed sources lie back to back, ``spans`` of
  them); ``write_per_layer``: session 25's way, the same zero then one ``_foreach_add_`` over the 700
  (buffer, source) pairs; ``write_copy_mul``: the way before session 25, ``_foreach_copy_`` + ``_foreach_mul_`` over
  the 700 buffers;
- ``flat_mul``: one ``torch.mul(..., out=...)`` over a flat tensor of the buffers' total size (one pass);
- ``switch_host``: the alternating session without the final synchronize (the host's share);
and ``profile``: cProfile's top functions over 40 switches on this host.
Usage (device machine, pack importable as ``leandiffusion``): cd scripts/diag && python lora_switch_cost.py; writes
$OUT/lora_switch_cost.json. Budget: ~90 s on an H100.
"""
import cProfile
import io
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from diag_timing import Recorder
from leandiffusion.bench.models import full_unet
from leandiffusion.bench.suite_lora import _engine, _kohya_unet
from leandiffusion.lora import inject_lora

dev = torch.device("cuda")
rec = Recorder("lora_switch_cost.json")


def median_ms(fn, rounds=40, warm=4, sync=True):
    times = []
    for i in range(warm + rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(i)
        if sync:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    return round(statistics.median(times[warm:]), 4)


def main():
    unet = full_unet("sdxl", device=dev)
    engine = _engine(unet, dev, torch.float16)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "lora.safetensors"
        save_file(_kohya_unet(unet, 32, dev), str(path))
        views = [inject_lora(engine, path, 1.0, 0.0, mode="unmerged"),
                 inject_lora(engine, path, 0.6, 0.0, mode="unmerged")]
        binding = views[0].adapters[0].binding

        def session(view):
            with view.session("unet"):
                pass

        res = {"switch": median_ms(lambda i: session(views[i % 2])),
               "same": median_ms(lambda i: session(views[0])),
               "engine": median_ms(lambda i: session(engine)),
               "write": median_ms(lambda i: binding.write_strength("unet", (1.0, 0.6)[i % 2])),
               "switch_host": median_ms(lambda i: session(views[i % 2]), sync=False)}
        bufs, ups = binding._up_s["unet"], binding._up["unet"]
        res["spans"] = len(binding._rewrite["unet"][0])

        def per_layer(i):
            binding._arenas["unet"].zero_()
            torch._foreach_add_(bufs, ups, alpha=(1.0, 0.6)[i % 2])

        res["write_per_layer"] = median_ms(per_layer)

        def copy_mul(i):
            torch._foreach_copy_(bufs, ups)
            torch._foreach_mul_(bufs, (1.0, 0.6)[i % 2])

        res["write_copy_mul"] = median_ms(copy_mul)
        binding._written["unet"] = None  # the buffers were written behind its back
        total = sum(b.numel() for b in binding._up_s["unet"])
        src = torch.randn(total, device=dev, dtype=torch.float16)
        dst = torch.empty_like(src)
        res["flat_mul"] = median_ms(lambda i: torch.mul(src, (1.0, 0.6)[i % 2], out=dst))
        res["buffers"] = len(binding._up_s["unet"])
        res["buffer_mb"] = round(total * 2 / 2 ** 20, 1)
        rec("ms", res)
        prof = cProfile.Profile()
        prof.enable()
        for i in range(40):
            session(views[i % 2])
        torch.cuda.synchronize()
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(15)
        rec("profile", text.getvalue().splitlines()[:40])


if __name__ == "__main__":
    main()

"""Device bytes one per-channel ``var_mean`` allocates on a channels-last band (the tiled VAE's GroupStats.add):
the current form (``x.float()`` then ``var_mean`` over dims 0, 2, 3) against the band viewed as a [pixels, C]
matrix reduced over dim 0, for fp16 and fp32 SD-VAE-sized bands; and their time. Prints one line per variant."""
import time

import torch

for dtype in (torch.float16, torch.float32):
    for shape in ((1, 512, 256, 256), (1, 128, 256, 2048)):
        x = torch.randn(shape, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)
        variants = {
            "dims023": lambda: torch.var_mean(x.float(), dim=(0, 2, 3), correction=0),
            "matrix": lambda: torch.var_mean(x.permute(0, 2, 3, 1).reshape(-1, x.shape[1]).float(), dim=0,
                                             correction=0),
        }
        ref = None
        for name, fn in variants.items():
            fn()
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            for _ in range(5):
                v, m = fn()
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) / 5 * 1000
            extra = (torch.cuda.max_memory_allocated() - base) / x.numel()
            diff = 0.0 if ref is None else max((v - ref[0]).abs().max().item(), (m - ref[1]).abs().max().item())
            ref = ref or (v, m)
            print(f"{str(dtype)[6:]} {shape} {name}: {extra:.2f} bytes/element above the band, {ms:.2f} ms, "
                  f"diff {diff:.2e}", flush=True)

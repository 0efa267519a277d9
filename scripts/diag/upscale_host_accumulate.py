"""Host-side cost of accumulating one ESRGAN output tile (``upscale.runner``), the work the CPU does per tile while
the GPU runs the next one:
- ``addcmul_lowp``: session 23's way, ``out.addcmul_(tile, w)`` with the tile in the model's dtype (fp16/bf16) and
  fp32 seam weights (PyTorch widens the tile into a temporary first);
- ``add_lowp``: the way before session 23 (the tile weighted on the device in its dtype, then a plain add);
- ``add_fp32``: this code (session 24: weighted and widened on the GPU, the host adds fp32 to fp32).
Usage (any machine, CPU only): python scripts/diag/upscale_host_accumulate.py [threads]; prints ms per 1024x1024x3
tile, the mean of 20 calls after one warm-up.
"""
import sys
import time

import torch


def _ms(fn, n=20):
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e3


def main():
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else torch.get_num_threads())
    g = torch.Generator().manual_seed(0)
    out = torch.zeros(1024, 1024, 3)
    weight = torch.rand(1024, 1024, 1, generator=g)
    tile32 = torch.rand(1024, 1024, 3, generator=g)
    for dtype in (torch.float16, torch.bfloat16):
        tile = tile32.to(dtype)
        addcmul_lowp = _ms(lambda: out.addcmul_(tile, weight))
        print(f"{dtype} threads {torch.get_num_threads()}: addcmul_lowp {addcmul_lowp:.2f} ms, "
              f"add_lowp {_ms(lambda: out.add_(tile)):.2f} ms, add_fp32 {_ms(lambda: out.add_(tile32)):.2f} ms")


if __name__ == "__main__":
    main()

"""Device ceilings measured in the same run as the other suites: host->device copy (pinned vs pageable), the
device's own copy bandwidth and fp16 matrix throughput.

These are the two ceilings of the other suites: weight streaming cannot beat the pinned host->device rate (every
streamed byte crosses PCIe/NVLink-C2C once per step), and a UNet step cannot beat the matmul rate. Recording them
next to the suites' results makes a run on another card interpretable. Bandwidth counts bytes read plus bytes written for device copies, bytes moved for
host copies; matmul counts 2*M*N*K flops. No targets: these are facts about the machine, not claims.
"""
from __future__ import annotations

import torch

from .harness import time_ms

SUITE = "device"
SMOKE_BUDGET_S = 3
QUICK_BUDGET_S = 30  # often the first suite of a fresh machine: cold imports and CUDA start count here
FULL_BUDGET_S = 20


def pinned_host_to_device_gbps(dev: torch.device, nbytes: int, repeat: int) -> float:
    """Pinned host -> device copy rate of ``nbytes`` (fp16), GB/s: what weight streaming is bound by."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, pin_memory=dev.type == "cuda").normal_()
    dst = torch.empty(nbytes // 2, dtype=torch.float16, device=dev)
    return nbytes / time_ms(lambda: dst.copy_(src, non_blocking=True), warmup=2, repeat=repeat, device=dev) / 1e6


def run(ctx) -> None:
    dev = ctx.device
    gpu = dev.type == "cuda"
    nbytes = (512 << 20) if gpu else (4 << 20)
    n = nbytes // 2
    repeat = 10 if gpu else 2

    pinned = pinned_host_to_device_gbps(dev, nbytes, repeat)
    src_pinned = torch.empty(n, dtype=torch.float16, pin_memory=gpu).normal_()
    src_pageable = torch.empty(n, dtype=torch.float16).normal_()
    dst = torch.empty(n, dtype=torch.float16, device=dev)
    pageable = nbytes / time_ms(lambda: dst.copy_(src_pageable), warmup=1, repeat=repeat, device=dev) / 1e6
    ctx.record("host_to_device", "copy_gbps", pinned, pageable, "pageable", lower_is_better=False, unit="GB/s",
               notes=f"{nbytes >> 20} MiB fp16; ours = pinned source (what weight streaming uses)")
    ctx.record("device_to_host", "pinned_copy_gbps",
               nbytes / time_ms(lambda: src_pinned.copy_(dst, non_blocking=True), warmup=2, repeat=repeat,
                                device=dev) / 1e6, lower_is_better=False, unit="GB/s", notes="into pinned memory")
    del src_pageable

    other = torch.empty_like(dst)
    d2d_ms = time_ms(lambda: other.copy_(dst), warmup=2, repeat=repeat, device=dev)
    ctx.record("device_copy", "copy_gbps", 2 * nbytes / d2d_ms / 1e6, lower_is_better=False, unit="GB/s",
               notes="bytes read + bytes written")
    del other, dst, src_pinned

    size = 8192 if gpu else 256
    dtype = torch.float16 if gpu else torch.float32
    a = torch.randn(size, size, device=dev, dtype=dtype)
    b = torch.randn(size, size, device=dev, dtype=dtype)
    mm_ms = time_ms(lambda: a @ b, warmup=3, repeat=repeat, device=dev)
    ctx.record(f"matmul_{size}", "tflops", 2 * size**3 / mm_ms / 1e9, lower_is_better=False, unit="TFLOP/s",
               notes=f"{str(dtype).replace('torch.', '')} {size}^3, random inputs")

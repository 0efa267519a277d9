"""Probe (not part of the pack): a Linear's low-rank LoRA term added into its output in one Triton launch,
``out += round(x @ down.T) @ up.T``, for ``lora_linear_sweep.py``.

Math (``x`` [M, K] the Linear's input, ``down`` [r, K], ``up`` [N, r] = ``strength * up``, ``out`` [M, N] the base
output, written in place): ``h = round(x @ down.T)`` (fp32 accumulator), ``out = round(out + h @ up.T)`` (fp32),
operation by operation what the pack's hook computes with two cuBLAS GEMMs (``F.linear(x, down)``, then
``out.addmm_(h, up.T)``). A program owns BM rows: their ``h`` [BM, r] in registers (K loop), then its share of the
N columns (``split`` programs per row block), reading ``up`` and ``out`` once and writing ``out`` once.

The idea was that the LoRA's cost is the number of skinny GEMMs (session 18: 1180 of them, ~5 us each). Session 25
on an H100 (docs/bench/lora-linear-s25/): per call the best config of a 48 x 5 grid ties the two cuBLAS GEMMs
(8.7 vs 9.0 us at 2048 x 1280, 28.0 vs 29.4 us at 8192 x 2560 -> 640, but 19.1 vs 12.6 us at 2048 x 5120 ->
1280), 6.1 vs 6.0 ms weighted over the step's shapes; in the SDXL step it made things slower. So the pack keeps
the cuBLAS pair, and this file stays a probe.
"""
# No ``from __future__ import annotations``: see kernels/geglu_lora.py (the Triton 3.0-3.2 interpreter reads a
# ``tl.constexpr`` parameter's annotation evaluated).
import os
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

import triton
import triton.language as tl


class Config(NamedTuple):
    """One launch shape: rows per program, K and N chunk, programs per row block, warps, pipeline stages."""
    bm: int
    bk: int
    bn: int
    split: int
    warps: int = 4
    stages: int = 2


def _check(out: torch.Tensor, x: torch.Tensor, down: torch.Tensor, up: torch.Tensor) -> tuple[int, int, int, int]:
    """Validate; return (M, K, N, rank)."""
    if out.ndim != 2 or x.ndim != 2 or down.ndim != 2 or up.ndim != 2:
        raise ValueError(f"out, x, down and up must be 2-D ([M, N], [M, K], [r, K], [N, r]); got shapes "
                         f"{tuple(out.shape)}, {tuple(x.shape)}, {tuple(down.shape)}, {tuple(up.shape)}; "
                         f"reshape the activations to 2-D first")
    m, k = x.shape
    r = down.shape[0]
    n = out.shape[1]
    if out.shape[0] != m or down.shape[1] != k or up.shape != (n, r):
        raise ValueError(f"shapes do not chain: out {tuple(out.shape)}, x {tuple(x.shape)}, down "
                         f"{tuple(down.shape)}, up {tuple(up.shape)}; expected down [r, K] and up [N, r] for "
                         f"x [M, K] and out [M, N]")
    for name, t in (("x", x), ("down", down), ("up", up)):
        if t.device != out.device or t.dtype != out.dtype:
            raise ValueError(f"{name} is {t.dtype} on {t.device} but out is {out.dtype} on {out.device}; "
                             f"pass every tensor in one dtype on one device")
    return m, k, n, r


def lora_add_reference(out: torch.Tensor, x: torch.Tensor, down: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Plain torch, the unfused path: ``out.addmm_(F.linear(x, down), up.T)``; returns ``out``."""
    _check(out, x, down, up)
    return out.addmm_(F.linear(x, down), up.t())


if True:  # (indented as in the pack's kernel modules)

    @triton.jit
    def _lora_add_kernel(out_ptr, x_ptr, down_ptr, up_ptr, M, K, N, R, cols_per_prog,
                         s_om, s_on, s_xm, s_xk, s_dr, s_dk, s_un, s_ur,
                         IEEE: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
                         BR: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
        rr = tl.arange(0, BR)
        mm, mr = rm < M, rr < R
        acc = tl.zeros((BM, BR), dtype=tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            mk = rk < K
            xa = tl.load(x_ptr + rm[:, None] * s_xm + rk[None, :] * s_xk, mask=mm[:, None] & mk[None, :], other=0.0)
            dt = tl.load(down_ptr + rr[None, :] * s_dr + rk[:, None] * s_dk, mask=mk[:, None] & mr[None, :],
                         other=0.0)
            if IEEE:
                acc = tl.dot(xa.to(tl.float32), dt.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(xa, dt, acc)
        dtype = out_ptr.dtype.element_ty
        h = acc.to(dtype)  # rounded as F.linear(x, down) rounds it
        n_start = pid_n * cols_per_prog
        n_stop = tl.minimum(n_start + cols_per_prog, N)
        for n0 in range(n_start, n_stop, BN):
            rn = (n0 + tl.arange(0, BN)).to(tl.int64)
            mn = rn < n_stop
            ut = tl.load(up_ptr + rn[None, :] * s_un + rr[:, None] * s_ur, mask=mr[:, None] & mn[None, :],
                         other=0.0)
            if IEEE:
                d = tl.dot(h.to(tl.float32), ut.to(tl.float32), input_precision="ieee")
            else:
                d = tl.dot(h, ut)
            mask = mm[:, None] & mn[None, :]
            optr = out_ptr + rm[:, None] * s_om + rn[None, :] * s_on
            o = tl.load(optr, mask=mask, other=0.0)
            tl.store(optr, (o.to(tl.float32) + d).to(dtype), mask=mask)


def _interpreting() -> bool:
    """See ``kernels.geglu_lora._interpreting``: the interpreter's bf16 ``tl.dot`` is wrong, so it widens first."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def pick_config(m: int, k: int, n: int) -> Config:
    """The launch shape from session 25's sweep (its ``best`` configs on an H100): 32 rows, K and N chunks of 128,
    three stages; about 128 programs (``split`` column shares per row block when the rows alone give fewer)."""
    bm, bn = 32, 128
    row_blocks = -(-m // bm)
    split = max(1, min(128 // row_blocks, -(-n // bn)))
    return Config(bm=bm, bk=128, bn=bn, split=split, warps=4, stages=3)


def lora_add_triton(out: torch.Tensor, x: torch.Tensor, down: torch.Tensor, up: torch.Tensor,
                    config: Optional[Config] = None) -> torch.Tensor:
    """The Triton kernel (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``); any strides (``down`` may be
    a row slice of a shared down factor). Same contract as the reference; ``config`` overrides ``pick_config``."""
    m, k, n, r = _check(out, x, down, up)
    if out.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"lora_add_triton supports float16, bfloat16 and float32, got {out.dtype}; "
                         f"use lora_add_reference")
    if m == 0 or n == 0:
        return out
    cfg = config or pick_config(m, k, n)
    br = max(16, triton.next_power_of_2(r))
    cols = -(-n // cfg.split)
    cols = -(-cols // cfg.bn) * cfg.bn  # whole BN chunks per program
    grid = (triton.cdiv(m, cfg.bm), triton.cdiv(n, cols))
    _lora_add_kernel[grid](out, x, down, up, m, k, n, r, cols,
                           out.stride(0), out.stride(1), x.stride(0), x.stride(1), down.stride(0), down.stride(1),
                           up.stride(0), up.stride(1),
                           IEEE=out.dtype == torch.float32 or (out.dtype == torch.bfloat16 and _interpreting()),
                           BM=cfg.bm, BK=cfg.bk, BN=cfg.bn, BR=br, num_warps=cfg.warps, num_stages=cfg.stages)
    return out

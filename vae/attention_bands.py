"""The VAE's global self-attention under a device-memory budget, computed in bands of rows (the exact tiled
executor's attention stage, ``exact._run_attention``).

Invariant: ``run_banded`` hands ``sink`` bands that together equal ``attention.run_attention`` on the whole map, up
to floating-point error, for any band sizes: the block's GroupNorm uses the whole map's statistics (``GroupStats``
gathered by the stage before), every query attends to every key, and softmax rows are independent.

Schemes (``plan_bands`` picks one by its byte estimates, and for the online form by a rough step count):

- ``resident``: the keys and values of every pixel are computed band by band into two whole-map device tensors
  (``2 N C`` elements); then each band of queries attends to them and its output, residual included, goes to
  ``sink``. Attention through ``scaled_dot_product_attention`` (PyTorch's O(N)-memory kernels on CUDA), or
  (``online``, where ``prefers_online`` says so) through the online softmax below over chunks of the resident keys
  with TF32 matmuls: for an fp32 map on CUDA whose convolutions run in TF32, since PyTorch's fp32 attention kernels have
  no TF32 path (at 4096 px the SD VAE's mid block runs about four times faster online; the untiled decode takes TF32
  score matmuls for the same reason, ``attention.tf32_like_convolutions``), and for a large half-precision map, whose
  512-channel head only PyTorch's memory-efficient kernel takes (about twice as slow as the online form at 4096 px).
- ``streamed``: nothing of the map's size stays on the device. For each band of queries the keys and values are
  recomputed chunk by chunk from the input store. Device memory is one query band, one key chunk and one score
  block, whatever the image size; it pays the key/value projections once per query band.

Online softmax (Milakov and Gimelshein 2018, "Online normalizer calculation for softmax"), in fp32: running row
maximum ``m``, normaliser ``l`` and weighted sum ``acc``; per chunk ``s = q k^T / sqrt(d)``,
``m' = max(m, rowmax s)``, ``l = l e^(m - m') + rowsum e^(s - m')``, ``acc = acc e^(m - m') + e^(s - m') v``; the
output is ``acc / l``.

Why bands: run on the whole map, the block's five map-sized tensors (normalised input, q, k, v, output) would set a
floor under any budget (about 0.9 GiB at 2048 px and 3.0 GiB at 4096 px in fp32).

Precision of the online form: the score blocks and the weighted sums are fp32 tensors. Their matmuls run in TF32
when ``tf32`` is set: the caller sets it on CUDA for fp16 / bf16 maps (whose 8-11 significant bits TF32 keeps, as
the half-precision attention kernels' fp32-accumulating GEMMs do) and for fp32 maps whose convolutions already run
in TF32. The softmax scale is applied to the fp32 scores (the GEMM's ``alpha``), not to ``q``, so half-precision
queries and keys reach the TF32 matmul unrounded (``_online_attention``).

Why hand-written: PyTorch's public ``scaled_dot_product_attention`` returns no log-sum-exp, which merging key chunks
needs, and its fused kernels take the keys and values whole; no library bands a VAE's attention under a byte budget.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .. import bridge
from .attention import AttentionSpec, _sdpa, tf32_matmuls
from .stats import GroupStats, apply_group_norm, stats_transient_bytes
from .stores import BandThrottle

RESIDENT, STREAMED = "resident", "streamed"


@dataclass(frozen=True)
class BandPlan:
    scheme: str  # RESIDENT or STREAMED
    rows: int  # rows of the map per query band (and per key/value band or chunk)
    estimate: int  # device bytes at the peak, by the formulas below
    online: bool = False  # RESIDENT: attend with the online softmax over chunks of the resident keys


@dataclass(frozen=True)
class MapCost:
    """What one band of the attention's input map costs on the device."""

    channels: int
    height: int
    width: int
    eb: int  # bytes per element of the compute dtype
    in_eb: int  # bytes per element of the input store
    in_on_device: bool  # a band of the input is a view of a device store (no upload)
    heads: int = 1

    def band(self, rows: int) -> int:
        """Elements of a ``rows``-row band of the map."""
        return self.channels * rows * self.width

    def upload(self, rows: int) -> int:
        """Bytes of reading a band: nothing for a device store, else the uploaded copy (two: the next one is
        prefetched while this one computes), plus the cast to the compute dtype."""
        n = self.band(rows)
        cast = n * self.eb if self.in_eb != self.eb else 0
        return cast + (0 if self.in_on_device else 2 * n * self.in_eb)

    def output_side(self, rows: int) -> int:
        """Bytes of turning one band's attention output (fp32 ``acc`` of the online form) into the stage output:
        the output in the compute dtype, its projection, the residual sum (the output band and the copy a host store
        downloads once ``acc`` is gone) and what ``GroupStats.add`` allocates (``stats_transient_bytes``)."""
        n = self.band(rows)
        return self.upload(rows) + 4 * n + 3 * n * self.eb + stats_transient_bytes(n)


def small_tensors_bytes(cost: MapCost) -> int:
    """Per-group and per-channel vectors (the running statistics of the output, a GroupNorm's mean and variance, the
    softmax scale): a few KB, alive at the peak in numbers that follow Python's garbage collection (the CPU suite's
    meta count saw 768 B more in the full run than alone, at 512 channels). Counted in every estimate as 16 fp64
    vectors of the channel count (64 KiB at 512 channels)."""
    return 16 * 8 * cost.channels


def resident_bytes(cost: MapCost, rows: int, online: bool = False) -> int:
    """Peak device bytes of the ``resident`` scheme with bands of ``rows`` rows: the whole map's keys and values and
    one band read, then
    - attending through ``scaled_dot_product_attention``: at most four band tensors at once (normalised input,
      queries, attention output and the fp32 accumulator PyTorch's memory-efficient kernel keeps for
      half-precision outputs; or attention output, projection, residual sum and the copy a host store downloads),
      and what ``GroupStats.add`` allocates for the output's statistics;
    - ``online`` (chunks of the resident keys of ``rows`` rows): the normalised input and queries, fp32 scaled
      queries, ``acc`` and row vectors, an fp32 copy of a key or value chunk (the upcast of half precision, or a
      contiguous copy the score matmul may take: seen in the CPU suite's meta count), ``e^(s - m') v`` and one fp32
      score block per head; or the output side (``MapCost.output_side``), whichever is larger;
    plus ``small_tensors_bytes``."""
    n = cost.band(rows)
    keys_values = 2 * cost.channels * cost.height * cost.width * cost.eb
    if not online:
        return keys_values + cost.upload(rows) + 4 * n * cost.eb + (4 * n if cost.eb < 4 else 0) + \
            stats_transient_bytes(n) + small_tensors_bytes(cost)
    tokens = rows * cost.width
    query = cost.upload(rows) + 2 * n * cost.eb + 2 * n * 4 + _row_vectors(cost, tokens)
    chunk = 4 * n + 4 * n
    scores = cost.heads * tokens * tokens * 4
    return keys_values + max(query + chunk + scores, cost.output_side(rows)) + small_tensors_bytes(cost)


def _row_vectors(cost: MapCost, tokens: int) -> int:
    """The online softmax's per-query fp32 vectors alive at once (``m``, ``l``, ``m'``, the rescale factor)."""
    return 4 * cost.heads * tokens * 4


def streamed_bytes(cost: MapCost, rows: int) -> int:
    """Peak device bytes of the ``streamed`` scheme with query bands and key chunks of ``rows`` rows: the query
    band read, normalised and projected, with its fp32 scaled queries, ``acc`` and row vectors; the key chunk read,
    normalised and projected to keys and values, one fp32 copy of those (upcast, or a matmul's contiguous copy) and
    the fp32 ``e^(s - m') v``; one fp32 score block per head (``exp`` runs in place); or the output side
    (``MapCost.output_side``), whichever is larger; plus ``small_tensors_bytes``."""
    n = cost.band(rows)
    tokens = rows * cost.width
    query = cost.upload(rows) + 2 * n * cost.eb + 2 * n * 4 + _row_vectors(cost, tokens)
    chunk = cost.upload(rows) + 3 * n * cost.eb + 4 * n + 4 * n
    scores = cost.heads * tokens * tokens * 4
    return max(query + chunk + scores, cost.output_side(rows)) + small_tensors_bytes(cost)


def online_steps(cost: MapCost, rows: int, recompute: bool) -> float:
    """A rough time model of an online-softmax pass with bands and chunks of ``rows`` rows, in units of one
    chunk step's fixed cost (about a dozen kernel launches): the score arithmetic is the same for any band size,
    what differs is the number of steps, ``bands^2``, and the key/value projection passes over the whole map (one
    for ``resident``, one per query band for ``streamed``), counted as ``tokens * C^2 * bytes / 2^32`` steps (64
    for the SD VAE's fp32 map at 4096 px: ~7 ms of GroupNorm and projections against ~0.1 ms per step)."""
    bands = -(-cost.height // rows)
    projection = cost.height * cost.width * cost.channels ** 2 * cost.eb / 2 ** 32
    return bands * bands + (bands if recompute else 1) * projection


HALF_ONLINE_MIN_TOKENS = 1 << 16
FLASH_MAX_HEAD_DIM = 256  # PyTorch's flash and cuDNN attention kernels take heads up to this size


def prefers_online(cost: MapCost, cuda: bool, tf32_convolutions: bool) -> bool:
    """Whether the executor should plan with the online form (``plan_bands(online=True)``).

    - fp32 maps on CUDA whose convolutions run in TF32: always (PyTorch's fp32 attention kernels have no TF32 path).
    - fp16 / bf16 maps on CUDA with heads wider than ``FLASH_MAX_HEAD_DIM``: above ``HALF_ONLINE_MIN_TOKENS``
      pixels of the map. The SD VAE's 512-channel head is past the flash / cuDNN kernels' head-size limit, so SDPA
      runs its memory-efficient kernel, which loses to TF32 matmuls on large maps only (fp16, the block alone: SDPA is
      three times faster at 1024 px (16k pixels), even at 2048 px (64k), about twice as slow at 4096 px (256k) against
      resident keys, a quarter slower against streamed ones). Narrower heads (a multi-head VAE) keep SDPA, whose flash
      kernels take them and win by far (8 heads of 64 channels at 4096 px: over ten times faster than the online form,
      in less memory).
    - elsewhere (the CPU, strict fp32): never."""
    if not cuda:
        return False
    if cost.eb >= 4:
        return tf32_convolutions
    wide_heads = cost.channels // max(1, cost.heads) > FLASH_MAX_HEAD_DIM
    return wide_heads and cost.height * cost.width > HALF_ONLINE_MIN_TOKENS


def _largest_rows(fits: Callable[[int], bool], limit: int) -> int:
    """The largest ``rows`` in ``1..limit`` with ``fits(rows)`` (estimates grow with rows), or 0 if none."""
    if fits(limit):
        return limit
    lo, hi = 0, limit - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def plan_bands(cost: MapCost, budget: int, max_rows: Optional[int] = None, online: bool = False) -> BandPlan:
    """The bands for ``budget`` bytes. ``online=False`` (attention through PyTorch's kernels, whose time barely
    depends on the band height): ``resident`` with the largest bands that fit, else ``streamed``. ``online=True``
    (the resident keys attended in chunks with TF32 matmuls, where ``prefers_online`` says so): of ``resident`` and
    ``streamed``, each with its largest bands, the one ``online_steps`` rates faster. Nothing fits: ``streamed``
    with one-row bands (the smallest this scheme can do; an out-of-memory error is then the caller's, which halves
    the budget and retries). ``max_rows`` caps the band height (the user's tile size)."""
    limit = max(1, min(cost.height, max_rows or cost.height))
    resident = _largest_rows(lambda r: resident_bytes(cost, r, online) <= budget, limit)
    if resident and not online:
        return BandPlan(RESIDENT, resident, resident_bytes(cost, resident))
    streamed = max(1, _largest_rows(lambda r: streamed_bytes(cost, r) <= budget, limit))
    if resident and online_steps(cost, resident, False) <= online_steps(cost, streamed, True):
        return BandPlan(RESIDENT, resident, resident_bytes(cost, resident, True), online=True)
    return BandPlan(STREAMED, streamed, streamed_bytes(cost, streamed))


def _tokens(x: torch.Tensor) -> torch.Tensor:
    """[1, C, rows, W] -> [1, rows * W, C] (a view for a channels-last band)."""
    return x.flatten(2).transpose(1, 2)


def _heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[1, n, C] -> [1, heads, n, C / heads]."""
    return t.reshape(t.shape[0], t.shape[1], heads, -1).transpose(1, 2)


class _Reader:
    """Bands of the input map, normalised with the whole map's statistics (or, for a per-pixel norm, ``stats`` None,
    by the norm itself), in the compute dtype."""

    def __init__(self, prefetch: Callable, spec: AttentionSpec, stats: Optional[GroupStats], dtype: torch.dtype):
        self.prefetch, self.spec, self.stats, self.dtype = prefetch, spec, stats, dtype

    def bands(self, spans: list):
        """Yields ``(a, x, normalised tokens)`` per span ``(a, b)``, the next span's read started ahead."""
        norm = self.spec.norm
        pending = self.prefetch(*spans[0])
        for j, (a, _) in enumerate(spans):
            x = pending.wait()
            if j + 1 < len(spans):
                pending = self.prefetch(*spans[j + 1])
            x = x.to(self.dtype) if x.dtype != self.dtype else x
            normed = norm(x) if self.spec.pointwise_norm else \
                apply_group_norm(x, self.stats, norm.weight, norm.bias, norm.eps)
            yield a, x, _tokens(normed)


def _finish(spec: AttentionSpec, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """The block's output for band ``x`` [1, C, rows, W] from its attention output ``o`` [1, heads, n, d]."""
    b, _, rows, w = x.shape
    o = spec.out(o.transpose(1, 2).reshape(b, rows * w, -1))
    o = o.transpose(1, 2).reshape(b, -1, rows, w)
    return (x + o) / spec.rescale if spec.rescale != 1.0 else x + o


def _online_attention(q: torch.Tensor, chunks, tf32: bool) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v for ``q`` [1, h, n, d] against the ``(k, v)`` chunks ([1, h, u, d] each), merged
    with an online softmax in fp32 (module docstring); returns [1, h, n, d] fp32.

    The scale multiplies the fp32 scores in the GEMM's epilogue (``baddbmm``'s ``alpha``), never ``q``: a scaled
    fp16 / bf16 ``q`` no longer fits TF32's mantissa, and its rounding grows with the scores' size (with scores in
    the hundreds and a spread of ~10 per row, 10x the error of exact products: 1.6e-2 vs 1.5e-3 at outputs ~3,
    TF32 emulated on the CPU)."""
    scale = q.shape[-1] ** -0.5
    q = q.float()[0]  # [h, n, d]
    m = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    norm = torch.zeros_like(m)  # l in the module docstring
    acc = torch.zeros_like(q)
    unused = q.new_zeros(())  # baddbmm's ignored input (beta = 0)
    with tf32_matmuls() if tf32 and q.is_cuda else contextlib.nullcontext():
        for k, v in chunks:
            s = torch.baddbmm(unused, q, k.float()[0].transpose(-1, -2), beta=0.0, alpha=scale)
            m_new = torch.maximum(m, s.amax(dim=-1))
            s.sub_(m_new.unsqueeze(-1)).exp_()
            keep = torch.exp(m - m_new)
            norm.mul_(keep).add_(s.sum(dim=-1))
            acc.mul_(keep.unsqueeze(-1)).add_(torch.matmul(s, v.float()[0]))
            m = m_new
            del s
    return acc.div_(norm.unsqueeze(-1)).unsqueeze(0)


def run_banded(spec: AttentionSpec, prefetch: Callable, stats: Optional[GroupStats], shape: tuple,
               band_plan: BandPlan, sink: Callable[[int, torch.Tensor], None], dtype: torch.dtype,
               tf32: bool = False) -> None:
    """Run the attention block over the map read by ``prefetch(a, b)`` (a store's: ``.wait()`` gives rows
    ``[a, b)`` as [1, C, rows, W]) of ``shape`` (C, H, W), handing ``sink(a, y)`` each band's output in the compute
    ``dtype``. ``tf32``: the online form's matmul precision (module docstring). Interruptible between bands and,
    streamed, between key chunks."""
    _, h, w = shape
    spans = [(a, min(a + band_plan.rows, h)) for a in range(0, h, band_plan.rows)]
    reader = _Reader(prefetch, spec, stats, dtype)
    if band_plan.scheme == RESIDENT:
        keys = values = throttle = None
        for a, x, hs in reader.bands(spans):
            bridge.check_interrupted()
            k, v = spec.k(hs), spec.v(hs)
            if keys is None:
                keys = torch.empty((1, h * w, k.shape[-1]), dtype=k.dtype, device=k.device)
                values = torch.empty((1, h * w, v.shape[-1]), dtype=v.dtype, device=v.device)
                throttle = BandThrottle(k.device)
            keys[:, a * w:a * w + k.shape[1]].copy_(k)
            values[:, a * w:a * w + v.shape[1]].copy_(v)
            del x, hs, k, v
            throttle.band_issued()
        keys, values = _heads(keys, spec.heads), _heads(values, spec.heads)
        if band_plan.online:
            def attend(hs: torch.Tensor) -> torch.Tensor:
                chunks = ((keys[:, :, a * w:b * w], values[:, :, a * w:b * w]) for a, b in spans)
                return _online_attention(_heads(spec.q(hs), spec.heads), chunks, tf32).to(dtype)
        else:
            def attend(hs: torch.Tensor) -> torch.Tensor:
                return _sdpa(_heads(spec.q(hs), spec.heads), keys, values)
    else:
        def chunks():
            # each chunk is a read of the store: interruptible, and throttled like any band (its upload buffer)
            throttle = None
            for _, x_k, hs_k in reader.bands(spans):
                bridge.check_interrupted()
                throttle = throttle or BandThrottle(x_k.device)
                yield _heads(spec.k(hs_k), spec.heads), _heads(spec.v(hs_k), spec.heads)
                del x_k, hs_k
                throttle.band_issued()

        def attend(hs: torch.Tensor) -> torch.Tensor:
            return _online_attention(_heads(spec.q(hs), spec.heads), chunks(), tf32).to(dtype)

    throttle = None
    for a, x, hs in reader.bands(spans):
        bridge.check_interrupted()
        throttle = throttle or BandThrottle(x.device)
        o = attend(hs)
        del hs
        y = _finish(spec, x, o)
        del x, o
        sink(a, y)
        del y
        throttle.band_issued()

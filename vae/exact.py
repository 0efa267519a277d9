"""Exact tiled execution of a VAE ``Program``: every GroupNorm uses whole-image statistics.

Invariant: the result equals the untiled module's output up to floating-point error, for any band size.

Method. Stages run in order; each stage reads its input from a whole-image store and writes its output to a new
store (``stores.py``: on the device when it fits the activation budget, else in pinned host memory). A chain stage
is computed over full-width bands of rows; a band's input is its rows plus the halo the row algebra of
``program.py`` gives, so convolutions see real neighbours and the halo is cropped away. GroupNorm needs the
statistics of the whole image before any band can be normalised, so a stage with GroupNorms at op positions
``p1 < p2 < ...`` runs one *statistics pass* per ``p > 0`` (bands computed up to op ``p``, only their core rows
merged into ``GroupStats``; nothing stored) and then the *output pass* (all ops, plus the ResNet residual), which
also merges the statistics of its output for the next stage's first GroupNorm. A ResNet block therefore costs one
extra ``norm1 -> conv1`` recomputation instead of storing ``conv1``'s output: on a budget that is the cheaper side
(a 3x3 convolution at the largest resolution costs a few ms; parking its output costs two PCIe copies). An
upsampler whose output would not fit on the device is fused into the next block (recomputed from the half-size
input) for the same reason. Global attention (the mid block) cannot be tiled by rows: its keys and values are
computed band by band into two whole-map tensors (1/8 resolution), then each band of queries attends to all of them.

Why hand-written: diffusers' ``enable_tiling`` and ComfyUI's ``VAEDecodeTiled`` run the whole decoder per tile
with per-tile GroupNorm statistics and hide the resulting seams and tone shifts by blending; no library offers a
tiled decoder whose normalisation is exact.

Memory: device stores + one band's working set stay within ``budget_bytes``. A band's working set is counted tensor
by tensor as ``_forward`` allocates them (``band_bytes``: input upload, each op's input and output, residual,
shortcut, the float32 copies of the statistics and the head, and with side copy streams the previous band's upload
and download, which ``_BandWaits`` keeps to one band), in the compute dtype's element size: nothing is scaled from
a calibration in another dtype. The attention stage runs in query bands against whole-map keys and values
(``attention_band_bytes``); the planner keeps room for those two maps beside its stores. On CUDA the bands use
``KERNEL_HEADROOM`` of what the stores leave (library workspaces are not tensors). An out-of-memory error is handled
by the caller, which halves the band and retries. The output is written band by band to pinned host memory.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .. import bridge
from .attention import add_residual, attend, tokens
from .program import Op, Program, Stage, fuse
from .stats import GroupStats, apply_group_norm
from .stores import DeviceStore, HostStore, Streams

logger = logging.getLogger(__name__)


# Share of a stage's band budget the counted tensors (``band_bytes``) may take on CUDA; the rest is left to what the
# count leaves out: cuDNN / cuBLAS workspaces, the per-call channels-last copy of a convolution's weight, allocator
# rounding. A provisional value: scripts/diag/vae_budget_fp32.py measures each stage's peak against its count.
KERNEL_HEADROOM = 0.9
# Per-channel and per-group statistics vectors (GroupNorm's mean / variance / affine in float32 and float64) a band
# holds beside its activations: kilobytes, counted as one MiB.
SMALL_TENSORS = 2 ** 20


@dataclass(frozen=True)
class ExactConfig:
    device: torch.device
    dtype: torch.dtype
    budget_bytes: int  # activations on the device (stores + one band), excluding weights
    tile_px: int = 0  # if > 0: a band holds at most tile_px**2 image pixels' worth of rows
    work_floor: float = 0.3  # share of the budget kept for band work when placing stores
    # the budget is a hard limit on the device memory the process holds (the loader's ``stream`` policy): copies run
    # on the compute stream and cached blocks go back to the driver after each stage (see ``run_exact``)
    strict_budget: bool = False


@dataclass
class PlannedStage:
    stage: Stage
    in_shape: tuple  # (C, H, W)
    out_shape: tuple
    out_on_device: bool
    out_groups: Optional[int]  # groups of the next stage's first GroupNorm (statistics to gather), or None


def _elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _is_resampler(stage: Stage) -> bool:
    return stage.kind == "chain" and stage.residual_src is None and bool(stage.ops) and \
        stage.ops[0].kind in ("up2", "down2") and not any(op.kind == "gn" for op in stage.ops)


def plan(program: Program, in_shape: tuple, cfg: ExactConfig) -> list[PlannedStage]:
    """Place each stage's output store (device or host) and fuse resamplers whose output would go to the host."""
    eb = _elem(cfg.dtype)
    floor = cfg.work_floor * cfg.budget_bytes
    stages, out, i, shape, in_dev = program.stages, [], 0, tuple(in_shape), 0

    def fits_device(o, j):
        """Whether stage ``j``'s output ``o`` can stay on the device: with the input store, the band work floor
        and, beside an attention stage (``j`` or ``j + 1``), that attention's whole-map keys and values."""
        size = o[0] * o[1] * o[2] * eb
        kv = 2 * size if stages[j].kind == "attention" or (j + 1 < len(stages) and
                                                           stages[j + 1].kind == "attention") else 0
        return in_dev + size + kv + floor <= cfg.budget_bytes

    while i < len(stages):
        st = stages[i]
        last = i == len(stages) - 1
        o = st.shapes(*shape)[-1] if st.kind == "chain" else shape
        fits = not last and fits_device(o, i)
        if not last and not fits and _is_resampler(st) and stages[i + 1].kind == "chain":
            st = fuse(st, stages[i + 1])
            i += 1
            last = i == len(stages) - 1
            o = st.shapes(*shape)[-1]
            fits = not last and fits_device(o, i)
        out.append(PlannedStage(st, shape, o, fits, None))
        in_dev = o[0] * o[1] * o[2] * eb if fits else 0
        shape = o
        i += 1
    for a, b in zip(out, out[1:]):
        a.out_groups = b.stage.first_groups
    return out


def _regions(ops: list, heights: list, a: int, b: int) -> list:
    """need[k] = rows of the value after ops[:k] needed for rows [a, b) after all ``ops``."""
    need = [None] * (len(ops) + 1)
    need[-1] = (a, b)
    for k in range(len(ops) - 1, -1, -1):
        need[k] = ops[k].need(need[k + 1][0], need[k + 1][1], heights[k])
    return need


@dataclass(frozen=True)
class BandCost:
    """What one band's device memory depends on besides its rows (see ``band_bytes``)."""

    eb: int  # bytes per element of the compute dtype
    in_eb: int  # bytes per element of the input store
    in_on_device: bool  # the input band is a view of a device store (else an upload)
    out_eb: int = 0  # bytes per element sent to a host store by the output pass (0: stats pass or device store)
    head_channels: int = 0  # the last stage's head (fp32 0..1 image / latent) runs on the output band
    in_flight: bool = False  # side copy streams: the previous band's upload and download are still allocated


def _out_rows(op: Op, rows: int) -> int:
    """Rows of the tensor ``op`` produces from an input band of ``rows`` rows (before any halo is cropped)."""
    if op.kind == "up2":
        return 2 * rows
    if op.kind == "down2":
        return max(1, (rows + 1 - 3) // 2 + 1)  # the bottom zero row counted: an upper bound
    return rows


def band_bytes(stage: Stage, shapes: list, length: int, need: list, cost: BandCost) -> int:
    """Peak device bytes of one band of a pass over ``ops[:length]`` whose value regions are ``need``.

    The tensors ``_Pass.run`` / ``_forward`` hold, op by op: the input band (an upload unless it is a view of a
    device store, plus its compute-dtype copy), the value each op reads and the one it writes, a pad copy
    (``down2``) or a product (``affine``) beside them, the residual's source and its shortcut and sum; after the
    forward, the float32 copy ``GroupStats.add`` reduces (fp16/bf16) and the head's two float32 temporaries. With
    side copy streams (``cost.in_flight``) the previous band's upload and download stay allocated until those
    copies finish (``_Pass.run`` waits for both before it allocates the next band). Statistics vectors count as
    ``SMALL_TENSORS``. Kernel workspaces (cuDNN, cuBLAS) are not tensors and are not counted here.
    """
    ops = stage.ops[:length]
    final = length == len(stage.ops)
    src = stage.residual_src if final else None
    eb = cost.eb
    rows = [b - a for a, b in need]
    e = [shapes[k][0] * rows[k] * shapes[k][2] for k in range(length + 1)]
    pinned = (0 if cost.in_on_device else e[0] * cost.in_eb) + (e[0] * eb if cost.in_eb != eb else 0)
    cur, saved, peak = 0, 0, pinned
    for k, op in enumerate(ops):
        if k == src:
            saved, cur = cur, 0
        if op.kind == "silu" and k != src and k > 0:
            continue  # in place
        out = shapes[k + 1][0] * _out_rows(op, rows[k]) * shapes[k + 1][2] * eb
        temp = 0
        if op.kind == "down2":
            temp = shapes[k][0] * (rows[k] + 1) * (shapes[k][2] + 1) * eb
        elif op.kind == "affine":
            temp = e[k] * eb
        peak = max(peak, pinned + saved + cur + temp + out)
        cur = out
    if src is not None:
        short = e[-1] * eb if stage.shortcut is not None else 0
        total = e[-1] * eb * (2 if stage.output_scale != 1.0 else 1)
        peak = max(peak, pinned + saved + cur + short + total)
        cur = e[-1] * eb
    stats = 4 * e[-1] if eb < 4 else 0  # GroupStats.add reduces a float32 copy
    head = 8 * e[-1] // max(1, shapes[length][0]) * cost.head_channels if cost.head_channels else 0
    peak = max(peak, pinned + cur + stats, pinned + cur + head)
    peak += SMALL_TENSORS
    if cost.in_flight:
        prev_in = 0 if cost.in_on_device else e[0] * cost.in_eb
        prev_out = e[-1] // max(1, shapes[length][0]) * cost.head_channels * 4 if cost.head_channels \
            else e[-1] * cost.out_eb
        peak += prev_in + prev_out
    return peak


def _estimate(stage: Stage, shapes: list, length: int, rows: int, cost: BandCost) -> int:
    """Peak device bytes of the worst band of ``rows`` output rows: one in the middle of the image (full halos),
    at an even and an odd first row (an upsampler's halo depends on the parity)."""
    heights = [s[1] for s in shapes]
    h = heights[length]
    worst = 0
    for a in {max(0, (h - rows) // 2), max(0, min(h - rows, (h - rows) // 2 + 1))}:
        need = _regions(stage.ops[:length], heights, a, min(h, a + rows))
        worst = max(worst, band_bytes(stage, shapes, length, need, cost))
    return worst


def _band_rows(stage: Stage, shapes: list, length: int, budget: int, cap_frac: float, cost: BandCost) -> int:
    h = shapes[length][1]
    hi = h if cap_frac >= 1.0 else max(1, min(h, int(cap_frac * h)))
    if _estimate(stage, shapes, length, hi, cost) <= budget:
        return hi
    lo = 1
    while lo < hi:  # largest rows with estimate <= budget (at least 1)
        mid = (lo + hi + 1) // 2
        if _estimate(stage, shapes, length, mid, cost) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


class _Pass:
    """One sweep of bands over ``ops[:length]`` of a chain stage."""

    def __init__(self, ps: PlannedStage, length: int, norms: dict, cfg: ExactConfig, work_budget: int,
                 out_hw: tuple, cost: BandCost, streams: Optional[Streams] = None):
        self.ps, self.stage, self.length, self.norms, self.cfg = ps, ps.stage, length, norms, cfg
        self.streams = streams
        self.shapes = ps.stage.shapes(*ps.in_shape)
        self.heights = [s[1] for s in self.shapes]
        h_l = self.shapes[length][1]
        cap = 1.0 if cfg.tile_px <= 0 else (cfg.tile_px ** 2) / float(out_hw[0] * out_hw[1])
        self.cost = cost
        self.rows = _band_rows(self.stage, self.shapes, length, work_budget, cap, cost)
        self.bands = [(a, min(a + self.rows, h_l)) for a in range(0, h_l, self.rows)]

    def run(self, store, sink: Callable[[int, torch.Tensor], None]) -> None:
        ops, final = self.stage.ops[:self.length], self.length == len(self.stage.ops)
        plans = [_regions(ops, self.heights, a, b) for a, b in self.bands]
        waits = _BandWaits(self.cfg.device, self.streams)
        pending = store.prefetch(*plans[0][0])
        for j, need in enumerate(plans):
            bridge.check_interrupted()
            x = pending.wait()
            if x.dtype != self.cfg.dtype:
                x = x.to(self.cfg.dtype)
            y = self._forward(x, need, ops, final)
            sink(need[-1][0], y)
            del x, y
            waits.band_issued()
            if j + 1 < len(plans):
                pending = store.prefetch(*plans[j + 1][0])

    def _forward(self, x: torch.Tensor, need: list, ops: list, final: bool) -> torch.Tensor:
        st = self.stage
        src = st.residual_src if final else None
        lo, saved = need[0][0], None
        for k, op in enumerate(ops):
            if k == src:
                saved = (x, lo)
            if op.kind == "silu" and k != src and k > 0:
                x = torch.nn.functional.silu(x, inplace=True)
            else:
                x, lo = op.forward(x, lo, self.heights[k], norm=self.norms.get(k))
            a, b = need[k + 1]
            if a < lo or b > lo + x.shape[2]:
                raise RuntimeError(f"tiling bug: op {k} ({op.kind}) of {st.name} produced rows "
                                   f"[{lo}, {lo + x.shape[2]}) but [{a}, {b}) are needed")
            if a != lo or b != lo + x.shape[2]:
                x = x.narrow(2, a - lo, b - a)
            lo = a
        if saved is not None:
            r, rlo = saved
            r = r.narrow(2, lo - rlo, x.shape[2])
            if st.shortcut is not None:
                r = st.shortcut(r)
            x = x + r
            if st.output_scale != 1.0:
                x = x / st.output_scale
        return x


class _BandWaits:
    """Keeps at most one earlier band in flight on CUDA (``band_bytes`` counts it): after band j is issued, the host
    waits until band j-1's compute and its download (side stream) have finished, so it cannot run ahead and
    allocate further bands' buffers while earlier ones are still held by their copies."""

    def __init__(self, device: torch.device, streams: Optional[Streams]):
        self.cuda = device.type == "cuda"
        self.streams = streams
        self.pending: list = []

    def band_issued(self) -> None:
        if not self.cuda:
            return
        events = [torch.cuda.Event()]
        events[0].record()
        down = getattr(self.streams, "download", None)
        if down is not None and down != torch.cuda.current_stream(self.streams.device):
            events.append(torch.cuda.Event())
            events[1].record(down)
        self.pending.append(events)
        if len(self.pending) > 1:
            for ev in self.pending.pop(0):
                ev.synchronize()


def _norm_fn(op: Op, stats: GroupStats) -> Callable:
    m = op.module
    return lambda x: apply_group_norm(x, stats, m.weight, m.bias, m.eps)


def _cost(cfg: ExactConfig, store, out_store, streams: Streams, head_channels: int = 0) -> BandCost:
    """The ``BandCost`` of an output pass from ``store`` to ``out_store`` (``dataclasses.replace`` it for a
    statistics pass: nothing is sent to a store)."""
    side = streams.cuda and streams.upload != streams.download
    out_eb = 0 if out_store.on_device else _elem(out_store.data.dtype)
    return BandCost(_elem(cfg.dtype), _elem(store.data.dtype), store.on_device, out_eb, head_channels, side)


def _run_chain(ps: PlannedStage, store, out_store, in_stats: Optional[GroupStats], cfg: ExactConfig,
               work_budget: int, out_hw: tuple, head: Optional[Callable], streams: Streams,
               head_channels: int = 0) -> Optional[GroupStats]:
    ops = ps.stage.ops
    norms = {}
    cost = _cost(cfg, store, out_store, streams, head_channels if head is not None else 0)
    stats_cost = dataclasses.replace(cost, out_eb=0, head_channels=0)
    for k, op in enumerate(ops):
        if op.kind != "gn":
            continue
        if k == 0:
            if in_stats is None:
                raise RuntimeError(f"tiling bug: no input statistics for {ps.stage.name}")
            norms[0] = _norm_fn(op, in_stats)
            continue
        acc = GroupStats(int(op.module.num_groups))
        _Pass(ps, k, norms, cfg, work_budget, out_hw, stats_cost, streams).run(
            store, lambda a, y, acc=acc: acc.add(y))
        norms[k] = _norm_fn(op, acc)
    out_stats = GroupStats(ps.out_groups) if ps.out_groups else None

    def sink(a: int, y: torch.Tensor) -> None:
        if out_stats is not None:
            out_stats.add(y)
        out_store.put(a, head(y) if head is not None else y)

    _Pass(ps, len(ops), norms, cfg, work_budget, out_hw, cost, streams).run(store, sink)
    return out_stats


def attention_band_bytes(c: int, width: int, height: int, rows: int, cost: BandCost) -> int:
    """Peak device bytes of the attention stage with query bands of ``rows`` rows (``_run_attention``): the keys and
    values of the whole map, the input band (an upload unless a view of a device store), then at most three band
    tensors at once (normalised input, queries, attention output, projection, sum), the float32 accumulator the
    memory-efficient kernel keeps for fp16/bf16 outputs with head sizes over 128 and the float32 copy that
    ``GroupStats.add`` reduces; with side copy streams the previous band's upload and download."""
    eb, band = cost.eb, c * rows * width
    peak = 2 * c * height * width * eb
    peak += 0 if cost.in_on_device else band * cost.in_eb
    peak += band * eb if cost.in_eb != eb else 0
    peak += 3 * band * eb + (4 * band if eb < 4 else 0) + SMALL_TENSORS
    if cost.in_flight:
        peak += (0 if cost.in_on_device else band * cost.in_eb) + band * cost.out_eb
    return peak


def _attention_rows(c: int, h: int, w: int, budget: int, cost: BandCost) -> int:
    rows = h
    while rows > 1 and attention_band_bytes(c, w, h, rows, cost) > budget:
        rows = (rows + 1) // 2
    return rows


def _run_attention(ps: PlannedStage, store, out_store, in_stats: Optional[GroupStats], cfg: ExactConfig,
                   work_budget: int, streams: Streams) -> Optional[GroupStats]:
    """The attention block in query bands: its GroupNorm with the whole map's statistics (gathered by the stage
    before), the keys and values of every pixel computed band by band into two whole-map tensors, then each band's
    queries attend to all of them (O(N) memory kernels on CUDA) and its output goes to ``out_store``. Exact: softmax
    rows are independent. ``attention_band_bytes`` sizes the bands to ``work_budget``."""
    if in_stats is None:
        raise RuntimeError(f"tiling bug: no input statistics for {ps.stage.name}")
    spec = ps.stage.attention
    c, h, w = ps.in_shape
    cost = _cost(cfg, store, out_store, streams)
    rows = _attention_rows(c, h, w, work_budget, cost)
    bands = [(a, min(a + rows, h)) for a in range(0, h, rows)]
    norm = spec.norm

    def normed(a: int, b: int):
        x = store.prefetch(a, b).wait()
        x = x.to(cfg.dtype) if x.dtype != cfg.dtype else x
        return x, tokens(apply_group_norm(x, in_stats, norm.weight, norm.bias, norm.eps))

    keys = values = None
    waits = _BandWaits(cfg.device, streams)
    for a, b in bands:
        bridge.check_interrupted()
        x, hs = normed(a, b)
        k, v = spec.k(hs), spec.v(hs)
        if keys is None:
            keys = torch.empty((1, h * w, k.shape[-1]), dtype=k.dtype, device=k.device)
            values = torch.empty((1, h * w, v.shape[-1]), dtype=v.dtype, device=v.device)
        keys[:, a * w:b * w].copy_(k)
        values[:, a * w:b * w].copy_(v)
        del x, hs, k, v
        waits.band_issued()
    out_stats = GroupStats(ps.out_groups) if ps.out_groups else None
    waits = _BandWaits(cfg.device, streams)
    for a, b in bands:
        bridge.check_interrupted()
        x, hs = normed(a, b)
        o = attend(spec, hs, keys, values)
        del hs
        y = add_residual(spec, x, o)
        del x, o
        if out_stats is not None:
            out_stats.add(y)
        out_store.put(a, y)
        del y
        waits.band_issued()
    return out_stats


def run_exact(program: Program, sample_hwc: torch.Tensor, cfg: ExactConfig, head: Callable, head_channels: int,
              progress: Optional[Callable[[], None]] = None) -> torch.Tensor:
    """Run ``program`` on one sample ``[H, W, C]`` (host tensor); returns the head's output ``[H', W', C']`` (host).

    ``head`` maps the last stage's output band (compute dtype) to the result (e.g. to a 0..1 image in fp32).
    """
    streams = Streams(cfg.device, side=not cfg.strict_budget)
    h, w, c = sample_hwc.shape
    data = sample_hwc
    if streams.cuda and not data.is_pinned():
        data = data.pin_memory()
    store = HostStore(h, w, c, data.dtype, cfg.device, streams, data=data)
    planned = plan(program, (c, h, w), cfg)
    out_hw = tuple(planned[-1].out_shape[1:])
    if h * w > out_hw[0] * out_hw[1]:
        out_hw = (h, w)  # an encoder: tile sizes are in image pixels, i.e. the input's
    stats: Optional[GroupStats] = None
    first_gn = planned[0].stage.first_groups
    if first_gn:  # a program that starts with a GroupNorm needs its input's statistics
        stats = GroupStats(first_gn)
        stats.add(store.prefetch(0, h).wait().to(cfg.dtype))
    for idx, ps in enumerate(planned):
        last = idx == len(planned) - 1
        oc, oh, ow = ps.out_shape
        if last:
            out_store = HostStore(oh, ow, head_channels, torch.float32, cfg.device, streams)
        elif ps.out_on_device:
            out_store = DeviceStore(oh, ow, oc, cfg.dtype, cfg.device, streams)
        else:
            out_store = HostStore(oh, ow, oc, cfg.dtype, cfg.device, streams)
        work = cfg.budget_bytes - getattr(store, "nbytes", 0) - out_store.nbytes
        if streams.cuda:
            work = int(work * KERNEL_HEADROOM)
        logger.debug("stage %s in=%s out=%s on_device=%s work=%.0f MB", ps.stage.name, ps.in_shape, ps.out_shape,
                     ps.out_on_device, work / 2**20)
        if ps.stage.kind == "attention":
            stats = _run_attention(ps, store, out_store, stats, cfg, max(work, 0), streams)
        else:
            stats = _run_chain(ps, store, out_store, stats, cfg, max(work, 0), out_hw,
                               head if last else None, streams, head_channels)
        out_store.finish()
        del store
        store = out_store
        if cfg.strict_budget and streams.cuda:
            # the stages' bands differ in size: blocks cached for one stage's sizes would sit beside the next
            # stage's new ones, and under a hard budget the memory held, not just the memory in use, must fit
            torch.cuda.empty_cache()
        if progress is not None:
            progress()
    return store.host_tensor()

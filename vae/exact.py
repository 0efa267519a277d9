"""Exact tiled execution of a VAE ``Program``: every GroupNorm uses whole-image statistics.

Invariant: the result equals the untiled module's output up to floating-point error, for any band size. With
``ExactConfig.estimate_inner_stats`` (``blend`` mode) the statistics passes for the GroupNorms that follow a
convolution inside a stage are replaced by a cheaper estimating pass (``estimated_stats``): exact group means,
variances from a subset of the columns; everything else is as below.

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
input) for the same reason. Global attention (the mid block) cannot be cut into independent bands; it runs in
query bands against keys of the whole map under the same budget (``attention_bands``), with the statistics of
its GroupNorm gathered by the stage before.

Why hand-written: diffusers' ``enable_tiling`` and ComfyUI's ``VAEDecodeTiled`` run the whole decoder per tile
with per-tile GroupNorm statistics and hide the resulting seams and tone shifts by blending; no library offers a
tiled decoder whose normalisation is exact.

Memory: device stores + one band's working set stay within ``budget_bytes`` (estimated per pass; an
out-of-memory error is handled by the caller, which halves the band and retries). The output is written band by
band to pinned host memory.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .. import bridge
from .attention import convolutions_use_tf32
from .attention_bands import MapCost, plan_bands, prefers_online, run_banded
from .estimated_stats import ESTIMATED_AFTER, ColumnSampledConv, column_stride
from .program import Op, Program, Stage, fuse
from .stats import GroupStats, apply_group_norm
from .stores import BandThrottle, DeviceStore, HostStore, Streams

logger = logging.getLogger(__name__)

# Share of what the stores leave that a CUDA band's estimate may fill. The convolutions allocate beyond the
# estimate (cuDNN's implicit-GEMM workspaces and layout copies, proportional to the band): with the whole remainder
# a 2048 px exact decode overran its activation budget by up to ~18% in fp32 (~9% in fp16), worst in the stages that
# fuse an upsampler into the next resnet, and 0.8 still overran it; at 0.7 every case whose budget is above the
# mid-block attention's floor stays within it, decode and encode, at the same speed. The mid-block attention runs in
# bands under the same share (``attention_bands``).
CUDA_WORK_SHARE = 0.7


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
    # ``blend`` mode: the GroupNorms that follow a convolution inside a stage (each ResNet block's norm2) take
    # estimated statistics from one cheaper pass (``estimated_stats``) instead of an exact statistics pass
    estimate_inner_stats: bool = False


@dataclass
class PlannedStage:
    stage: Stage
    in_shape: tuple  # (C, H, W)
    out_shape: tuple
    out_on_device: bool
    out_groups: Optional[int]  # groups of the next stage's first GroupNorm (statistics to gather), or None
    covers: int = 1  # stages of the program it runs (2: a resampler fused into the next block); progress units


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

    share = CUDA_WORK_SHARE if cfg.device.type == "cuda" else 1.0

    def fits_device(o: tuple, j: int) -> bool:
        """Whether stage ``j``'s output ``o`` stays on the device: beside the input store and the band work floor;
        when ``j`` is an attention stage or feeds one, the attention's work (``share`` of what the stores leave,
        ``run_exact``) must also hold its whole-map keys and values (``attention_bands``' resident scheme: a host
        store costs two copies of the 1/8-resolution map, the streamed scheme a projection pass per band) if they
        fit the budget at all."""
        size = o[0] * o[1] * o[2] * eb
        beside_attention = stages[j].kind == "attention" or (j + 1 < len(stages) and
                                                             stages[j + 1].kind == "attention")
        room = floor
        if beside_attention and (2 * size + floor) / share <= cfg.budget_bytes:
            room = (2 * size + floor) / share
        return in_dev + size + room <= cfg.budget_bytes

    while i < len(stages):
        st, covers = stages[i], 1
        last = i == len(stages) - 1
        o = st.shapes(*shape)[-1] if st.kind == "chain" else shape
        fits = not last and fits_device(o, i)
        if not last and not fits and _is_resampler(st) and stages[i + 1].kind == "chain":
            st, covers = fuse(st, stages[i + 1]), 2
            i += 1
            last = i == len(stages) - 1
            o = st.shapes(*shape)[-1]
            fits = not last and fits_device(o, i)
        out.append(PlannedStage(st, shape, o, fits, None, covers))
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


def _estimate(stage: Stage, shapes: list, length: int, rows: int, eb: int, in_eb: int) -> int:
    """Rough peak device bytes of one band of ``rows`` output rows of a pass over ``ops[:length]``."""
    heights = [s[1] for s in shapes]
    h = heights[length]
    a = max(0, (h - rows) // 2)
    need = _regions(stage.ops[:length], heights, a, min(h, a + rows))
    elems = [shapes[k][0] * (need[k][1] - need[k][0]) * shapes[k][2] for k in range(length + 1)]
    src = elems[stage.residual_src] if stage.residual_src is not None and length == len(stage.ops) else 0
    return eb * (3 * max(elems) + src) + 4 * elems[-1] + 2 * elems[0] * in_eb


def _band_rows(stage: Stage, shapes: list, length: int, budget: int, cap_frac: float, eb: int, in_eb: int) -> int:
    h = shapes[length][1]
    hi = h if cap_frac >= 1.0 else max(1, min(h, int(cap_frac * h)))
    if _estimate(stage, shapes, length, hi, eb, in_eb) <= budget:
        return hi
    lo = 1
    while lo < hi:  # largest rows with estimate <= budget (at least 1)
        mid = (lo + hi + 1) // 2
        if _estimate(stage, shapes, length, mid, eb, in_eb) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


class _Pass:
    """One sweep of bands over ``ops[:length]`` of a chain stage."""

    def __init__(self, ps: PlannedStage, length: int, norms: dict, cfg: ExactConfig, work_budget: int,
                 out_hw: tuple, in_dtype: torch.dtype):
        self.ps, self.stage, self.length, self.norms, self.cfg = ps, ps.stage, length, norms, cfg
        self.shapes = ps.stage.shapes(*ps.in_shape)
        self.heights = [s[1] for s in self.shapes]
        h_l = self.shapes[length][1]
        cap = 1.0 if cfg.tile_px <= 0 else (cfg.tile_px ** 2) / float(out_hw[0] * out_hw[1])
        self.rows = _band_rows(self.stage, self.shapes, length, work_budget, cap, _elem(cfg.dtype),
                               _elem(in_dtype))
        self.bands = [(a, min(a + self.rows, h_l)) for a in range(0, h_l, self.rows)]

    def run(self, store, sink: Callable[[int, torch.Tensor], None]) -> None:
        ops, final = self.stage.ops[:self.length], self.length == len(self.stage.ops)
        plans = [_regions(ops, self.heights, a, b) for a, b in self.bands]
        throttle = BandThrottle(self.cfg.device)
        pending = store.prefetch(*plans[0][0])
        for j, need in enumerate(plans):
            bridge.check_interrupted()
            x = pending.wait()
            if x.dtype != self.cfg.dtype:
                x = x.to(self.cfg.dtype)
            y = self._forward(x, need, ops, final)
            sink(need[-1][0], y)
            del x, y
            throttle.band_issued()
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


def _norm_fn(op: Op, stats: GroupStats) -> Callable:
    m = op.module
    return lambda x: apply_group_norm(x, stats, m.weight, m.bias, m.eps)


def _run_chain(ps: PlannedStage, store, out_store, in_stats: Optional[GroupStats], cfg: ExactConfig,
               work_budget: int, out_hw: tuple, head: Optional[Callable],
               chunk_out_stats: bool = False) -> Optional[GroupStats]:
    """One chain stage; ``chunk_out_stats``: gather its output's statistics in bounded chunks (``GroupStats.add``;
    the stage before an attention, whose statistics gathering CUDA_WORK_SHARE is not calibrated with: a whole-map
    band's one ``var_mean`` takes 0.64 GiB at 2048 px in fp16)."""
    ops = ps.stage.ops
    norms = {}
    in_dtype = store.data.dtype
    for k, op in enumerate(ops):
        if op.kind != "gn":
            continue
        if k == 0:
            if in_stats is None:
                raise RuntimeError(f"tiling bug: no input statistics for {ps.stage.name}")
            norms[0] = _norm_fn(op, in_stats)
            continue
        if cfg.estimate_inner_stats and ops[k - 1].kind in ESTIMATED_AFTER:
            norms[k] = _norm_fn(op, _estimated_stats(ps, k, norms, cfg, work_budget, out_hw, in_dtype, store))
            continue
        acc = GroupStats(int(op.module.num_groups))
        _Pass(ps, k, norms, cfg, work_budget, out_hw, in_dtype).run(store, lambda a, y, acc=acc: acc.add(y))
        norms[k] = _norm_fn(op, acc)
    out_stats = GroupStats(ps.out_groups) if ps.out_groups else None

    def sink(a: int, y: torch.Tensor) -> None:
        if out_stats is not None:
            out_stats.add(y, chunked=chunk_out_stats)
        out_store.put(a, head(y) if head is not None else y)

    _Pass(ps, len(ops), norms, cfg, work_budget, out_hw, in_dtype).run(store, sink)
    return out_stats


def _estimated_stats(ps: PlannedStage, k: int, norms: dict, cfg: ExactConfig, work_budget: int, out_hw: tuple,
                     in_dtype: torch.dtype, store) -> GroupStats:
    """``blend``: the statistics of the GroupNorm at op ``k`` (after a convolution) from one pass over ``ops[:k]``
    whose convolution runs at a subset of the columns and keeps the sums that give the exact means
    (``estimated_stats``)."""
    shapes = ps.stage.shapes(*ps.in_shape)
    _, h, w = shapes[k - 1]
    groups = int(ps.stage.ops[k].module.num_groups)
    sampler = ColumnSampledConv(ps.stage.ops[k - 1], h, w, column_stride(shapes[k][0], groups, h, w))
    ops = list(ps.stage.ops)
    ops[k - 1] = sampler
    sampled = dataclasses.replace(ps, stage=dataclasses.replace(ps.stage, ops=ops))
    samples = GroupStats(groups)
    _Pass(sampled, k, norms, cfg, work_budget, out_hw, in_dtype).run(store, lambda a, y: samples.add(y))
    return sampler.estimate(samples)


def _run_attention(ps: PlannedStage, store, out_store, in_stats: Optional[GroupStats], cfg: ExactConfig,
                   work_budget: int, out_hw: tuple) -> Optional[GroupStats]:
    """The attention block in bands of rows under ``work_budget`` (``attention_bands``), its GroupNorm with the
    statistics the stage before gathered (none for a per-pixel norm)."""
    if in_stats is None and not ps.stage.attention.pointwise_norm:
        raise RuntimeError(f"tiling bug: no input statistics for {ps.stage.name}")
    c, h, w = ps.in_shape
    max_rows = None
    if cfg.tile_px > 0:  # a band holds at most tile_px**2 image pixels' worth of rows, as in the chain stages
        max_rows = max(1, int(h * (cfg.tile_px ** 2) / float(out_hw[0] * out_hw[1])))
    cost = MapCost(c, h, w, _elem(cfg.dtype), store.data.element_size(), store.on_device,
                   int(ps.stage.attention.heads))
    half = cfg.dtype in (torch.float16, torch.bfloat16)
    cuda = cfg.device.type == "cuda"
    band_plan = plan_bands(cost, work_budget, max_rows, online=prefers_online(cost, cuda, convolutions_use_tf32()))
    logger.debug("attention %s: %s bands of %d rows, estimate %.0f MB", ps.stage.name, band_plan.scheme,
                 band_plan.rows, band_plan.estimate / 2**20)
    out_stats = GroupStats(ps.out_groups) if ps.out_groups else None

    def sink(a: int, y: torch.Tensor) -> None:
        if out_stats is not None:
            out_stats.add(y, chunked=True)  # bands here can span the whole map (stats_transient_bytes)
        out_store.put(a, y)

    tf32 = cuda and (half or convolutions_use_tf32())  # the online form's matmuls (attention_bands docstring)
    run_banded(ps.stage.attention, store.prefetch, in_stats, ps.in_shape, band_plan, sink, cfg.dtype, tf32)
    return out_stats


def run_exact(program: Program, sample_hwc: torch.Tensor, cfg: ExactConfig, head: Callable, head_channels: int,
              progress: Optional[Callable[[], None]] = None) -> torch.Tensor:
    """Run ``program`` on one sample ``[H, W, C]`` (host tensor); returns the head's output ``[H', W', C']`` (host).

    ``head`` maps the last stage's output band (compute dtype) to the result (e.g. to a 0..1 image in fp32).
    ``progress`` is called once per stage of ``program`` (twice after a fused resampler and block), so a caller
    can count ``len(program.stages)`` units per sample whatever the plan.
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
        if cfg.device.type == "cuda":
            work = int(CUDA_WORK_SHARE * work)
        logger.debug("stage %s in=%s out=%s on_device=%s work=%.0f MB", ps.stage.name, ps.in_shape, ps.out_shape,
                     ps.out_on_device, work / 2**20)
        if ps.stage.kind == "attention":
            stats = _run_attention(ps, store, out_store, stats, cfg, max(work, 0), out_hw)
        else:
            feeds_attention = not last and planned[idx + 1].stage.kind == "attention"
            stats = _run_chain(ps, store, out_store, stats, cfg, max(work, 0), out_hw,
                               head if last else None, chunk_out_stats=feeds_attention)
        out_store.finish()
        del store
        store = out_store
        if cfg.strict_budget and streams.cuda:
            # the stages' bands differ in size: blocks cached for one stage's sizes would sit beside the next
            # stage's new ones, and under a hard budget the memory held, not just the memory in use, must fit
            torch.cuda.empty_cache()
        if progress is not None:
            for _ in range(ps.covers):
                progress()
    return store.host_tensor()

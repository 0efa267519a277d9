"""Qwen-Image suite: issue 44's speed and memory lines, ours against diffusers on the full-size architecture.

Workload (``LEANDIFFUSION_BENCH_QWEN_WORKLOAD``, default ``edit``, issue 44's acceptance): ``edit``
(``qwen_models.EDIT``): one 1024x1024 reference image + instruction -> latent, 1024x1024, true CFG 4, 20 steps,
the peer ``QwenImageEditPlusPipeline`` and ours the Fused Edit Sampler; ``t2i`` (``qwen_models.TEXT_TO_IMAGE``):
prompt -> latent, the peer ``QwenImagePipeline`` and ours the Fused Flow Sampler. ``--quick``: 4 steps, one timed
run after one warm-up; full: the median of 3 (``LEANDIFFUSION_BENCH_QWEN_STEPS`` sets the steps of either). Random weights built ONCE per process on the device and shared by
every case (``qwen_cases.SharedWeights``). Cases, in the order they run (``LEANDIFFUSION_BENCH_QWEN_CASES``,
a comma list of ``ALL_PARTS``; default all; a part pulls in the case its ratio needs, ``REQUIRES``):
- ``peer``: the workload's diffusers pipeline on the same modules, bf16, SDPA, resident;
- ``none`` / ``cuda_graph`` / ``compile+cuda_graph``: ours, resident (``full``), bf16, through the workload's node
  with that ``acceleration``;
- ``stream_edit``: 8 edits through one Stream Edit Sampler run against the Fused Edit Sampler one image at a time,
  on one resident bf16 engine (``qwen_stream_edit``; one timed run per side, so its guard counts ~16 edits per
  "run": give it the workload's 20 steps with ``--quick`` and ``LEANDIFFUSION_BENCH_QWEN_STEPS=20``; it needs the
  peer's run time for that guard);
- ``fp8_fast``: ours resident with ``weight_dtype`` ``fp8_e4m3fn_fast``, ``compile+cuda_graph``; ``fp8``: resident
  ``fp8_e4m3fn``, ``cuda_graph`` (what the 8 GB stream compares with);
- ``stream_fp8``: ours ``stream`` at 8 GB with ``fp8_e4m3fn``; ``stream``: ours ``stream`` at 12 GB, bf16 (both
  ``cuda_graph`` unless ``LEANDIFFUSION_BENCH_QWEN_STREAM_ACCELERATION`` says otherwise; allocator capped at the
  budget); ``stream_plain``: the 12 GB bf16 stream with packed copies off (what packing gains or costs there);
- ``peer_offload``: the pipeline with diffusers' leaf-level group offload and streams on the transformer and text
  encoder under a 12 GiB cap (last: it leaves its hooks on the modules).
Rows (``qwen_targets``): each case's peak; issue 44's ratios, each with its target, from cases of this process
(compile+cuda_graph >= 1.2x the peer, fp8_e4m3fn_fast >= 1.6x, 12 GB stream <= 1.1x resident bf16, 8 GB fp8 stream
<= 1.1x resident fp8, stream >= 1.15x the peer's group offload under the same cap); latent distances (graph vs
eager, fp8 vs bf16, streamed vs resident, ours vs the peer). A case the pack cannot run yet (a "not supported yet"
refusal; an acceleration that captured no CUDA graph) makes its targets FAIL with the reason; the suite goes on.
Another error fails the suite after the remaining cases ran.

One device call (the full-size build takes ~1 min; compile ~2 min per storage), e.g.:
    bash scripts/device_bench.sh --quick --suite qwen --budget 580
    LEANDIFFUSION_BENCH_QWEN_CASES=stream,stream_fp8,peer_offload bash scripts/device_bench.sh --quick --suite qwen
    LEANDIFFUSION_BENCH_QWEN_WORKLOAD=t2i bash scripts/device_bench.sh --quick --suite qwen
``ctx.smoke``: the tiny Qwen-Image on the CPU in fp32 through the same code, the edit at 64 px (numbers
meaningless; ours against the pipeline within 1e-4 checks both sides' plumbing).
"""
from __future__ import annotations

import logging
import os
import time
import traceback

import torch

from .harness import BenchContext
from .qwen_cases import SharedWeights, ours_resident, ours_stream, peer_offload, peer_resident, \
    unavailable_reason
from .qwen_models import DEFAULT_WORKLOAD, WORKLOADS
from .qwen_stream_edit import stream_edit
from .qwen_targets import PEER_OFFLOAD, STREAM_BF16, STREAM_EDIT, STREAM_EDIT_ONE_BY_ONE, STREAM_FP8, STREAM_PLAIN, \
    Rows
from .zimage_budget import free_device

logger = logging.getLogger(__name__)

SUITE = "qwen"
SMOKE_BUDGET_S = 20
QUICK_BUDGET_S = 480  # the 57 GB build, two regional compiles and the pinned host copies dominate
FULL_BUDGET_S = 540

ALL_PARTS = ("peer", "none", "cuda_graph", "compile+cuda_graph", "stream_edit", "fp8_fast", "fp8", "stream_fp8",
             "stream", "stream_plain", "peer_offload")
REQUIRES = {"stream_edit": ("peer",), "stream": ("cuda_graph",), "stream_fp8": ("fp8",),
            "stream_plain": ("stream",), "peer_offload": ("stream",)}
ENV_CASES, ENV_WORKLOAD = "LEANDIFFUSION_BENCH_QWEN_CASES", "LEANDIFFUSION_BENCH_QWEN_WORKLOAD"
ENV_STEPS, ENV_STREAM_ACCELERATION = "LEANDIFFUSION_BENCH_QWEN_STEPS", "LEANDIFFUSION_BENCH_QWEN_STREAM_ACCELERATION"
QUICK_STEPS = 4
# rows that time one resident bf16 run: the time guard's unit for the parts after them
RESIDENT_RUN_KEYS = ("peer", "bf16/none", "bf16/cuda_graph")
STREAM_ACCELERATION = "cuda_graph"  # the default; ENV_STREAM_ACCELERATION picks another
# seconds a part needs beyond its runs (capture, compile, quantization, pinned host copies), and its runs' cost
# relative to one resident peer run
FIXED_S = {"peer": 0, "none": 0, "cuda_graph": 20, "compile+cuda_graph": 150, "stream_edit": 30, "fp8_fast": 180,
           "fp8": 30, "stream_fp8": 60, "stream": 90, "stream_plain": 60, "peer_offload": 120}
# stream_edit: 16 edits + a 2-step warm-up of each side over the suite's (warm-up + 1) runs with --quick
RUN_FACTOR = {"stream_edit": 8.0, "stream": 1.5, "stream_fp8": 1.5, "stream_plain": 2.0, "peer_offload": 4.0}


def selected_parts() -> tuple:
    """The asked-for parts with what their ratios need, in ``ALL_PARTS`` order."""
    text = os.environ.get(ENV_CASES, "").strip()
    parts = set(ALL_PARTS) if not text else {p.strip() for p in text.split(",") if p.strip()}
    unknown = sorted(parts - set(ALL_PARTS))
    if unknown:
        raise ValueError(f"{ENV_CASES}: unknown part(s) {unknown}; expected a comma list of {ALL_PARTS}")
    for part in ALL_PARTS[::-1]:  # a part requires only earlier ones: one reverse pass closes the set
        if part in parts:
            parts.update(REQUIRES.get(part, ()))
    return tuple(p for p in ALL_PARTS if p in parts)


def workload(ctx: BenchContext):
    name = os.environ.get(ENV_WORKLOAD, DEFAULT_WORKLOAD).strip() or DEFAULT_WORKLOAD
    if name not in WORKLOADS:
        raise ValueError(f"{ENV_WORKLOAD}={name!r}: expected one of {sorted(WORKLOADS)}")
    w = WORKLOADS[name]
    if ctx.smoke or ctx.device.type != "cuda":
        return w.with_steps(2, 64)
    steps = os.environ.get(ENV_STEPS, "").strip()
    if steps:
        if not steps.isdigit() or int(steps) < 1:
            raise ValueError(f"{ENV_STEPS}={steps!r}: expected a positive step count")
        return w.with_steps(int(steps), w.size)  # e.g. the workload's full 20 steps with --quick's single run
    return w.with_steps(QUICK_STEPS, w.size) if ctx.quick else w


def stream_acceleration() -> str:
    """The streamed cases' ``acceleration`` (eager avoids recapturing when the text stage drops the graph)."""
    value = os.environ.get(ENV_STREAM_ACCELERATION, "").strip() or STREAM_ACCELERATION
    if value not in ("none", "cuda_graph", "compile+cuda_graph"):
        raise ValueError(f"{ENV_STREAM_ACCELERATION}={value!r}: expected none, cuda_graph or compile+cuda_graph")
    return value


def _weights(ctx: BenchContext) -> SharedWeights:
    if ctx.smoke or ctx.device.type != "cuda":
        from ..memory.tiny_qwen_image import build_tiny_qwen_image

        return SharedWeights(build_tiny_qwen_image(seed=0), ctx.device, "fp32")
    from .qwen_models import full_qwen_image_components

    t0 = time.time()
    comps = full_qwen_image_components(ctx.device)
    logger.info("full-size Qwen-Image built on %s in %.0f s", ctx.device, time.time() - t0)
    return SharedWeights(comps, ctx.device, "bf16")


class _Runner:
    """Runs the parts in order, each under the time guard, into ``Rows``; remembers real errors."""

    def __init__(self, ctx: BenchContext, rows: Rows, warmup: int, repeat: int):
        self.ctx, self.rows, self.warmup, self.repeat = ctx, rows, warmup, repeat
        self.run_s = 30.0  # one resident run, until the first is measured
        self.errors: list[str] = []

    def has_time(self, part: str) -> bool:
        if self.ctx.smoke:
            return True
        need = FIXED_S[part] + (self.warmup + self.repeat) * self.run_s * RUN_FACTOR.get(part, 1.0)
        return self.ctx.has_time(need)

    def guarded(self, part: str, keys: list, fn) -> None:
        """``fn()`` -> ``{key: Run or reason}``; a refusal or out-of-memory becomes each key's reason."""
        if not self.has_time(part):
            for key in keys:
                self.ctx.skip(f"{self.rows.case}/{key}", "no time left in the suite's budget")
            return
        try:
            results = fn()
        except Exception as exc:
            reason = unavailable_reason(exc)
            if reason is None and isinstance(exc, torch.cuda.OutOfMemoryError):
                reason = f"out of memory: {str(exc).splitlines()[0][:200]}"
            if reason is None:
                logger.error("%s failed:\n%s", part, traceback.format_exc())
                self.errors.append(f"{part}: {type(exc).__name__}: {exc}")
                reason = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            traceback.clear_frames(exc.__traceback__)
            results = {key: reason for key in keys}
            free_device()
        for key, result in results.items():
            if key in RESIDENT_RUN_KEYS and hasattr(result, "ms"):
                self.run_s = result.ms / 1e3
            self.rows.add(key, result)


def run(ctx: BenchContext) -> None:
    parts = selected_parts()
    w = workload(ctx)
    warmup, repeat = (0, 1) if ctx.smoke else (1, 1 if ctx.quick else 3)  # smoke: the CPU runs eager anyway
    weights = _weights(ctx)
    rows = Rows(ctx, w.case, w.peer_name)
    r = _Runner(ctx, rows, warmup, repeat)
    dtype = weights.dtype
    accelerations = [a for a in ("none", "cuda_graph", "compile+cuda_graph") if a in parts]
    if "peer" in parts:
        r.guarded("peer", ["peer"], lambda: {"peer": peer_resident(ctx, weights, w, warmup, repeat)})
    if accelerations:  # one engine; the most expensive part asks the time guard
        guard = accelerations[-1]
        r.guarded(guard, [f"bf16/{a}" for a in accelerations], lambda: {
            f"bf16/{a}": v for a, v in ours_resident(ctx, weights, w, dtype, accelerations, warmup, repeat).items()})
    if "stream_edit" in parts:
        r.guarded("stream_edit", [STREAM_EDIT_ONE_BY_ONE, STREAM_EDIT], lambda: stream_edit(ctx, weights, w, warmup))
    for part, storage, acceleration in (("fp8_fast", "fp8_e4m3fn_fast", "compile+cuda_graph"),
                                        ("fp8", "fp8_e4m3fn", "cuda_graph")):
        if part in parts:
            r.guarded(part, [f"{storage}/{acceleration}"], lambda s=storage, a=acceleration: {
                f"{s}/{a}": v for a, v in ours_resident(ctx, weights, w, s, [a], warmup, repeat,
                                                        dit=_fp8_dit(weights)).items()})
    if "stream_fp8" in parts:
        r.guarded("stream_fp8", [STREAM_FP8], lambda: {STREAM_FP8: ours_stream(
            ctx, weights, w, 8.0, "fp8_e4m3fn", stream_acceleration(), warmup, repeat, dit=weights.fp8_dit())})
    weights.drop_fp8_dit()  # host memory for the bf16 stream's and the peer's pinned copies
    if "stream" in parts:
        r.guarded("stream", [STREAM_BF16], lambda: {STREAM_BF16: ours_stream(
            ctx, weights, w, 12.0, dtype, stream_acceleration(), warmup, repeat)})
    if "stream_plain" in parts:
        r.guarded("stream_plain", [STREAM_PLAIN], lambda: {STREAM_PLAIN: ours_stream(
            ctx, weights, w, 12.0, dtype, stream_acceleration(), warmup, repeat, packed=False)})
    if "peer_offload" in parts:
        r.guarded("peer_offload", [PEER_OFFLOAD], lambda: {PEER_OFFLOAD: peer_offload(
            ctx, weights, w, 12.0, warmup, repeat)})
    if ctx.smoke or ctx.device.type != "cuda":
        rows.smoke_check()
    rows.finish()
    if r.errors:
        raise RuntimeError("qwen suite: case(s) failed: " + " | ".join(r.errors))


def _fp8_dit(weights: SharedWeights):
    """The fp8 copy of the DiT; the bf16 DiT leaves the device so the fp8 peak is the fp8 model's."""
    dit = weights.fp8_dit()
    weights.place("cpu", weights.components["transformer"])
    return dit

"""The qwen suite's ``stream_edit`` part: issue 44's "Stream Edit Sampler, 8 images: throughput >= 1.3x the
one-by-one Fused Edit Sampler in the same process".

Invariants
- Both sides do the same work on ONE resident ``full`` engine over the shared weights (the suite's storage: bf16 on
  the GPU): ``N_IMAGES`` pictures of one size and distinct content (``references``), the workload's instruction,
  negative, steps, true CFG and area, ``acceleration`` cuda_graph, and both end with IMAGE and LATENT. One by one:
  the Fused Edit Sampler node on picture n with seed ``SEED + n``, then the untiled decode of its LATENT
  (``vae.untiled.vae_decode``), because the Stream Edit Sampler returns the untiled decode of every LATENT row too.
  Stream: one Stream Edit Sampler node run over the batch with ``max_batch`` 0 (automatic), whose edit n is
  specified to equal that one-image run.
- Warm-up (untimed, when the suite warms up): each side once over the same pictures at 2 steps. The CUDA graphs are
  keyed by shapes and text lengths, never by the step count, so the timed run replays what the warm-up captured
  (batch 1 for one by one; each batch size the stream picks) without paying the workload's steps twice. Captures
  made inside the timed run anyway (an automatic batch that changed with the free VRAM) are counted in its notes.
- One timed run per side whatever the mode (8 edits take ~140 s per side at 20 steps; a median of 3 would not fit
  one device call); CUDA-event wall time, the peak reserved inside each side. The one-by-one side's graphs are
  dropped before the stream starts, so each peak is its own.
- Rows (``qwen_targets``): ``throughput_vs_one_by_one`` (time for all 8 edits; the ratio is the throughput ratio,
  target >= 1.3), each side's peak, and ``rel_vs_one_by_one``: the stream's LATENT rows against the one-by-one
  LATENTs (row n = edit n), rel L2 within bf16 tolerance (equal on the CPU in fp32).
"""
from __future__ import annotations

import torch

from .harness import BenchContext, peak_memory, time_ms
from .qwen_cases import Run, SharedWeights, _check_accelerated, _engine, _release
from .qwen_models import EDIT_AREA, INSTRUCTION, NEGATIVE, SEED, Workload, edit_components, edit_peer_only_modules, \
    reference_image
from .qwen_targets import STREAM_EDIT, STREAM_EDIT_ONE_BY_ONE

N_IMAGES = 8
ACCELERATION = "cuda_graph"
WARMUP_STEPS = 2  # the fewest steps the schedule accepts (its terminal shift needs two)


def references(size: int, n: int = N_IMAGES) -> torch.Tensor:
    """``n`` distinct IMAGE rows ``[n, size, size, 3]``: the workload's reference rolled by ``i / n`` of its width
    (same size and 8-bit values, different content at every pixel)."""
    base = reference_image(size)
    return torch.cat([torch.roll(base, shifts=i * size // n, dims=2) for i in range(n)])


def _one_by_one(engine, images: torch.Tensor, steps: int, w: Workload) -> torch.Tensor:
    """The Fused Edit Sampler + untiled decode, image by image; returns the LATENTs ``[n, 16, h, w]``."""
    from ..nodes.edit import LeanEditSampler
    from ..vae.untiled import vae_decode

    latents = []
    for i in range(images.shape[0]):
        lat = LeanEditSampler().run(engine, images[i:i + 1], INSTRUCTION, NEGATIVE, SEED + i, steps, w.cfg,
                                    w.size * w.size / EDIT_AREA, ACCELERATION)[0]["samples"]
        with engine.session("vae"):
            vae_decode(engine, lat)
        latents.append(lat.float().cpu())
    return torch.cat(latents)


def _stream(engine, images: torch.Tensor, steps: int, w: Workload) -> torch.Tensor:
    """One Stream Edit Sampler run (automatic batch); returns its LATENT rows (one output size: one output)."""
    from ..nodes.edit_stream import LeanEditStreamSampler

    decoded, latents = LeanEditStreamSampler().run(engine, INSTRUCTION, NEGATIVE, SEED, steps, w.cfg,
                                                   w.size * w.size / EDIT_AREA, ACCELERATION, 0, images=images)
    if len(latents) != 1 or decoded[0].shape[0] != images.shape[0]:
        raise RuntimeError(f"stream_edit: expected one output of {images.shape[0]} edits, got "
                           f"{[tuple(x.shape) for x in decoded]}")
    return latents[0]["samples"].float().cpu()


def _side(ctx: BenchContext, engine, side, images: torch.Tensor, w: Workload, warmup: int, notes: str) -> Run:
    from ..sampling.graph_runner import default_runner

    if warmup:
        side(engine, images, WARMUP_STEPS, w)
    out: list = [None]

    def call() -> None:
        out[0] = side(engine, images, w.steps, w)

    captured = default_runner().captures(engine)
    with peak_memory(ctx.device) as mem:
        ms = time_ms(call, warmup=0, repeat=1, device=ctx.device)
    _check_accelerated(ctx, engine, ACCELERATION)
    captured = default_runner().captures(engine) - captured  # e.g. the automatic batch chose another size
    return Run(ms, mem["reserved_gb"], out[0], notes=f"{notes}; {captured} CUDA graph capture(s) in the timed run")


def stream_edit(ctx: BenchContext, weights: SharedWeights, w: Workload, warmup: int) -> dict:
    """``{STREAM_EDIT_ONE_BY_ONE: Run, STREAM_EDIT: Run}`` (module docstring); the edit workload's inputs whatever
    the suite's workload."""
    images = references(w.size)
    weights.place("cpu", *edit_peer_only_modules(weights.components["text_encoder"]))
    engine = _engine(weights, edit_components(weights.components), "full", weights.dtype)
    what = f"{N_IMAGES} edits of {w.size}x{w.size}, {w.steps} steps, {ACCELERATION}, full policy, {weights.dtype}"
    try:
        try:
            seeds = f"seeds {SEED}..{SEED + N_IMAGES - 1}"
            one = _side(ctx, engine, _one_by_one, images, w, warmup,
                        f"Fused Edit Sampler + untiled decode, one image at a time ({seeds}); {what}")
        finally:
            _release(engine, remove=False)
        try:
            stream = _side(ctx, engine, _stream, images, w, warmup, f"Stream Edit Sampler, max_batch 0; {what}")
        finally:
            _release(engine, remove=False)
    finally:
        del engine
    return {STREAM_EDIT_ONE_BY_ONE: one, STREAM_EDIT: stream}

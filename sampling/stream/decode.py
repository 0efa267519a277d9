"""Decode stage: a batch's final latents -> IMAGE rows, on the ``vae`` stream, into page-locked host memory.

Invariants
- A batch is handed over with an event recorded on the ``unet`` stream after its final latents were copied out
  of the sampler's buffers; the ``vae`` stream waits for it. Then, on the ``vae`` stream: the model-space latents
  are copied to page-locked host memory (the LATENT output: raw ``latents / scaling_factor + shift_factor`` on the
  host, exactly as the Fused DDIM / Flow Samplers return them; the shift is 0 for the SD VAEs and is then not
  added), and every image is decoded from its raw latents (any channel count: 4 for SD, 16 for Z-Image's VAE)
  untiled as ``vae.untiled.vae_decode`` does
  (``vae.untiled.decode`` inside ``vae.untiled.fast_vae``, then ``(x / 2 + 0.5).clamp(0, 1)``, channels last)
  and copied to page-locked memory.
  ``finish`` waits for the batch's event and only then writes the rows of the run's outputs, each exactly once.
- One image is decoded at a time, so the VAE's activations are bounded by one image whatever the batch size.
- Tiled decoding (``decode_tile_size`` > 0, or automatically when an untiled decode does not fit or runs out of
  memory) uses the ``vae`` package's exact tiled executor on the LATENT rows (so it equals the Tiled VAE Decode
  node on this sampler's LATENT output, up to floating-point error); on out-of-memory it halves the tile down to
  128 px, then raises what it tried; the run's later images start from the tile (and budget) that worked. It is
  synchronous on the host (the tiled executor streams bands through host memory), so it does not overlap the next
  batch's denoising; an untiled decode does.
- Deferred mode (``before_deferred`` given: a run under the loader's hard VRAM budget): ``submit`` only copies a
  batch's latents to page-locked host memory; ``drain`` calls ``before_deferred`` (the scheduler drops the run's
  CUDA graphs there, whose memory pools would otherwise stay reserved beside the decode) and then decodes every
  batch, tiled, in submission order. Outputs and their order are the same as in the overlapped mode.
- ``raw=True`` (a VAE without one scaling factor: Qwen-Image's per-channel normalisation, which the caller undoes):
  the submitted latents are raw already, and the LATENT rows are exactly them.
- The VAE session runs on a view of the engine without adapters (no adapter touches the VAE, and attaching a
  LoRA from the ``vae`` stream could race the ``unet`` stream's reads of the weights it writes).
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ... import bridge
from ...memory.engine import LeanEngine
from ...memory.out_of_memory import is_out_of_memory
from ...vae.adapters import decoder_program
from ...vae.exact import ExactConfig, run_exact
from ...vae import untiled
from ...vae.targets import from_engine
from ...vae.tiled import MIN_TILE, activation_budget
from .streams import StageStreams, Timeline, pinned_empty

logger = logging.getLogger(__name__)

_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
# Device bytes per output pixel of an untiled SD-VAE decode, per byte of dtype (ComfyUI's estimate for its VAE:
# 2178 bytes per latent pixel x 64 / 64 output pixels per latent pixel, rounded up).
DECODE_BYTES_PER_PX = 2200


def untiled_decode_bytes(height: int, width: int, dtype: torch.dtype) -> int:
    """Estimated device bytes of one untiled decode of a ``height`` x ``width`` image."""
    return int(height * width * DECODE_BYTES_PER_PX * torch.empty((), dtype=dtype).element_size())


@dataclass(eq=False)
class _Pending:
    start: int
    stop: int
    images: torch.Tensor  # host [B, H, W, 3]
    latents: torch.Tensor  # host [B, C, h, w], scaled
    event: object


class DecodeStage:
    def __init__(self, engine: LeanEngine, tile_size: int, tiled: bool, streams: StageStreams,
                 images_out: torch.Tensor, latents_out: torch.Tensor, timeline: Optional[Timeline] = None,
                 decode_budget: Optional[int] = None, before_deferred: Optional[Callable[[], None]] = None,
                 raw: bool = False):
        self.engine = engine.with_changes(adapters=())
        self.before_deferred = before_deferred
        self._deferred: list = []  # deferred mode: (start, stop, host latents, event) in submission order
        self.decode_budget = decode_budget  # activation bytes of a tiled decode (None: from free VRAM / budget)
        self.tile_size = tile_size
        self.tiled = tiled
        self.streams = streams
        self.images_out = images_out
        self.latents_out = latents_out
        self.written = torch.zeros(images_out.shape[0], dtype=torch.bool)
        self.timeline = timeline
        self.scale = 1.0 if raw else engine.parts.vae_scaling_factor
        self.shift = 0.0 if raw else engine.parts.vae_shift_factor
        self._queued = None  # (start, stop, device latents, event): waiting for its decode to be enqueued
        self._pending: list[_Pending] = []  # decodes enqueued, outputs not yet written
        self._fit: Optional[tuple] = None  # (tile, budget) an out-of-memory retry found; later images start there

    # ----------------------------------------------------------------- the queue (bounded: one of each)
    def submit(self, start: int, stop: int, latents: torch.Tensor) -> None:
        """Queue images ``[start, stop)``'s final scaled latents (on the ``unet`` stream) for decoding."""
        if self._queued is not None:
            raise RuntimeError("decode queue holds a batch already; call launch() first")
        if self.before_deferred is not None:
            cuda = self.streams.cuda
            host_lat = pinned_empty(tuple(latents.shape), torch.float32, cuda)
            with self.streams.use("unet"):
                host_lat.copy_(latents, non_blocking=cuda)
            self._deferred.append((start, stop, host_lat, self.streams.record("unet")))
            return
        self._queued = (start, stop, latents, self.streams.record("unet"))

    def launch(self) -> None:
        """Enqueue the decode of the queued batch (after finishing the one before it: the queue is bounded)."""
        self.finish()
        if self._queued is None:
            return
        start, stop, latents, event = self._queued
        self._queued = None
        bridge.check_interrupted()
        self.streams.hand_over(event, [latents], "vae")
        cuda = self.streams.cuda
        b = stop - start
        host_lat = pinned_empty(tuple(latents.shape), torch.float32, cuda)
        span = self.timeline.span("vae", f"images {start}-{stop - 1}", range(start, stop)) if self.timeline \
            else contextlib.nullcontext()
        with self.streams.use("vae"), span:
            host_lat.copy_(latents, non_blocking=cuda)
            lat_event = self.streams.record("vae")
            if self.tiled:
                h, w = latents.shape[2] * 8, latents.shape[3] * 8
                images, done = pinned_empty((b, h, w, 3), torch.float32, cuda), 0
            else:
                images, done = self._untiled(latents, cuda)
            if done < b:
                if lat_event is not None:
                    lat_event.synchronize()
                self._tiled_rows(host_lat, images, done)
        self._pending.append(_Pending(start, stop, images, host_lat, self.streams.record("vae")))

    def _tiled_rows(self, host_lat: torch.Tensor, images: torch.Tensor, first: int) -> None:
        for j in range(first, host_lat.shape[0]):
            bridge.check_interrupted()
            images[j] = self._tiled_image(self._raw(host_lat[j:j + 1]))

    def _decode_deferred(self) -> None:
        if not self._deferred:
            return
        self.before_deferred()
        while self._deferred:
            start, stop, host_lat, event = self._deferred[0]
            if event is not None:
                event.synchronize()
            h, w = host_lat.shape[2] * 8, host_lat.shape[3] * 8
            images = pinned_empty((stop - start, h, w, 3), torch.float32, self.streams.cuda)
            span = self.timeline.span("vae", f"images {start}-{stop - 1}", range(start, stop)) if self.timeline \
                else contextlib.nullcontext()
            with self.streams.use("vae"), span:
                self._tiled_rows(host_lat, images, 0)
            self._deferred.pop(0)
            self._pending.append(_Pending(start, stop, images, host_lat, self.streams.record("vae")))

    def finish(self) -> None:
        """Wait for every enqueued decode and write its rows of the outputs."""
        while self._pending:
            p = self._pending.pop(0)
            if p.event is not None:
                p.event.synchronize()
            if bool(self.written[p.start:p.stop].any()):
                raise RuntimeError(f"images {p.start}-{p.stop - 1} were produced twice (a scheduler bug)")
            self.images_out[p.start:p.stop] = p.images
            self.latents_out[p.start:p.stop] = self._raw(p.latents)
            self.written[p.start:p.stop] = True

    def drain(self) -> None:
        self.launch()
        self._decode_deferred()
        self.finish()

    # ----------------------------------------------------------------- untiled and tiled decoding
    def _raw(self, latents: torch.Tensor) -> torch.Tensor:
        """Model-space latents -> raw VAE latents (``/ scaling_factor + shift_factor``; no add for a zero shift)."""
        raw = latents / self.scale
        return raw + self.shift if self.shift else raw

    def _untiled(self, latents: torch.Tensor, cuda: bool):
        """Decode rows one by one into page-locked memory; returns (images, rows done) -- fewer on out-of-memory."""
        b, _, h, w = latents.shape
        images = pinned_empty((b, 8 * h, 8 * w, 3), torch.float32, cuda)
        engine = self.engine
        vae = engine.parts.vae
        done = 0
        oom = None
        with engine.session("vae"):
            dev = engine.stage_device("vae")
            try:
                with untiled.fast_vae(vae):  # one swap for the batch's images
                    for j in range(b):
                        bridge.check_interrupted()
                        z = self._raw(latents[j:j + 1]).to(dev, engine.vae_dtype)
                        image = untiled.decode(vae, z)
                        image = (image.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1)
                        images[j].copy_(image[0], non_blocking=cuda)
                        done = j + 1
            except Exception as exc:  # noqa: BLE001 - only out-of-memory errors fall back to tiles
                if not is_out_of_memory(exc):
                    raise
                oom = exc.with_traceback(None)
        if oom is not None:
            self.streams.release_cached()
            logger.warning("untiled VAE decode ran out of memory (%s); decoding the rest of this run in tiles", oom)
            self.tiled = True
        return images, done

    def _tiled_image(self, raw: torch.Tensor) -> torch.Tensor:
        """Exact tiled decode of one raw latent [1, C, h, w] (host) -> [H, W, 3] (host), halving on OOM."""
        target = from_engine(self.engine)
        program = decoder_program(target.ae)
        z = raw[0].permute(1, 2, 0).contiguous().float()
        tile = self.tile_size or max(z.shape[0], z.shape[1]) * 8
        tried = []
        with target.enter():
            budget = activation_budget(target, self.decode_budget)
            if self._fit is not None:
                tile, budget = min(tile, self._fit[0]), min(budget, self._fit[1])
            while True:
                error = None
                try:
                    cfg = ExactConfig(target.device, target.dtype, budget, tile,
                                      strict_budget=self.decode_budget is not None)
                    image = run_exact(program, z, cfg, lambda y: ((y.float() + 1.0) / 2.0).clamp_(0.0, 1.0),
                                      program.out_channels)
                    if tried:
                        self._fit = (tile, budget)
                    return image
                except Exception as exc:  # noqa: BLE001 - only out-of-memory errors are retried
                    if not is_out_of_memory(exc):
                        raise
                    error = str(exc)  # the text only: the traceback would keep the failed attempt's tensors alive
                    tried.append(tile)
                self.streams.release_cached()
                if tile <= MIN_TILE:
                    raise _OOM(f"Stream Scheduler Sampler: tiled VAE decode ran out of memory even with {MIN_TILE} "
                               f"px tiles (tried {tried} px); free VRAM or lower the resolution. Last error: {error}")
                tile, budget = max(MIN_TILE, tile // 2), max(budget // 2, 64 * 2 ** 20)
                logger.warning("tiled VAE decode: out of memory; retrying with %d px tiles", tile)


def needs_tiles(engine: LeanEngine, height: int, width: int, available: Optional[int]) -> bool:
    """Auto mode: tile when one untiled decode is estimated not to fit ``available`` device bytes."""
    if available is None:
        return False
    return untiled_decode_bytes(height, width, engine.vae_dtype) > available


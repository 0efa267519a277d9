"""Moving ESRGAN windows to the device and their kept tiles back into the host output, seam-weighted in fp32.

Invariants:
- Only windows (a tile plus its context, see ``tiling``) ever sit on the GPU; each window is copied into a pinned
  host buffer and sent asynchronously, and each kept result comes back (widened to fp32 on the GPU) through a
  second pinned buffer. Two slots alternate, so the CPU accumulates tile k-1 while the GPU runs tile k. The full
  image and the output live in host memory.
- Feathering: a tile's seam weights (``tiling.axis_weights``) are applied in fp32 (``out += fp32(y) * w``): on the
  GPU before the download there, by the accumulation itself on the CPU. Where the tiles agree the blend gives back
  the model's output up to fp32 rounding, as ComfyUI's ``tiled_scale`` (fp32 masks) does; weights and products
  rounded to fp16/bf16 would not sum to 1 and leave visible seams. Weighting on the GPU keeps the host's work per
  tile to one fp32 add, at the price of fp32 pinned slots and downloads (twice the bytes of a half tile).
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from .tiling import Span, axis_weights, largest_keep, largest_window


def seam_weight(r: Span, c: Span, scale: int, device: torch.device) -> Optional[torch.Tensor]:
    """[h, w, 1] fp32 feather weights of the tile ``(r, c)``'s kept part on ``device``; None for a tile without
    seams (its weights would all be 1)."""
    if not (r.band_lo or r.band_hi or c.band_lo or c.band_hi):
        return None
    return (axis_weights(r, scale, device)[:, None] * axis_weights(c, scale, device)[None, :]).unsqueeze(-1)


def weighted_fp32(tile_hwc: torch.Tensor, weight: Optional[torch.Tensor]) -> torch.Tensor:
    """A new contiguous fp32 tensor ``fp32(tile_hwc) * weight`` (``weight`` None: just widened), on the tile's
    device: the weight and the product are never rounded to the model's dtype."""
    staged = torch.empty(tile_hwc.shape, dtype=torch.float32, device=tile_hwc.device)
    if weight is None:
        return staged.copy_(tile_hwc)
    return torch.mul(tile_hwc, weight, out=staged)


def _accumulate(dst: torch.Tensor, src: torch.Tensor, accumulate: bool, weight: Optional[torch.Tensor]) -> None:
    """``dst = src`` (one tile: no seams), else ``dst += src * weight`` computed in ``dst``'s dtype (fp32): ``src``
    (the model's dtype) is widened, never the weight or the product rounded to it. ``weight``: [h, w, 1] fp32
    seam weights on the host, or None (a tile without seams, or weighted already)."""
    if not accumulate:
        dst.copy_(src)
    elif weight is None:
        dst.add_(src)
    else:
        dst.addcmul_(src, weight)


class CpuStager:
    """Plain path: windows are views of the host image, results are added straight into the output."""

    def __init__(self, device: torch.device):
        self.device = device

    def upload(self, window_chw: torch.Tensor) -> torch.Tensor:
        return window_chw.unsqueeze(0).to(self.device)

    def download(self, tile_hwc: torch.Tensor, dst: torch.Tensor, accumulate: bool = True,
                 weight: Optional[torch.Tensor] = None) -> None:
        _accumulate(dst, tile_hwc.to(dst.device), accumulate, weight)

    def finish(self) -> None:
        pass


class CudaStager:
    """Two pinned slots per direction; the host accumulates tile k-1 while the GPU runs tile k. Tiles are widened
    to fp32 and seam-weighted on the GPU (``weighted_fp32``), so the host only adds fp32 to fp32."""

    def __init__(self, device: torch.device, in_numel: int, out_numel: int):
        self.device = device
        self.inbufs = [torch.empty(in_numel, dtype=torch.float32, pin_memory=True) for _ in range(2)]
        self.outbufs = [torch.empty(out_numel, dtype=torch.float32, pin_memory=True) for _ in range(2)]
        self.pending: list = [None, None]
        self.slot = 0

    def _drain(self, slot: int) -> None:
        item = self.pending[slot]
        if item is not None:
            event, buf, dst, accumulate = item
            event.synchronize()
            _accumulate(dst, buf, accumulate, None)
            self.pending[slot] = None

    def upload(self, window_chw: torch.Tensor) -> torch.Tensor:
        self._drain(self.slot)
        buf = self.inbufs[self.slot][: window_chw.numel()].view(window_chw.shape)
        buf.copy_(window_chw)
        return buf.unsqueeze(0).to(self.device, non_blocking=True)

    def download(self, tile_hwc: torch.Tensor, dst: torch.Tensor, accumulate: bool = True,
                 weight: Optional[torch.Tensor] = None) -> None:
        buf = self.outbufs[self.slot][: tile_hwc.numel()].view(tile_hwc.shape)
        # the fp32 tile is freed on return: the caching allocator reuses it only for later work on this stream
        buf.copy_(weighted_fp32(tile_hwc, weight), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.pending[self.slot] = (event, buf, dst, accumulate)
        self.slot ^= 1
        self._drain(self.slot)  # the previous tile, finished before this one started on the GPU

    def finish(self) -> None:
        self._drain(self.slot)
        self._drain(self.slot ^ 1)


def stager_for(device: torch.device, tiles: list, in_channels: int, scale: int,
               out_channels: int) -> Union[CpuStager, CudaStager]:
    """The stager for ``device``: pinned slots sized for the largest window and kept tile of ``tiles`` on CUDA."""
    if device.type != "cuda":
        return CpuStager(device)
    wh, ww = largest_window(tiles)
    kh, kw = largest_keep(tiles)
    return CudaStager(device, in_channels * wh * ww, kh * kw * scale * scale * out_channels)

"""Z-Image's DiT forward over static shapes: the same result as ``ZImageTransformer2DModel.forward`` whatever
the prompt, with tensor shapes that depend only on the batch, the image size and a caption *capacity*.

The model (diffusers ``transformer_z_image.py``; Z-Image, Tongyi 2025) embeds image patches and caption features,
pads each sequence to a multiple of 32 with a *learned* pad token (attention sees those pads: dropping or masking
them moves the output), refines image and caption tokens separately, then runs the main blocks on
``[image tokens, caption tokens]`` with 3-axis RoPE positions: caption token ``j`` at ``(1 + j, 0, 0)``, image
patch ``(r, c)`` at ``(Lp + 1, r, c)`` where ``Lp`` is the padded caption length, pads at ``(0, 0, 0)``.

Here every caption row is laid out in a buffer of ``capacity`` tokens (a bucket of ``CAPTION_BUCKETS``): its
``Lp`` first slots hold the caption and its learned pads exactly as the model lays them out, the slots after them
are excluded by the attention mask (keys there carry no weight, and their query rows are never read). Positions and
RoPE tables are computed per prompt outside the captured step (``CaptionLayout``) and copied into static buffers,
so a CUDA graph captured for one prompt replays any prompt of the same bucket and gives that prompt's result.

The blocks, embedders and final layer are the model's own modules, called through ``__call__`` (so forward hooks
of a streaming policy and adapters such as unmerged LoRAs see every block); only the glue between them is here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .block import installed

SEQ_MULTIPLE = 32
CAPTION_BUCKETS = (128, 256, 512)


def padded(n: int, multiple: int = SEQ_MULTIPLE) -> int:
    return -(-int(n) // multiple) * multiple


def caption_capacity(lengths: Sequence[int]) -> int:
    """The smallest bucket holding every caption's padded length."""
    need = max(padded(n) for n in lengths)
    for bucket in CAPTION_BUCKETS:
        if need <= bucket:
            return bucket
    raise ValueError(f"a caption of {max(lengths)} tokens exceeds the longest supported ({CAPTION_BUCKETS[-1]}); "
                     f"shorten the prompt")


@dataclass(frozen=True)
class ImageGrid:
    """Patch grid of a latent: ``rows x cols`` patches of ``patch x patch``, padded to ``padded_tokens``."""

    rows: int
    cols: int
    patch: int

    @property
    def tokens(self) -> int:
        return self.rows * self.cols

    @property
    def padded_tokens(self) -> int:
        return padded(self.tokens)

    @classmethod
    def of(cls, latent_h: int, latent_w: int, patch: int) -> "ImageGrid":
        if latent_h % patch or latent_w % patch:
            raise ValueError(f"latent size {latent_w}x{latent_h} is not a multiple of the patch size {patch}; use "
                             f"width and height that are multiples of {8 * patch} px")
        return cls(latent_h // patch, latent_w // patch, patch)


@dataclass(frozen=True)
class CaptionLayout:
    """Per-row tensors that change with the prompt but not in shape: caption features, pad and attention masks and
    RoPE tables (CPU or device; copied into a ``DitBuffers``)."""

    features: torch.Tensor  # [B, capacity, C_text]
    pad: torch.Tensor  # [B, capacity, 1] bool: slot takes the learned caption pad token
    caption_mask: torch.Tensor  # [B, capacity] bool: slot visible to attention
    caption_freqs: torch.Tensor  # [B, capacity, head_dim / 2] complex
    image_freqs: torch.Tensor  # [B, padded image tokens, head_dim / 2] complex


def _grid_ids(frames_at: int, rows: int, cols: int) -> torch.Tensor:
    r, c = torch.meshgrid(torch.arange(rows, dtype=torch.int32), torch.arange(cols, dtype=torch.int32), indexing="ij")
    return torch.stack([torch.full_like(r, frames_at), r, c], dim=-1).reshape(-1, 3)


def caption_layout(dit: torch.nn.Module, captions: Sequence[torch.Tensor], grid: ImageGrid, capacity: int,
                   dtype: torch.dtype, device: torch.device) -> CaptionLayout:
    """Lay ``captions`` (one ``[L_i, C_text]`` tensor per row) out in ``capacity`` slots (module docstring)."""
    rows = len(captions)
    width = int(captions[0].shape[-1])
    features = torch.zeros(rows, capacity, width, dtype=dtype, device=device)
    pad = torch.zeros(rows, capacity, 1, dtype=torch.bool, device=device)
    mask = torch.zeros(rows, capacity, dtype=torch.bool, device=device)
    cap_ids = torch.zeros(rows, capacity, 3, dtype=torch.int32)
    img_ids = torch.zeros(rows, grid.padded_tokens, 3, dtype=torch.int32)
    for i, caption in enumerate(captions):
        n = int(caption.shape[0])
        lp = padded(n)
        if n < 1 or lp > capacity:
            raise ValueError(f"caption {i} has {n} tokens; expected 1..{capacity}")
        features[i, :n] = caption.to(device=device, dtype=dtype)
        pad[i, n:] = True
        mask[i, :lp] = True
        cap_ids[i, :lp, 0] = torch.arange(1, lp + 1, dtype=torch.int32)
        img_ids[i, :grid.tokens] = _grid_ids(lp + 1, grid.rows, grid.cols)
    rope = dit.rope_embedder
    cap_freqs = rope(cap_ids.reshape(-1, 3).to(device)).reshape(rows, capacity, -1)
    img_freqs = rope(img_ids.reshape(-1, 3).to(device)).reshape(rows, grid.padded_tokens, -1)
    return CaptionLayout(features, pad, mask, cap_freqs, img_freqs)


def patchify(x: torch.Tensor, grid: ImageGrid) -> torch.Tensor:
    """``[B, C, H, W]`` -> ``[B, rows * cols, p * p * C]`` in the model's (pH, pW, C) feature order."""
    b, c = x.shape[:2]
    p = grid.patch
    x = x.view(b, c, grid.rows, p, grid.cols, p).permute(0, 2, 4, 3, 5, 1)
    return x.reshape(b, grid.tokens, p * p * c)


def unpatchify(tokens: torch.Tensor, grid: ImageGrid, channels: int) -> torch.Tensor:
    """Inverse of :func:`patchify` for the first ``rows * cols`` tokens."""
    b = tokens.shape[0]
    p = grid.patch
    x = tokens[:, :grid.tokens].reshape(b, grid.rows, grid.cols, p, p, channels).permute(0, 5, 1, 3, 2, 4)
    return x.reshape(b, channels, grid.rows * p, grid.cols * p)


def dit_forward(dit: torch.nn.Module, x: torch.Tensor, t: torch.Tensor, layout: CaptionLayout,
                grid: ImageGrid) -> torch.Tensor:
    """The DiT's prediction for latents ``x`` [B, C, H, W] (model dtype) at model timesteps ``t`` [B] (float32),
    conditioned on ``layout``; shapes depend only on B, the grid and the layout's capacity. Blocks run ``block.lean_block_forward``
    with ``attention.ZImageAttnProcessor``."""
    with installed(dit):
        return _forward(dit, x, t, layout, grid)


def _forward(dit: torch.nn.Module, x: torch.Tensor, t: torch.Tensor, layout: CaptionLayout,
             grid: ImageGrid) -> torch.Tensor:
    key = f"{grid.patch}-1"
    adaln = dit.t_embedder(t * dit.t_scale).type_as(x)
    image = dit.all_x_embedder[key](patchify(x, grid))
    extra = grid.padded_tokens - grid.tokens
    if extra:
        image = torch.cat([image, dit.x_pad_token.to(image.dtype).expand(image.shape[0], extra, -1)], dim=1)
    for block in dit.noise_refiner:
        image = block(image, None, layout.image_freqs, adaln)
    caption = dit.cap_embedder(layout.features)
    caption = torch.where(layout.pad, dit.cap_pad_token.to(caption.dtype), caption)
    for block in dit.context_refiner:
        caption = block(caption, layout.caption_mask, layout.caption_freqs)
    unified = torch.cat([image, caption], dim=1)
    freqs = torch.cat([layout.image_freqs, layout.caption_freqs], dim=1)
    visible = torch.ones(image.shape[0], image.shape[1], dtype=torch.bool, device=image.device)
    mask = torch.cat([visible, layout.caption_mask], dim=1)
    for block in dit.layers:
        unified = block(unified, mask, freqs, adaln)
    out = dit.all_final_layer[key](unified, c=adaln)
    return unpatchify(out, grid, int(dit.out_channels))

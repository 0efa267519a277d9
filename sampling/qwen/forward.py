"""Qwen-Image's transformer forward over static shapes: the same prediction as
``QwenImageTransformer2DModel.forward`` for every row, with tensor shapes that depend only on the rows, the image
token count, the reference tokens and a text *capacity*, and no host synchronisation, so a CUDA graph can hold it.

The model (diffusers ``transformer_qwenimage.py``; Qwen-Image, Qwen team 2025) embeds packed image tokens and the
RMS-normed text rows, runs its dual-stream blocks with joint attention over ``[text, image]`` and predicts from the
image stream. RoPE: image token ``(f, r, c)`` of image ``k`` in ``img_shapes`` gets axis tables centred on the grid
(``scale_rope``) with frame index ``k``; text token ``j`` gets position ``m + j`` on all three axes, where ``m`` is
the largest half side over the image shapes. Neither depends on the text length or on padding, so a row whose text
is zero-padded at its end predicts what its unpadded call predicts when its attention reads only its real text
slots: every block attends through ``attention.RowGroupAttnProcessor`` (rows grouped by text length, no padding
mask; it keeps SDPA on its unmasked kernel), and rows of different prompts (``[cond x B, uncond x B]`` for true CFG)
share one call.

Static shapes: every text row is laid out in ``capacity`` slots (a bucket of ``TEXT_BUCKETS``), and the RoPE tables
and, for an edit, the packed reference-image tokens are computed outside the step (``QwenLayout``) and copied into
static buffers: compiled blocks see one shape per bucket, and a graph captured for one prompt replays any prompt of
the same token counts (the rows' lengths are part of its key). Why not the
module's forward: it builds its mask normalisation with ``torch.as_tensor`` of a host int (an upload per call) and,
for ``zero_cond_t`` models, its modulation index from ``img_shapes`` lists on the host; both break a capture.

Batch rows: every row of one call is at the step's one timestep (the step program sets them all alike), so the time
embedding, each block's modulation linears and the output norm's run on one row and broadcast over the rows (for a
``zero_cond_t`` model: that row and its zero-timestep twin). A small-``M`` matrix product's rounding depends on
``M``, so computed per row they would make a row's prediction depend on how many rows share the call; this way
a batch of edits or images gives each row its one-image prediction bit for bit on the CPU (the Stream Edit
Sampler's promise); the values equal the per-row ones up to that rounding.

The embedders, blocks and output layers are the model's own modules, called through ``__call__`` (so forward hooks
of a VRAM policy, unmerged LoRA adapters and fp8 weight storage see every call); only the glue between them is here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .attention import row_groups, row_groups_installed

# Edit prompts carry each picture's vision tokens, untruncated (one 1 MP picture: ~250-350 tokens). Steps of 64 up to
# 512 keep a guided edit's padded text slots (computed by every text-stream layer) under ~20% of its text.
TEXT_BUCKETS = (64, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 2048)
Shape = tuple[int, int, int]  # (frames, token rows, token columns) of one packed image


def text_capacity(lengths: Sequence[int]) -> int:
    """The smallest bucket of ``TEXT_BUCKETS`` holding every text row."""
    need = max(int(n) for n in lengths)
    for bucket in TEXT_BUCKETS:
        if need <= bucket:
            return bucket
    raise ValueError(f"a prompt of {need} tokens exceeds the longest supported ({TEXT_BUCKETS[-1]}); shorten it")


@dataclass(frozen=True)
class QwenReference:
    """Packed reference-image tokens an edit conditions every model call on (``QwenImageEdit*Pipeline``'s
    ``image_latents``): ``tokens`` ``[B or 1, sum(h_k * w_k), 64]`` in model space (``latents.pack`` of
    ``(raw - mean) / std``), concatenated after the noise tokens of each row; ``shapes`` one ``(1, h_k, w_k)``
    token grid per reference image, in order (the ``img_shapes`` entries after the noise image's)."""

    tokens: torch.Tensor
    shapes: tuple[Shape, ...]

    def checked(self, batch: int) -> "QwenReference":
        n = sum(math.prod(s) for s in self.shapes)
        if not self.shapes or self.tokens.ndim != 3 or self.tokens.shape[1] != n \
                or self.tokens.shape[0] not in (1, batch):
            raise ValueError(f"reference tokens of shape {tuple(self.tokens.shape)} do not match the reference "
                             f"shapes {self.shapes} and batch {batch}: expected [1 or {batch}, {n}, features]")
        return self


@dataclass(frozen=True)
class QwenLayout:
    """Per-run tensors that change with the prompt (and reference) but not in shape (copied into a program's
    static buffers)."""

    text: torch.Tensor  # [R, capacity, C_text] model dtype, zero-padded rows
    text_lengths: tuple[int, ...]  # real text tokens per row (the rest of its slots are padding)
    image_freqs: torch.Tensor  # [noise + reference tokens, head_dim / 2] complex
    text_freqs: torch.Tensor  # [capacity, head_dim / 2] complex
    reference: Optional[torch.Tensor]  # [R, reference tokens, C_in] model dtype, or None
    modulate_index: Optional[torch.Tensor]  # [R, noise + reference tokens] int32 for zero_cond_t models, or None


def qwen_layout(dit: torch.nn.Module, rows: Sequence[torch.Tensor], capacity: int, noise_shape: Shape,
                reference: Optional[QwenReference], dtype: torch.dtype, device: torch.device) -> QwenLayout:
    """Lay ``rows`` (one ``[L_i, C_text]`` text tensor per model row) out in ``capacity`` slots, with the RoPE tables
    of ``[noise_shape, *reference.shapes]`` and the reference tokens repeated over the rows' copies of the batch."""
    if getattr(dit.config, "use_additional_t_cond", False):
        raise ValueError("this Qwen-Image transformer takes an additional timestep condition (a layered model); "
                         "it is not supported yet: load Qwen-Image or Qwen-Image-Edit")
    n_rows, width = len(rows), int(rows[0].shape[-1])
    text = torch.zeros(n_rows, capacity, width, dtype=dtype, device=device)
    for i, row in enumerate(rows):
        n = int(row.shape[0])
        if not 1 <= n <= capacity:
            raise ValueError(f"text row {i} has {n} tokens; expected 1..{capacity}")
        text[i, :n] = row.to(device=device, dtype=dtype)
    shapes = [tuple(noise_shape)] + (list(reference.shapes) if reference is not None else [])
    image_freqs, text_freqs = dit.pos_embed([shapes], max_txt_seq_len=capacity, device=torch.device(device))
    ref = None
    if reference is not None:
        tokens = reference.tokens.to(device=device, dtype=dtype)
        ref = tokens.repeat(n_rows // tokens.shape[0], 1, 1)  # row c * B + b takes image b's tokens
    index = None
    if getattr(dit, "zero_cond_t", False):
        noise = math.prod(noise_shape)
        index = torch.ones(n_rows, image_freqs.shape[0], dtype=torch.int32, device=device)
        index[:, :noise] = 0
    return QwenLayout(text, tuple(int(r.shape[0]) for r in rows), image_freqs, text_freqs.contiguous(), ref, index)


def qwen_forward(dit: torch.nn.Module, x: torch.Tensor, t: torch.Tensor, layout: QwenLayout) -> torch.Tensor:
    """The transformer's prediction ``[R, N, C_out]`` for packed noise tokens ``x`` ``[R, N, C_in]`` (model dtype)
    at timesteps ``t`` ``[R]``, all equal (the module's ``timestep``: ``sigma`` in the model dtype; row 0 is read),
    conditioned on ``layout``; reference tokens ride after the noise tokens and their predictions are dropped."""
    tokens = x.shape[1]
    hidden = x if layout.reference is None else torch.cat([x, layout.reference], dim=1)
    hidden = dit.img_in(hidden)
    timestep = t[:1].to(hidden.dtype)  # one row for all: see "Batch rows" in the module docstring
    zero_cond = layout.modulate_index is not None
    if zero_cond:
        timestep = torch.cat([timestep, timestep * 0], dim=0)
    text = dit.txt_in(dit.txt_norm(layout.text))
    temb = dit.time_text_embed(timestep, hidden)
    rotary = (layout.image_freqs, layout.text_freqs)
    with row_groups_installed(dit, row_groups(layout.text_lengths)):
        for block in dit.transformer_blocks:
            text, hidden = block(hidden_states=hidden, encoder_hidden_states=text, encoder_hidden_states_mask=None,
                                 temb=temb, image_rotary_emb=rotary, joint_attention_kwargs={},
                                 modulate_index=layout.modulate_index)
    if zero_cond:
        temb = temb.chunk(2, dim=0)[0]
    out = dit.proj_out(dit.norm_out(hidden, temb))
    return out[:, :tokens]

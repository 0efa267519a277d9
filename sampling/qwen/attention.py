"""Joint attention of Qwen-Image's blocks over rows whose prompts differ in length, without a padding mask.

Invariant: with :class:`RowGroupAttnProcessor` installed, a transformer call on rows whose text is zero-padded to a
common length gives every row what diffusers' ``QwenDoubleStreamAttnProcessor2_0`` gives that row alone, unpadded.
Rows are grouped by their real text length (``RowGroup``: a contiguous range of rows and their length ``L``); each
group attends over its joint sequence ``[every image token, its first L text tokens]`` with unmasked SDPA. Text
slots past a row's length get zeros: no real token ever reads them (attention reads only the first ``L`` keys, the
rest of the block acts per token) and the model's output is the image tokens alone. Projections, q/k norms and the
rotary embedding run on the whole padded batch through the modules' own ``__call__`` (LoRA terms and fp8 weight
storage apply); the first ``L`` text positions get the rotary angles the unpadded call gives them.

Why the image tokens come first (diffusers orders ``[text, image]``): the projections are joined once per block as
``[image, all text slots]``, so each group's sequence is a prefix of every row, a view SDPA reads in place; under
``torch.compile`` the join is written by the kernel that applies the norm and rotary embedding, so no copy of q or k
is left. Softmax attention does not depend on the order of its keys; only the summation's rounding moves. The rotary
embedding is written in real arithmetic (``_rotary``): complex multiplication falls out of inductor's fused kernels
into three passes over a float32 copy of q and k.

Why not SDPA with a key-padding mask (what the diffusers processor does with ``encoder_hidden_states_mask``): on
Hopper that runs cuDNN's attention with a bias, measurably slower than the unmasked kernel at the sizes
Qwen-Image runs (thousands of image tokens), and batching the guided rows (so streamed weights cross once a step)
must not cost more than the two separate calls the pipeline makes. One processor object serves a model for
good (``row_groups_installed`` swaps its groups), and the per-group attention, the only code that reads them, is left
out of ``torch.compile`` regions: a new prompt length recompiles nothing (a CUDA graph, which bakes the slices in,
is captured per lengths).
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class RowGroup:
    """Rows ``start:stop`` of a call, whose prompts have ``length`` real text tokens (padding after them)."""
    start: int
    stop: int
    length: int


def row_groups(lengths: Sequence[int]) -> tuple[RowGroup, ...]:
    """Runs of equal consecutive lengths as groups: ``[5, 5, 3]`` -> rows 0:2 of length 5, row 2 of length 3."""
    if not lengths:
        raise ValueError("lengths: expected one text length per row, got none")
    groups, start = [], 0
    for i in range(1, len(lengths) + 1):
        if i == len(lengths) or lengths[i] != lengths[start]:
            if int(lengths[start]) < 1:
                raise ValueError(f"lengths[{start}]={lengths[start]!r}: every row needs at least one text token")
            groups.append(RowGroup(start, i, int(lengths[start])))
            start = i
    return tuple(groups)


def _rotary(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """diffusers' ``apply_rotary_emb_qwen(x, freqs, use_real=False)`` on ``[B, S, H, D]`` with ``freqs`` ``[S, D/2]``
    complex: each pair ``(a, b)`` of ``x`` times its angle ``(c, s)`` in float32, ``(a c - b s, a s + b c)``, back
    to ``x``'s dtype. Eagerly as a complex product (three passes); under ``torch.compile`` in real arithmetic, which
    inductor fuses into the kernel that writes q or k (module docstring)."""
    if not torch.compiler.is_compiling():
        z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(z * freqs.unsqueeze(1)).flatten(3).type_as(x)
    cs = torch.view_as_real(freqs).unsqueeze(1)  # [S, 1, D/2, 2]: over the heads
    cos = cs[..., 0].repeat_interleave(2, dim=-1)  # c c per pair
    sin = torch.stack([-cs[..., 1], cs[..., 1]], dim=-1).flatten(-2)  # -s s per pair
    xf = x.float()
    swapped = xf.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)  # (b, a) per pair
    return (xf * cos + swapped * sin).type_as(x)


def _grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, image_tokens: int,
                       processor: "RowGroupAttnProcessor") -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Per group, in row order: ``(text outs [rows, T, H*D], image outs [rows, N, H*D])`` from joint
    ``[B, N + T, H, D]`` projections laid out as ``[image, text slots]`` (module docstring). The caller joins the
    groups, so that under ``torch.compile`` the join is written by the next projection's input kernel."""
    groups, batch, seq_txt = processor.groups, q.shape[0], q.shape[1] - image_tokens
    if not groups or groups[0].start != 0 or groups[-1].stop != batch or any(
            a.stop != b.start for a, b in zip(groups, groups[1:])):
        raise ValueError(f"row groups {groups} do not cover the call's {batch} rows in order")
    txt_parts, img_parts = [], []
    for g in groups:
        end = image_tokens + g.length
        out = F.scaled_dot_product_attention(*(t[g.start:g.stop, :end].transpose(1, 2) for t in (q, k, v)))
        out = out.transpose(1, 2).flatten(2, 3).to(q.dtype)
        img_parts.append(out[:, :image_tokens])
        txt_parts.append(F.pad(out[:, image_tokens:], (0, 0, 0, seq_txt - g.length)))
    return tuple(txt_parts), tuple(img_parts)


def _joined(parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return (parts[0] if len(parts) == 1 else torch.cat(parts)).contiguous()


class RowGroupAttnProcessor:
    """Drop-in for diffusers' ``QwenDoubleStreamAttnProcessor2_0`` over rows grouped by text length (module
    docstring); ``encoder_hidden_states_mask`` is ignored: the groups say which text slots are real."""

    def __init__(self, groups: Sequence[RowGroup] = ()):
        self.groups = tuple(groups)
        # wrapped here, not at import: torch.compiler.disable imports dynamo, which sets process-wide state
        self._attend = torch.compiler.disable(_grouped_attention)

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor = None,
                 encoder_hidden_states_mask=None, attention_mask=None, image_rotary_emb=None):
        if encoder_hidden_states is None or attention_mask is not None:
            raise ValueError("RowGroupAttnProcessor takes the text stream and no external attention_mask")
        head_dim = attn.inner_dim // attn.heads
        img = [p(hidden_states).unflatten(-1, (-1, head_dim)) for p in (attn.to_q, attn.to_k, attn.to_v)]
        txt = [p(encoder_hidden_states).unflatten(-1, (-1, head_dim))
               for p in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)]
        for group, index, norm in ((img, 0, attn.norm_q), (img, 1, attn.norm_k), (txt, 0, attn.norm_added_q),
                                   (txt, 1, attn.norm_added_k)):
            if norm is not None:
                group[index] = norm(group[index])
        if image_rotary_emb is not None:
            img_freqs, txt_freqs = image_rotary_emb
            img[:2] = [_rotary(t, img_freqs) for t in img[:2]]
            txt[:2] = [_rotary(t, txt_freqs) for t in txt[:2]]
        joint = [torch.cat([i, t], dim=1) for i, t in zip(img, txt)]  # [image, text slots]: module docstring
        txt_parts, img_parts = self._attend(*joint, hidden_states.shape[1], self)
        img_out = attn.to_out[0](_joined(img_parts))
        if len(attn.to_out) > 1:
            img_out = attn.to_out[1](img_out)
        return img_out, attn.to_add_out(_joined(txt_parts))


_PROCESSORS: "weakref.WeakKeyDictionary[torch.nn.Module, RowGroupAttnProcessor]" = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def row_groups_installed(dit: torch.nn.Module, groups: Sequence[RowGroup]) -> Iterator[None]:
    """Every block's attention runs ``dit``'s one :class:`RowGroupAttnProcessor`, set to ``groups``, inside the
    block; the previous processors and groups come back on exit (the model stays usable by diffusers' pipelines)."""
    processor = _PROCESSORS.setdefault(dit, RowGroupAttnProcessor())
    attns = [block.attn for block in dit.transformer_blocks]
    previous, previous_groups = [a.processor for a in attns], processor.groups
    try:
        processor.groups = tuple(groups)
        for a in attns:
            a.processor = processor
        yield
    finally:
        processor.groups = previous_groups
        for a, p in zip(attns, previous):
            a.processor = p

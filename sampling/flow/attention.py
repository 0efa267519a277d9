"""Attention of Z-Image's blocks for the flow sampler: diffusers' ``ZSingleStreamAttnProcessor`` math with fused
q/k norms, attending through PyTorch's SDPA under the caption slots' key-padding mask.

Invariants
- ``ZImageAttnProcessor`` computes what diffusers' processor computes: projections through the modules' own
  ``__call__`` (so LoRA terms and fp8 weight storage apply), RMS q/k norms (``rms_norm``: one fused kernel where
  the dtypes allow, the module otherwise), RoPE in float32, then ``scaled_dot_product_attention`` with the boolean
  mask (``None`` where no slot is masked).
- Why SDPA with the mask: on Hopper it runs cuDNN's attention with a bias, which measured faster than flash
  attention's variable-length form (the only masked kernels PyTorch offers; its cuDNN ragged form re-plans every
  call and cannot be captured).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    """diffusers' ``RMSNorm`` ``norm(x)`` as one fused op where the dtypes allow (else the module itself)."""
    weight = getattr(norm, "weight", None)
    if getattr(norm, "bias", None) is not None or (weight is not None and weight.dtype != x.dtype):
        return norm(x)
    return F.rms_norm(x, (x.shape[-1],), weight, norm.eps)


def _rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """diffusers' Z-Image rotary embedding: complex multiply in float32, back to ``x``'s dtype."""
    z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(z * freqs.unsqueeze(2)).flatten(3).type_as(x)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Attention of [B, L, H, D] tensors under an optional [B, L] key-padding mask; returns [B, L, H, D]."""
    attn_mask = None if mask is None else mask[:, None, None, :]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_mask)
    return out.transpose(1, 2)


class ZImageAttnProcessor:
    """Drop-in for diffusers' ``ZSingleStreamAttnProcessor`` (module docstring)."""

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states=None,
                 attention_mask: Optional[torch.Tensor] = None, freqs_cis: Optional[torch.Tensor] = None):
        q = attn.to_q(hidden_states).unflatten(-1, (attn.heads, -1))
        k = attn.to_k(hidden_states).unflatten(-1, (attn.heads, -1))
        v = attn.to_v(hidden_states).unflatten(-1, (attn.heads, -1))
        if attn.norm_q is not None:
            q = rms_norm(q, attn.norm_q)
        if attn.norm_k is not None:
            k = rms_norm(k, attn.norm_k)
        if freqs_cis is not None:
            q, k = _rope(q, freqs_cis), _rope(k, freqs_cis)
        out = masked_attention(q, k, v, attention_mask).flatten(2, 3).to(q.dtype)
        return attn.to_out[0](out)

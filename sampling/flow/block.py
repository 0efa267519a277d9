"""A lean forward for Z-Image's transformer blocks: the same math as diffusers' ``ZImageTransformerBlock.forward``
with fewer passes over the activations, for the CUDA-graph path (where launch gaps are gone and memory traffic
around the GEMMs is what remains).

Invariants
- Same result as the block's own forward (fp32: to rounding; bf16: within bf16 rounding), from the block's own
  modules: Linear layers and the feed-forward are called through ``__call__`` (so LoRA terms, fp8 weight storage
  and any hook on them still apply), attention through the module (``attention.ZImageAttnProcessor``).
- Differences are fusions only: RMSNorm is ``torch.nn.functional.rms_norm`` (one fused kernel on CUDA instead of
  diffusers' five), ``x + tanh(g) * norm(y)`` is one ``addcmul``, the modulation ``norm(x) * (1 + s)`` keeps
  ``1 + s`` on the [B, 1, dim] vector.
- ``installed(dit)`` swaps every block's ``forward`` and every attention module's processor for the duration of a
  call only; hooks on the block modules (a streaming policy's) still fire, since callers go through ``__call__``.
"""
from __future__ import annotations

import contextlib
import types
from typing import Iterator, Optional

import torch

from .attention import ZImageAttnProcessor, rms_norm

_PROCESSOR = ZImageAttnProcessor()


def lean_block_forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor], freqs_cis: torch.Tensor,
                       adaln_input: Optional[torch.Tensor] = None, noise_mask=None, adaln_noisy=None,
                       adaln_clean=None) -> torch.Tensor:
    """``ZImageTransformerBlock.forward`` without per-token modulation (the text-to-image path)."""
    if noise_mask is not None:
        raise ValueError("the lean block forward runs text-to-image blocks only (no per-token noise mask)")
    if self.modulation:
        scale_msa, gate_msa, scale_mlp, gate_mlp = self.adaLN_modulation(adaln_input).unsqueeze(1).chunk(4, dim=2)
        attn = self.attention(rms_norm(x, self.attention_norm1) * (1.0 + scale_msa), attention_mask=attn_mask,
                              freqs_cis=freqs_cis)
        x = torch.addcmul(x, gate_msa.tanh(), rms_norm(attn, self.attention_norm2))
        ff = self.feed_forward(rms_norm(x, self.ffn_norm1) * (1.0 + scale_mlp))
        return torch.addcmul(x, gate_mlp.tanh(), rms_norm(ff, self.ffn_norm2))
    attn = self.attention(rms_norm(x, self.attention_norm1), attention_mask=attn_mask, freqs_cis=freqs_cis)
    x = x + rms_norm(attn, self.attention_norm2)
    return x + rms_norm(self.feed_forward(rms_norm(x, self.ffn_norm1)), self.ffn_norm2)


@contextlib.contextmanager
def installed(dit: torch.nn.Module) -> Iterator[None]:
    """Inside the block, the DiT's blocks run ``lean_block_forward`` and its attention modules
    ``ZImageAttnProcessor``; both are restored after."""
    blocks = [b for group in (dit.noise_refiner, dit.context_refiner, dit.layers) for b in group]
    attentions = [b.attention for b in blocks]
    processors = [a.processor for a in attentions]
    try:
        for block in blocks:
            block.forward = types.MethodType(lean_block_forward, block)
        for a in attentions:
            a.processor = _PROCESSOR
        yield
    finally:
        for block in blocks:
            block.__dict__.pop("forward", None)
        for a, p in zip(attentions, processors):
            a.processor = p

"""Attention of Z-Image's blocks with a key-padding mask, at flash-attention speed on the GPU.

The static caption buffers of ``dit_forward`` end in slots no token may attend to, so every masked call would
send PyTorch's SDPA to its slower masked kernels (flash attention takes no mask). Here the mask is always a
key-padding mask whose visible keys are each row's *first* ``n_i`` slots, so the same result comes from flash
attention's variable-length form: row ``i`` of length ``L`` becomes two segments, its first ``n_i`` tokens
(attending among themselves, exactly the masked attention's rows) and the masked tail (attending among
themselves, rows nobody reads). The segment boundaries are computed on the device from the mask, and the maximum
segment length is ``L``, so shapes never change and the call is CUDA-graph capturable.

Invariants
- ``ZImageAttnProcessor`` computes what diffusers' ``ZSingleStreamAttnProcessor`` computes (projections through
  the modules' own ``__call__``, so LoRA hooks apply; RMS q/k norms; RoPE in float32), then attends through
  ``masked_attention``.
- ``masked_attention`` equals SDPA with the boolean mask on every row a caller reads. It takes the varlen flash
  path on CUDA for fp16/bf16 once ``prepare_attention`` found ``torch.ops.aten._flash_attention_forward`` running
  there and agreeing with SDPA on a small case; else SDPA with the mask (the CPU, fp32, an unprepared device).
- ``installed(dit)`` swaps the processors of the DiT's attention modules for the duration of a call only.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

_FLASH_OK: dict = {}


def _segments(mask: torch.Tensor) -> torch.Tensor:
    """int32 cumulative boundaries ``[0, n_0, L, L + n_1, 2L, ...]`` of the visible heads and masked tails."""
    rows, length = mask.shape
    visible = mask.sum(dim=1, dtype=torch.int32)
    starts = torch.arange(rows, device=mask.device, dtype=torch.int32) * length
    bounds = torch.stack([starts, starts + visible], dim=1).reshape(-1)
    end = torch.full((1,), rows * length, device=mask.device, dtype=torch.int32)
    return torch.cat([bounds, end])


def _flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q, k, v: [B, L, H, D]; returns [B, L, H, D]."""
    b, length, heads, dim = q.shape
    bounds = _segments(mask)
    out = torch.ops.aten._flash_attention_forward(
        q.reshape(b * length, heads, dim), k.reshape(b * length, heads, dim), v.reshape(b * length, heads, dim),
        bounds, bounds, length, length, 0.0, False, False)[0]
    return out.reshape(b, length, heads, dim)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    attn_mask = None if mask is None else mask[:, None, None, :]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_mask)
    return out.transpose(1, 2)


def prepare_attention(device: torch.device, dtype: torch.dtype) -> bool:
    """Decide once per device and dtype whether ``masked_attention`` may take the varlen flash path; call it
    before a capture or a compile (the check synchronises, so it must not run inside either)."""
    device = torch.device(device)
    key = (device, dtype)
    if key not in _FLASH_OK:
        eligible = device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
        _FLASH_OK[key] = eligible and _probe(device, dtype)
    return _FLASH_OK[key]


def _probe(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the varlen flash path runs here and matches SDPA (one small case, before any capture uses it)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(2, 96, 2, 64, generator=g).to(device, dtype) for _ in range(3))
    mask = torch.zeros(2, 96, dtype=torch.bool, device=device)
    mask[0, :40] = True
    mask[1, :] = True
    try:
        fast = _flash_varlen(q, k, v, mask)
    except (RuntimeError, NotImplementedError) as exc:
        logger.info("flash attention's variable-length form is not available here (%s); masked attention uses "
                    "SDPA", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return False
    ref = _sdpa(q.float(), k.float(), v.float(), mask)
    err = (fast.float()[0, :40] - ref[0, :40]).abs().max().item() + (fast.float()[1] - ref[1]).abs().max().item()
    if err > 0.05:
        logger.warning("flash varlen attention disagrees with SDPA (%.3g); masked attention uses SDPA", err)
        return False
    return True


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Attention of [B, L, H, D] tensors under an optional [B, L] key-padding mask (module docstring)."""
    if mask is not None and _FLASH_OK.get((q.device, q.dtype), False):
        return _flash_varlen(q.contiguous(), k.contiguous(), v.contiguous(), mask)
    return _sdpa(q, k, v, mask)


def _rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """diffusers' Z-Image rotary embedding: complex multiply in float32, back to ``x``'s dtype."""
    z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(z * freqs.unsqueeze(2)).flatten(3).type_as(x)


class ZImageAttnProcessor:
    """Drop-in for diffusers' ``ZSingleStreamAttnProcessor`` whose attention is ``masked_attention``."""

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states=None,
                 attention_mask: Optional[torch.Tensor] = None, freqs_cis: Optional[torch.Tensor] = None):
        q = attn.to_q(hidden_states).unflatten(-1, (attn.heads, -1))
        k = attn.to_k(hidden_states).unflatten(-1, (attn.heads, -1))
        v = attn.to_v(hidden_states).unflatten(-1, (attn.heads, -1))
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        if freqs_cis is not None:
            q, k = _rope(q, freqs_cis), _rope(k, freqs_cis)
        out = masked_attention(q, k, v, attention_mask).flatten(2, 3).to(q.dtype)
        return attn.to_out[0](out)


_PROCESSOR = ZImageAttnProcessor()


@contextlib.contextmanager
def installed(dit: torch.nn.Module) -> Iterator[None]:
    """The DiT's attention modules use ``ZImageAttnProcessor`` inside the block, their own processor after."""
    modules = [m for m in dit.modules() if hasattr(m, "processor") and hasattr(m, "to_q")]
    previous = [m.processor for m in modules]
    try:
        for m in modules:
            m.processor = _PROCESSOR
        yield
    finally:
        for m, p in zip(modules, previous):
            m.processor = p

"""Decoding exponent-coded 16-bit words (``memory/packed_weights.py`` owns the format): the lossless inverse of its
packing, run on the GPU into a streamed unit's staging slot.

Format (``n`` words, ``CHUNK`` words per chunk; every section a flat tensor):

    sm       uint8[n]           bit 7 = the word's bit 15 (sign), bits 0-6 = its bits 0-6 (bf16: the mantissa)
    planes   uint8[3, n/8]      the 3-bit exponent code of word i: bit (i % 8) of byte i // 8 of plane b is code bit b
    offsets  int32[ceil(n/CHUNK)]  escapes before each chunk (exclusive prefix count)
    escapes  uint8[m]           the 8-bit exponent field (bits 7-14) of every word whose code is 0, in word order

    code c in 1..7:  exponent field = base + c
    code 0:          exponent field = the next byte of ``escapes`` (zeros, subnormals, inf/nan, out-of-window values)
    word = sign << 15 | exponent << 7 | mantissa

Invariant: ``unpack_words`` writes exactly the words the packer read (bit for bit), whichever implementation runs:
the Triton kernel ranks a chunk's escapes with an in-block prefix sum from ``offsets``, the reference reads the
escape stream in one global order. Why hand-written: no library decodes a per-word variable exponent stream on the
GPU inside a CUDA graph; lossless compressors (nvCOMP, zstd) would take the copy engine's bytes through a host sync
or a separate API that a captured forward cannot call. Nothing here synchronises with the host, so a decode is
capturable; it runs on whatever stream is current (the streamer's copy stream).

Three implementations with one signature: ``unpack_triton`` (the kernel), ``unpack_reference`` (plain torch) and
``unpack_words`` (dispatcher: Triton for CUDA tensors on a GPU Triton supports, the reference elsewhere;
``LEANDIFFUSION_BF16_UNPACK`` = ``reference`` | ``triton`` | ``auto`` overrides, and ``impl=`` overrides both).
"""
# No ``from __future__ import annotations``: see kernels/flow_euler_cfg.py (the Triton interpreter reads
# ``tl.constexpr`` annotations evaluated).
import torch

from . import dispatch

IMPL = dispatch.KernelChoice("LEANDIFFUSION_BF16_UNPACK")
CHUNK = 1024  # words per escape offset, and per Triton program
CODE_BITS = 3

try:  # Triton is optional: without it every call takes the reference path
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None


def _check(sm: torch.Tensor, planes: torch.Tensor, offsets: torch.Tensor, escapes: torch.Tensor, base: int,
           out: torch.Tensor) -> int:
    """Validate the sections against ``out`` (int16 [n]); return n."""
    if out.dtype != torch.int16 or out.dim() != 1:
        raise ValueError(f"out must be a 1-D int16 tensor (the slot's words), got {out.dtype} {tuple(out.shape)}")
    n = out.numel()
    expected = {"sm": (sm, torch.uint8, (n,)), "planes": (planes, torch.uint8, (CODE_BITS, (n + 7) // 8)),
                "offsets": (offsets, torch.int32, ((n + CHUNK - 1) // CHUNK,))}
    for name, (t, dtype, shape) in expected.items():
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise ValueError(f"{name} must be {dtype} of shape {shape} for {n} words, got {t.dtype} {tuple(t.shape)}")
    if escapes.dtype != torch.uint8 or escapes.dim() != 1:
        raise ValueError(f"escapes must be a 1-D uint8 tensor, got {escapes.dtype} {tuple(escapes.shape)}")
    if not 0 <= int(base) <= 255 - (1 << CODE_BITS) + 1:
        raise ValueError(f"base={base!r}: the exponent window base + 1 .. base + 7 must lie in 1..255")
    for name, t in (("sm", sm), ("planes", planes), ("offsets", offsets), ("escapes", escapes)):
        if t.device != out.device:
            raise ValueError(f"{name} is on {t.device} but out is on {out.device}; move it to one device")
    return n


def unpack_reference(sm: torch.Tensor, planes: torch.Tensor, offsets: torch.Tensor, escapes: torch.Tensor, base: int,
                     out: torch.Tensor) -> torch.Tensor:
    """Plain-torch decode (module docstring); writes and returns ``out``. ``offsets`` is validated, not read: the
    escape stream is consumed in word order (a gather at each escape's global rank: no host sync, capturable)."""
    n = _check(sm, planes, offsets, escapes, base, out)
    if n == 0:
        return out
    shifts = torch.arange(8, device=out.device, dtype=torch.int32)
    bits = (planes.to(torch.int32).unsqueeze(-1) >> shifts) & 1  # [3, n/8, 8]
    code = (bits[0] | (bits[1] << 1) | (bits[2] << 2)).flatten()[:n]
    exponent = code + int(base)
    if escapes.numel():
        escaped = code == 0
        rank = (torch.cumsum(escaped.to(torch.int64), 0) - 1).clamp_(0, escapes.numel() - 1)
        exponent = torch.where(escaped, escapes.to(torch.int32)[rank], exponent)
    s = sm.to(torch.int32)
    word = ((s & 0x80) << 8) | (exponent << 7) | (s & 0x7F)
    out.copy_(torch.where(word >= 0x8000, word - 0x10000, word).to(torch.int16))
    return out


if triton is not None:

    @triton.jit
    def _unpack_kernel(sm_ptr, planes_ptr, offsets_ptr, escapes_ptr, out_ptr, n, n8, base, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        s = tl.load(sm_ptr + offs, mask=mask, other=0).to(tl.int32)
        byte = offs // 8
        bit = (offs % 8).to(tl.int32)
        b0 = (tl.load(planes_ptr + byte, mask=mask, other=0).to(tl.int32) >> bit) & 1
        b1 = (tl.load(planes_ptr + n8 + byte, mask=mask, other=0).to(tl.int32) >> bit) & 1
        b2 = (tl.load(planes_ptr + 2 * n8 + byte, mask=mask, other=0).to(tl.int32) >> bit) & 1
        code = b0 | (b1 << 1) | (b2 << 2)
        escaped = (code == 0) & mask
        flag = escaped.to(tl.int32)
        rank = tl.cumsum(flag, axis=0) - flag
        start = tl.load(offsets_ptr + pid).to(tl.int64)
        esc = tl.load(escapes_ptr + start + rank, mask=escaped, other=0).to(tl.int32)
        exponent = tl.where(escaped, esc, code + base)
        word = ((s & 0x80) << 8) | (exponent << 7) | (s & 0x7F)
        word = tl.where(word >= 0x8000, word - 0x10000, word)
        tl.store(out_ptr + offs, word.to(tl.int16), mask=mask)


def unpack_triton(sm: torch.Tensor, planes: torch.Tensor, offsets: torch.Tensor, escapes: torch.Tensor, base: int,
                  out: torch.Tensor) -> torch.Tensor:
    """The Triton kernel (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``). Same contract as the reference."""
    if triton is None:
        raise RuntimeError("unpack_triton needs the 'triton' package; install triton or use unpack_reference")
    n = _check(sm, planes, offsets, escapes, base, out)
    tensors = (sm, planes, offsets, escapes, out)
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("unpack_triton needs contiguous tensors; call .contiguous() or use unpack_reference")
    if n == 0:
        return out
    # an empty escape stream still needs a valid pointer: no lane reads it (every load of it is masked off)
    esc = escapes if escapes.numel() else sm
    _unpack_kernel[(triton.cdiv(n, CHUNK),)](sm, planes, offsets, esc, out, n, planes.shape[1], int(base),
                                             BLOCK=CHUNK)
    return out


def _triton_usable(tensors) -> bool:
    return (triton is not None and all(t.is_cuda and t.is_contiguous() for t in tensors)
            and dispatch.triton_unusable_reason(tensors[0].device) is None)


def unpack_words(sm: torch.Tensor, planes: torch.Tensor, offsets: torch.Tensor, escapes: torch.Tensor, base: int,
                 out: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """Dispatcher: the Triton kernel for contiguous CUDA tensors on a GPU Triton supports, the torch reference
    elsewhere. ``impl="triton"`` forces the kernel (CPU tensors then need ``TRITON_INTERPRET=1``), ``"reference"``
    the reference; ``"auto"`` follows ``$LEANDIFFUSION_BF16_UNPACK`` and then the rule above."""
    args = (sm, planes, offsets, escapes, base, out)
    if IMPL.pick(impl, lambda: _triton_usable((sm, planes, offsets, escapes, out))) == "triton":
        return unpack_triton(*args)
    return unpack_reference(*args)

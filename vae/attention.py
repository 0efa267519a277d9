"""The VAE's single-head spatial self-attention, run on the whole feature map, with bounded memory.

Invariant: ``run_attention(spec, x)`` equals the original block's forward on ``x`` (diffusers ``Attention`` with
``residual_connection`` or ComfyUI/LDM ``AttnBlock``), up to floating-point error:
    h = GroupNorm(x);  q, k, v = Wq h, Wk h, Wv h  (per pixel);  o = softmax(q k^T / sqrt(d)) v;
    out = (x + Wo o) / rescale
Attention is global, so tiles cannot compute it; it runs untiled at the block's resolution (1/8 of the image for
the SD VAE's mid block; the exact tiled executor runs it in bands instead, ``attention_bands``). Memory: on CUDA,
PyTorch's memory-efficient/flash kernels keep it O(N); where none applies (the CPU, odd head sizes) the queries are
processed in chunks so the score matrix held at once is ``chunk x N`` instead of ``N x N`` - exact, because softmax
rows are independent. With ``tf32`` (the
untiled decode, ``vae.untiled``, passes ``tf32_like_convolutions(x)``: an fp32 map on CUDA whose VAE convolutions
already run in TF32; the tiled executor bands the block instead, ``vae.attention_bands``) the CUDA path takes those
chunks too, with the two score matmuls on TF32 tensor cores: PyTorch's fp32 attention kernels have no TF32 path,
and in strict fp32 the mid-block attention is a sixth of an SDXL decode.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

# the fix every refusal of an unsupported VAE architecture names (adapters.py builds the programs)
NEEDS_COMFYUI = "this VAE needs ComfyUI's own VAE Decode (Tiled) / VAE Encode (Tiled)"

_SCORE_BYTES = 256 * 2**20  # cap on one chunk's fp32 score matrix on the fallback path


@dataclass(frozen=True, eq=False)
class AttentionSpec:
    norm: Any  # GroupNorm module applied to the [B, C, H, W] input (or, ``pointwise_norm``, a per-pixel norm)
    q: Callable
    k: Callable
    v: Callable
    out: Callable  # each maps [B, N, C] -> [B, N, C']
    heads: int = 1
    rescale: float = 1.0
    # ``norm`` normalises each pixel over its channels (Wan-style RMS norm, ``causal3d.py``): bands call it as it is,
    # with no whole-map statistics
    pointwise_norm: bool = False


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tf32: bool = False) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v for [B, h, N, d] tensors, never materialising N x N scores at once.

    ``tf32`` (CUDA fp32 only): the query chunks' two matmuls run on TF32 tensor cores (``tf32_matmuls``) instead
    of PyTorch's fp32 memory-efficient kernel, which has no TF32 path.
    """
    tf32 = tf32 and q.is_cuda and q.dtype == torch.float32
    if q.is_cuda and not tf32:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        try:
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
                return F.scaled_dot_product_attention(q, k, v)
        except RuntimeError as exc:  # only "no kernel for these inputs" falls through to chunks
            if "No available kernel" not in str(exc):
                raise
    n = k.shape[-2]
    chunk = max(1, min(q.shape[-2], _SCORE_BYTES // max(1, 4 * n * q.shape[0] * q.shape[1])))
    with contextlib.ExitStack() as scope:
        if tf32:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            scope.enter_context(sdpa_kernel([SDPBackend.MATH]))
            scope.enter_context(tf32_matmuls())
        outs = [F.scaled_dot_product_attention(q[..., i:i + chunk, :], k, v) for i in range(0, q.shape[-2], chunk)]
    return torch.cat(outs, dim=-2)


@contextlib.contextmanager
def tf32_matmuls() -> Iterator[None]:
    """fp32 matmuls on TF32 tensor cores inside the block, PyTorch's previous setting restored after it.

    Uses PyTorch's ``fp32_precision`` API where it exists (set and restored; reading the legacy ``allow_tf32`` flag
    while the new one is set raises in PyTorch >= 2.9, so nothing else may run inside the block -- the host is
    single-threaded); PyTorch < 2.9 has only the legacy flag, which is set and restored instead (the tiled
    executor's online attention enters this block for every fp16 / bf16 map on CUDA, whatever the convolutions do).
    """
    matmul = torch.backends.cuda.matmul
    name, value = ("fp32_precision", "tf32") if hasattr(matmul, "fp32_precision") else ("allow_tf32", True)
    old = getattr(matmul, name)
    setattr(matmul, name, value)
    try:
        yield
    finally:
        setattr(matmul, name, old)


def convolutions_use_tf32() -> bool:
    """Whether PyTorch runs fp32 cuDNN convolutions in TF32 (its default; users can turn it off)."""
    conv = getattr(torch.backends.cudnn, "conv", None)
    return conv is not None and getattr(conv, "fp32_precision", None) == "tf32"


def tf32_like_convolutions(x: torch.Tensor) -> bool:
    """Whether an attention block on ``x`` takes TF32 score matmuls: a CUDA fp32 map in a VAE whose fp32
    convolutions already run in TF32, so the block rounds no coarser than the convolutions around it."""
    return x.is_cuda and x.dtype == torch.float32 and convolutions_use_tf32()


def run_attention(spec: AttentionSpec, x: torch.Tensor, tf32: bool = False) -> torch.Tensor:
    """The attention block's output for the whole map ``x`` [B, C, H, W] (see the module docstring); ``tf32``: see
    ``_sdpa``. A channels-last ``x`` gives a channels-last output (no layout copy)."""
    b, c, h, w = x.shape
    hs = spec.norm(x).flatten(2).transpose(1, 2)  # [B, N, C]
    q, k, v = spec.q(hs), spec.k(hs), spec.v(hs)
    del hs

    def split(t):
        return t.reshape(b, h * w, spec.heads, -1).transpose(1, 2)

    o = _sdpa(split(q), split(k), split(v), tf32)
    del q, k, v
    o = spec.out(o.transpose(1, 2).reshape(b, h * w, -1))
    o = o.transpose(1, 2).reshape(b, -1, h, w)
    return (x + o) / spec.rescale if spec.rescale != 1.0 else x + o


def _conv1x1_tokens(conv) -> Callable:
    """A 1x1 convolution module applied to tokens [B, N, C] (through the module, so ComfyUI's casting works)."""

    def apply(t: torch.Tensor) -> torch.Tensor:
        b, n, c = t.shape
        y = conv(t.transpose(1, 2).reshape(b, c, n, 1))
        return y.reshape(b, -1, n).transpose(1, 2)

    return apply


def spec_from_ldm(block) -> AttentionSpec:
    """ComfyUI / LDM ``AttnBlock`` (norm, q, k, v, proj_out as 1x1 convolutions; one head)."""
    return AttentionSpec(block.norm, _conv1x1_tokens(block.q), _conv1x1_tokens(block.k),
                         _conv1x1_tokens(block.v), _conv1x1_tokens(block.proj_out), heads=1)


def spec_from_diffusers(attn, where: str = "") -> AttentionSpec:
    """diffusers ``Attention`` as the VAE uses it (group_norm, to_q/k/v, to_out, residual connection)."""
    unsupported = [name for name in ("spatial_norm", "norm_q", "norm_k", "norm_cross")
                   if getattr(attn, name, None) is not None]
    if not getattr(attn, "residual_connection", False):
        unsupported.append("no residual connection")
    if attn.group_norm is None:
        unsupported.append("no group_norm")
    if unsupported:
        raise TypeError(f"unsupported VAE attention block{f' at {where}' if where else ''} ({type(attn).__name__}: "
                        f"{', '.join(unsupported)}); {NEEDS_COMFYUI}")
    return AttentionSpec(attn.group_norm, attn.to_q, attn.to_k, attn.to_v, attn.to_out[0], heads=int(attn.heads),
                         rescale=float(getattr(attn, "rescale_output_factor", 1.0)))

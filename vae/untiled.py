"""The untiled VAE decode and encode that the engine and the Stream Scheduler run: diffusers' ``AutoencoderKL`` on
one whole image, with three changes for the length of one call that make it faster without changing the picture.

Invariants
- ``decode(vae, raw)`` equals ``vae.decode(raw).sample`` of the unpatched model, and ``encode(vae, x)`` its
  ``latent_dist.mean``, up to the rounding the model already has: plain fp32 rounding on the CPU (tests: within
  1e-4 of the plain calls and no farther from an fp64 run than they are); on CUDA, the rounding of the precision
  PyTorch already gives the decode's fp32 convolutions (TF32 unless a user turned it off), which the attention's
  score matmuls then share.
- The changes live only inside ``fast_vae(vae)``: ``vae.group_norm.parallel_group_norms``, and each attention
  block's processor swapped for one that runs ``vae.attention.run_attention`` (TF32 score matmuls for an fp32
  VAE whose convolutions run in TF32; PyTorch's own kernels otherwise). Both are restored when the block ends,
  also on error or interruption; the module's weights, buffers and processors are never changed for anyone else.
- On CUDA the input is made channels-last, so every convolution (and the GroupNorms, the upsamplers and the
  residual adds between them) stays in cuDNN's native NHWC layout (with NCHW activations cuDNN transposes around
  each fp32 convolution). The output comes back channels-last, so the IMAGE's ``[B, H, W, 3]`` view of it is
  contiguous. On the CPU the input is made contiguous NCHW (an IMAGE's ``permute`` is a channels-last view), because
  PyTorch's CPU GroupNorm is inaccurate on channels-last inputs (``group_norm.cpu_layout_safe``, which also covers
  maps that turn channels-last inside the VAE).
- A Wan-style causal 3D VAE (``AutoencoderKLQwenImage``, ``causal3d.is_causal3d``) takes ``[B, C, T, H, W]``: an
  image goes in as one frame (``T = 1``) and comes back as ``[B, C, H, W]``; it has no GroupNorm or diffusers
  attention block, so ``fast_vae`` changes nothing in it.
- ``vae_decode(engine, raw)`` / ``vae_encode(engine, image)``: the engine's whole-image calls between ComfyUI's
  IMAGE (``[B, H, W, 3]`` float32 0..1 on the CPU) and raw LATENT; call inside ``engine.session("vae")``.

Why hand-written: no library offers these swaps; diffusers' ``enable_tiling`` / ``enable_slicing`` trade speed for
memory, the opposite direction.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from ..memory.engine import LeanEngine
from .attention import AttentionSpec, run_attention, spec_from_diffusers, tf32_like_convolutions
from .causal3d import is_causal3d
from .group_norm import parallel_group_norms


class _RunAttentionProcessor:
    """A diffusers attention processor for one VAE self-attention block: ``run_attention`` on the whole map, with
    the block's ``AttentionSpec`` built once. Calls it cannot serve (cross-attention, masks, a time embedding) go to
    the block's own processor."""

    def __init__(self, original, spec: AttentionSpec):
        self.original = original
        self.spec = spec

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: Optional[torch.Tensor] = None,
                 attention_mask: Optional[torch.Tensor] = None, temb: Optional[torch.Tensor] = None) -> torch.Tensor:
        if encoder_hidden_states is not None or attention_mask is not None or temb is not None \
                or hidden_states.dim() != 4:
            return self.original(attn, hidden_states, encoder_hidden_states=encoder_hidden_states,
                                 attention_mask=attention_mask, temb=temb)
        return run_attention(self.spec, hidden_states, tf32=tf32_like_convolutions(hidden_states))


def _attention_specs(vae: torch.nn.Module) -> list:
    """(block, spec) for the VAE's diffusers self-attention blocks that ``run_attention`` can run (the mid blocks)."""
    found = []
    for m in vae.modules():
        if hasattr(m, "processor") and hasattr(m, "to_q"):
            try:
                found.append((m, spec_from_diffusers(m)))
            except TypeError:
                continue
    return found


@contextlib.contextmanager
def fast_vae(vae: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Inside the block ``vae`` runs with grid-wide GroupNorms and ``run_attention`` attention (module docstring)."""
    found = _attention_specs(vae)
    originals = [block.processor for block, _ in found]
    try:
        for (block, spec), original in zip(found, originals):
            block.processor = _RunAttentionProcessor(original, spec)
        with parallel_group_norms(vae):
            yield vae
    finally:
        for (block, _), original in zip(found, originals):
            block.processor = original


def _layout(x: torch.Tensor) -> torch.Tensor:
    """Channels-last on CUDA, contiguous NCHW on the CPU (module docstring)."""
    if x.is_cuda and x.dim() == 4:
        return x.contiguous(memory_format=torch.channels_last)
    return x.contiguous()


def decode(vae: torch.nn.Module, raw_latents: torch.Tensor) -> torch.Tensor:
    """``vae.decode(raw_latents).sample`` (-1..1, [B, 3, H, W], channels-last on CUDA; a causal 3D VAE's one frame);
    call inside ``fast_vae``."""
    if is_causal3d(vae):
        return vae.decode(raw_latents.contiguous().unsqueeze(2), return_dict=False)[0][:, :, 0]
    return vae.decode(_layout(raw_latents), return_dict=False)[0]


def encode(vae: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """``vae.encode(pixels).latent_dist.mean`` for pixels in -1..1 (a causal 3D VAE's: of the image as one frame);
    call inside ``fast_vae``."""
    if is_causal3d(vae):
        return vae.encode(pixels.contiguous().unsqueeze(2)).latent_dist.mean[:, :, 0]
    return vae.encode(_layout(pixels)).latent_dist.mean


@torch.no_grad()
def vae_decode(engine: LeanEngine, raw_latents: torch.Tensor) -> torch.Tensor:
    """Raw latents [B,C,h,w] -> IMAGE [B,H,W,3] float32 0..1 on the CPU. Call inside ``engine.session("vae")``."""
    vae = engine.parts.vae
    z = raw_latents.to(engine.stage_device("vae"), engine.vae_dtype)
    with fast_vae(vae):
        image = decode(vae, z)
    return (image.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).cpu()


@torch.no_grad()
def vae_encode(engine: LeanEngine, image: torch.Tensor) -> torch.Tensor:
    """IMAGE [B,H,W,3] 0..1 -> raw latents (the distribution's mean). Call inside ``engine.session("vae")``."""
    vae = engine.parts.vae
    x = image.permute(0, 3, 1, 2).to(engine.stage_device("vae"), engine.vae_dtype) * 2 - 1
    with fast_vae(vae):
        return encode(vae, x).float().cpu()

"""The UNet's GroupNorms on ``kernels.group_norm`` for the length of a UNet session, and each diffusers
``ResnetBlock2D``'s norm -> SiLU pairs (its time-embedding add included) as one kernel call each.

Invariants
- Inside ``fused_norms(unet)`` every module of ``unet`` whose type is exactly ``nn.GroupNorm`` is a
  ``FusedGroupNorm`` (a class swap: parameters, buffers, ``state_dict`` and ``isinstance`` unchanged), and every
  fusable ``ResnetBlock2D`` (``_fusable_resnet``) has its one ``ResnetOverride`` as its instance ``forward``. When
  the block ends both are undone, also on error; sessions nest (the outermost undoes). A ``forward`` that another
  library put in a resnet's ``__dict__`` is never replaced: that block keeps it.
- ``FusedGroupNorm`` computes ``F.group_norm`` (``kernels.group_norm``: the kernels on contiguous CUDA inputs, where
  they match PyTorch to an ulp or two; ``F.group_norm`` itself elsewhere and under autograd).
- ``ResnetOverride`` computes diffusers' ``ResnetBlock2D.forward`` for the blocks it takes (no up/down sampling,
  ``time_embedding_norm == "default"``, SiLU, plain norms) with the same operations in the same order:
  ``silu(norm1(x))``, ``conv1``, ``+ time_emb_proj(silu(temb))``, ``silu(norm2(.))``, (dropout: identity outside
  training), ``conv2``, the shortcut, the sum (divided by ``output_scale_factor`` unless it is 1: dividing by 1 is
  exact). On the CPU every op is diffusers' own (bit-identical); on CUDA each norm -> SiLU pair, with the
  time-embedding add before ``norm2``, is one ``kernels.group_norm`` call. Submodules are called as modules (their
  hooks and overrides run: LoRA terms, placements). Training, autograd, extra arguments or a norm carrying hooks
  take diffusers' forward. The override reads the module's attributes at each call and holds nothing else, and it is
  one object per module for the module's life, so a ``torch.compile``d UNet sees the same ``forward`` in every
  session.

Why: PyTorch's GroupNorm reduces each row in one block and applies the affine in a generic broadcasting pass, and
diffusers then runs SiLU and the time-embedding add as passes of their own: 5.5 + 1.5 ms of an SDXL 1024 px UNet
step of 38 ms on an H200.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Iterator, Optional

import torch

from ..kernels.group_norm import group_norm


class FusedGroupNorm(torch.nn.GroupNorm):
    """``nn.GroupNorm`` whose forward runs ``kernels.group_norm``; identical state (module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight is not None and self.weight.requires_grad):
            return super().forward(x)
        return group_norm(x, self.num_groups, self.weight, self.bias, self.eps)


_NORM_TYPES = (torch.nn.GroupNorm, FusedGroupNorm)


def _plain_norm(norm: torch.nn.Module) -> bool:
    return (type(norm) in _NORM_TYPES and "forward" not in norm.__dict__
            and len(norm._forward_hooks) == 0 and len(norm._forward_pre_hooks) == 0)


def _fusable_resnet(module: torch.nn.Module) -> bool:
    try:
        from diffusers.models.resnet import ResnetBlock2D
    except ImportError:  # pragma: no cover - diffusers is a dependency of the pack
        return False
    return (type(module) is ResnetBlock2D and module.upsample is None and module.downsample is None
            and module.time_embedding_norm == "default" and type(module.nonlinearity) is torch.nn.SiLU
            and type(module.norm1) in _NORM_TYPES and type(module.norm2) in _NORM_TYPES)


def _norm_silu(norm: torch.nn.GroupNorm, x: torch.Tensor, add: Optional[torch.Tensor] = None) -> torch.Tensor:
    return group_norm(x, norm.num_groups, norm.weight, norm.bias, norm.eps, add=add, silu=True)


class ResnetOverride:
    """The instance-level ``forward`` of one fusable ``ResnetBlock2D`` (module docstring)."""

    __slots__ = ("module", "__weakref__")

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def __call__(self, input_tensor: torch.Tensor, temb: Optional[torch.Tensor] = None, *args, **kwargs):
        m = self.module
        if (len(args) or len(kwargs) or m.training or torch.is_grad_enabled() or not _plain_norm(m.norm1)
                or not _plain_norm(m.norm2) or (temb is not None and m.time_emb_proj is None)):
            return type(m).forward(m, input_tensor, temb, *args, **kwargs)
        h = m.conv1(_norm_silu(m.norm1, input_tensor))
        add = None
        if temb is not None:
            add = m.time_emb_proj(temb if m.skip_time_act else m.nonlinearity(temb))
        h = m.conv2(_norm_silu(m.norm2, h, add))
        shortcut = m.conv_shortcut(input_tensor) if m.conv_shortcut is not None else input_tensor
        out = shortcut + h
        return out if m.output_scale_factor == 1.0 else out / m.output_scale_factor


_RESNETS: "weakref.WeakKeyDictionary[torch.nn.Module, list[ResnetOverride]]" = weakref.WeakKeyDictionary()
_NORMS: "weakref.WeakKeyDictionary[torch.nn.Module, list[torch.nn.Module]]" = weakref.WeakKeyDictionary()


def _found(unet: torch.nn.Module) -> tuple[list[ResnetOverride], list[torch.nn.Module]]:
    """``unet``'s resnet overrides and GroupNorms, found once per UNet (holding submodules only, never ``unet``)."""
    if unet not in _RESNETS:
        _RESNETS[unet] = [ResnetOverride(m) for m in unet.modules() if _fusable_resnet(m)]
        _NORMS[unet] = [m for m in unet.modules() if isinstance(m, torch.nn.GroupNorm)]
    return _RESNETS[unet], _NORMS[unet]


@contextlib.contextmanager
def fused_norms(unet: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Inside the block ``unet``'s GroupNorms and fusable resnets run fused (module docstring)."""
    resnets, norms = _found(unet)
    swapped = [m for m in norms if type(m) is torch.nn.GroupNorm]
    installed = []
    try:
        for m in swapped:
            m.__class__ = FusedGroupNorm
        for override in resnets:
            attrs = override.module.__dict__
            if "forward" not in attrs:
                attrs["forward"] = override
                installed.append(override)
        yield unet
    finally:
        for override in installed:
            if override.module.__dict__.get("forward") is override:
                del override.module.__dict__["forward"]
        for m in swapped:
            m.__class__ = torch.nn.GroupNorm

"""Unmerged DoRA at about a plain LoRA's cost: the layer's forward rewritten around its base op, never a weight built.

Math (``dora.py``): a DoRA layer adds ``s * ((W + dW) * g - W)`` to the weight, with ``g = m / ||W + dW||`` one gain
per input or per output channel. ``g`` depends on the weights only (not on the input, not on the strength), so it is
computed once and cached; with ``c - 1 = s * (g - 1)`` (a per-channel vector) the layer's output is

- input axis (``g`` per input channel, kohya's and LyCORIS' default):
  ``y = W (c * x) + b + s * dW (g * x)``: the base op on the input scaled per channel, plus the adapter's term on
  ``g * x``;
- output axis (``g`` per output channel):
  ``y = c * (W x + b) - (c - 1) * b + s * g * (dW x)``: the base output (bias included) rescaled per channel in one
  fused multiply-add, plus the term.

For a plain LoRA / LoCon ``dW = up @ down``, ``g`` folds into a factor (``down * g`` on the input axis, ``up * g`` on
the output axis), so the term costs what a plain LoRA's does and the DoRA itself one per-channel multiply-add over
the layer's input or output. Other kinds (LoHa, LoKr) run their own term (``fullrank``) on ``g * x`` or scale its
result by ``g``.

The dense path (``fullrank._DenseTerm`` over ``_DoraDelta``) builds ``s * ((W + dW) * g - W)`` in fp32 every forward
and applies it as a second dense GEMM/conv, about the layer's own cost again; it is the fallback wherever this forward
cannot sit (another ``forward`` already in the module's ``__dict__``: a second DoRA on the same layer, another
library). On a GEGLU's ``proj`` (the ``geglu`` strategy) the low-rank term goes into the GEGLU's fused gating like
a plain LoRA's (``fuse_into``); this forward keeps the per-channel part.

Invariants
- Installed as the module's instance ``forward`` (as a GEGLU's override is): the base op is the class's own
  ``forward``, so hooks of other bindings on the same module see the original input and add their terms to this
  output; removed with its term, leaving ``module.__dict__`` as it was.
- The gain is refreshed at attach, never in a forward: it is recomputed only when the weight it was computed from
  changed (another storage or an in-place write, e.g. a merged LoRA earlier in the chain; ``weight_key``). A
  streamed weight (``memory.unet_patches.host_copy``) is read from its pinned host copy, since its device slot holds
  another block's weights outside the block's forward. Refreshing inside a CUDA-graph capture is refused.
- Strength is data: ``cm1 = s * (g - 1)`` (input axis), ``c = 1 + s * (g - 1)`` and ``nbc = -s * (g - 1) * b``
  (output axis) and the strength-scaled factor (``up_s``) are persistent buffers the binding rewrites in place at
  attach with the plain LoRA's buffers (``strength_pairs``, ``plus_one``); a captured graph replays any strength.
  At strength 0 they are zeros and ones, so the output is the base bit-for-bit (``x + x * 0``, ``0 + out * 1``,
  ``+ 0``).
- No host sync, no allocation by data in a forward: capture-safe.

Why hand-written: peft's DoRA layer (and LyCORIS') re-normalises the dense ``W + dW`` every forward with the
strength outside the norm, and neither keeps the strength in capture-stable buffers (see ``fullrank``).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..memory.fp8_weights import weight_shape, weight_storage, weight_values
from ..memory.unet_patches import host_copy
from .dora import dora_gain, on_input_axis
from .fullrank import can_add_in_place
from .formats import LoraLayer
from .keymap import Target


def weight_key(weight: torch.Tensor) -> tuple:
    """What identifies the values of ``weight`` (the gain's cache key): the pinned host copy of a streamed weight
    (fixed for the placement's life), else the storage, device and in-place write count."""
    host = host_copy(weight)
    if host is not None:
        return ("host", host.data_ptr())
    return (str(weight.device), weight.data_ptr(), weight._version)


class DoraForward:
    """The instance ``forward`` of one Linear / Conv2d carrying one unmerged DoRA term (module docstring).

    ``inner`` is the adapter's term as a forward hook (``inner(module, (z,), out)`` adds it to ``out`` in place or
    returns the sum; it moves an input on another device or dtype itself): for a plain LoRA / LoCon (``folded``) the
    binding's plain LoRA term over this object's ``down`` / ``up_s`` buffers, which carry ``g``; for LoHa / LoKr their
    ``fullrank`` term at strength ``s``, run on ``g * x`` or scaled by ``g`` here. An input on another device or
    dtype than the adapter (a placement ran the module elsewhere) gets the per-channel vectors moved to it."""

    __slots__ = ("module", "layer", "input_axis", "conv", "folded", "inner", "terms", "attrs", "key",
                 "gain", "gm1", "cm1", "nbg", "nbc", "down", "down_src", "up", "up_src", "up_s",
                 "geglu", "term_in_geglu", "__weakref__")

    def __init__(self, target: Target, inner=None):
        self.module, self.layer, self.inner = target.module, target.layer, inner
        self.attrs = target.module.__dict__
        self.terms: list = []
        self.geglu = None  # ``fuse_into``
        self.term_in_geglu = False
        self.key: Optional[tuple] = None
        mod, mag = target.module, target.layer.magnitude
        self.conv = isinstance(mod, torch.nn.Conv2d)
        self.input_axis = on_input_axis(mag)
        dtype, device = self.layer.dtype, mag.device
        channels = mag.numel()
        bshape = (1, -1, 1, 1) if self.conv else (-1,)  # channels: dim 1 of a conv's NCHW, the last of a Linear
        self.gain = torch.zeros(channels, dtype=dtype, device=device)  # g, in the activation dtype
        self.gm1 = torch.zeros(channels, dtype=dtype, device=device).view(bshape)  # g - 1: the strength source
        # the strength buffer: s * (g - 1) on the input axis, 1 + s * (g - 1) on the output axis
        self.cm1 = torch.zeros_like(self.gm1)
        # output axis with a bias: -(g - 1) * b, and its strength buffer -s * (g - 1) * b
        self.nbg = self.nbc = None
        if not self.input_axis and mod.bias is not None:
            self.nbg, self.nbc = torch.zeros_like(self.gm1), torch.zeros_like(self.gm1)
        self.down = self.down_src = self.up = self.up_src = self.up_s = None
        self.folded = isinstance(self.layer, LoraLayer)
        if self.folded:  # fold g into a factor
            down, up = self.layer.down, self.layer.up
            if not self.conv:
                down, up = down.reshape(down.shape[0], -1), up.reshape(up.shape[0], -1)
            elif up.ndim == 2:
                down, up = down.reshape(*down.shape, 1, 1), up.reshape(*up.shape, 1, 1)
            self.down_src, self.up_src = down, up
            self.down = down.clone() if self.input_axis else down  # input axis: down * g (rewritten with g)
            self.up = up if self.input_axis else torch.zeros_like(up)  # the strength source; output axis: up * g
            self.up_s = torch.zeros_like(up)

    # --------------------------------------------------------------------- install / remove (binding)
    def fuse_into(self, geglu) -> None:
        """For the ``proj`` of a GEGLU (the ``geglu`` strategy): hand the low-rank term (``inner``, a plain LoRA
        term over ``down`` / ``up_s``) to the GEGLU's override (``memory.unet_patches``), which fuses it into the
        gating as it does a plain LoRA's; this forward then keeps only the per-channel part."""
        self.geglu = geglu

    def add(self, term) -> bool:
        """Install this forward for ``term`` (the slot's fallback); False, nothing changed, when another ``forward``
        sits in the module's ``__dict__`` (the caller hooks ``term`` instead)."""
        if "forward" in self.attrs:
            return False
        self.attrs["forward"] = self
        self.terms = [term]
        self.term_in_geglu = self.geglu is not None and self.geglu.add(self.inner)
        return True

    def remove(self, term) -> None:
        if self.terms and self.terms[0] is term:
            self.terms = []
            if self.term_in_geglu:
                self.geglu.remove(self.inner)
                self.term_in_geglu = False
            if self.attrs.get("forward") is self:
                del self.attrs["forward"]

    @property
    def active(self) -> bool:
        return bool(self.terms)

    def strength_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(source, buffer)`` pairs the binding rewrites as ``buffer = strength * source`` at attach."""
        pairs = [(self.gm1, self.cm1)]
        if self.nbg is not None:
            pairs.append((self.nbg, self.nbc))
        if self.up_s is not None:
            pairs.append((self.up, self.up_s))
        return pairs

    def plus_one(self) -> list[torch.Tensor]:
        """Buffers the binding adds 1 to after ``buffer = strength * source`` (``c`` on the output axis)."""
        return [] if self.input_axis else [self.cm1]

    def refresh_gain(self) -> bool:
        """Recompute ``g`` (and what folds it) when the weight changed since; True when it did (the binding then
        rewrites the strength buffers). Outside a CUDA-graph capture only."""
        key = weight_key(weight_storage(self.module))  # an fp8 layer: its fp8 storage (``weight`` is a new tensor)
        if key == self.key:
            return False
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("DoRA: the layer's weight changed since its gain was computed, and it cannot be "
                               "recomputed inside a CUDA-graph capture; attach the LoRA before capturing")
        shape = weight_shape(self.module)
        device = self.gain.device
        with torch.no_grad():
            # a streamed weight's pinned host copy, dequantized for an fp8 layer (``memory.fp8_weights``)
            w = weight_values(self.module, torch.float32, device).reshape(shape)
            delta = self.layer.delta_flat(torch.float32).to(device).view(shape)
            g = dora_gain(w, delta, self.layer.magnitude.to(device)).flatten()
            del w, delta
            self.gain.copy_(g)
            self.gm1.copy_((g - 1).view(self.gm1.shape))
            if self.nbg is not None:
                bias = host_copy(self.module.bias)
                bias = self.module.bias if bias is None else bias
                self.nbg.copy_((-(g - 1) * bias.detach().to(device=device, dtype=torch.float32)).view(self.nbg.shape))
            if self.folded and self.input_axis:  # down * g per input channel (and tap)
                shape = (1, -1) + (1,) * (self.down_src.ndim - 2)
                self.down.copy_(self.down_src.float() * g.view(shape))
            elif self.folded:  # up * g per output channel
                shape = (-1,) + (1,) * (self.up.ndim - 1)
                self.up.copy_(self.up_src.float() * g.view(shape))
        self.key = key
        return True

    # --------------------------------------------------------------------- the forward
    def _inner(self, z: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        r = self.inner(self.module, (z,), out)
        return out if r is None else r

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        m = self.module
        cm1, nbc, gain = self.cm1, self.nbc, self.gain
        if x.dtype != cm1.dtype or x.device != cm1.device:  # a placement ran this module elsewhere
            cm1, gain = cm1.to(x.device, x.dtype), gain.to(x.device, x.dtype)
            nbc = None if nbc is None else nbc.to(x.device, x.dtype)
        base = type(m).forward
        if self.input_axis:
            out = base(m, torch.addcmul(x, x, cm1), *args, **kwargs)  # W (c x) + b
            if self.term_in_geglu:
                return out
            # + s (up) (down * g) x, or + s dW (g x)
            return self._inner(x if self.folded else x * gain.view(cm1.shape), out)
        out = base(m, x, *args, **kwargs)  # W x + b
        in_place = can_add_in_place(out, out.dtype)
        if nbc is None:  # c (W x)
            out = out.mul_(cm1) if in_place else out * cm1
        else:  # c (W x + b) - (c - 1) b, one pass
            out = torch.addcmul(nbc, out, cm1, out=out) if in_place else torch.addcmul(nbc, out, cm1)
        if self.term_in_geglu:
            return out
        if self.folded:
            return self._inner(x, out)  # + s (up * g) down x
        return out.addcmul(self._inner(x, torch.zeros_like(out)), gain.view(cm1.shape))  # + g (s dW x)

"""Unmerged terms of adapters whose delta is not low-rank: LoKr (Kronecker), LoHa (dense or Khatri-Rao), DoRA.

Formulas: ``lycoris.py`` (LoHa, LoKr) and ``dora.py`` (DoRA). Each term is a forward hook that adds
``strength * dW`` applied to the layer's input; how it gets there:

- LoKr, ``_KronTerm``: never builds ``dW = kron(W1, W2)``. For a Linear, with ``x`` seen as ``X [i1, i2]``,
  ``kron(W1, W2) vec(X) = vec(W1 X W2^T)``: two small batched GEMMs costing ``o1 i1 i2 + o1 i2 o2`` or
  ``i1 i2 o2 + o1 i1 o2`` multiply-adds per token (the cheaper order is picked per layer), against ``o1 o2 i1 i2``
  for the dense delta: e.g. 92 K vs 1.6 M on a 1280 x 1280 SDXL layer with LyCORIS' default factorisation (32 x 40).
  For a conv, ``W2`` carries the kernel: the input's ``i1`` channel groups become the batch of one conv with
  ``W2`` (the base conv's stride/padding/dilation), then ``W1`` mixes the groups (one batched GEMM). The dense
  ``dW`` would cost a full GEMM per token plus building it; the identity is never dearer in multiply-adds.
- LoHa, ``_LohaKhatriRao``: as a rank-``r1*r2`` LoRA whose factors are the Khatri-Rao products of the file's
  (``lycoris.py``), formed per call, when that costs at most one dense GEMM per token: two skinny GEMMs/convs.
  Otherwise ``_DenseTerm`` builds ``dW = (s * w1_a @ w1_b) * (w2_a @ w2_b)`` each forward (two rank-r GEMMs over the
  weight's size, no token dependence) and applies it as one dense GEMM/conv: about the layer's own cost again.
  Either way only the file's factors (and one strength buffer like ``w1_a``) stay resident.
- DoRA (any kind with a ``dora_scale``) runs through ``dora_forward.DoraForward`` (the gain cached, no weight
  built). ``_DenseTerm`` over ``_DoraDelta`` is its fallback (a second DoRA on one layer):
  ``s * ((W + dW) * g - W)`` with ``g`` the magnitude over the norm of ``W + dW`` is built each forward in fp32 from
  the module's *current* weight (read at call time, so a placement that moves or streams weights is followed),
  then applied as one dense GEMM/conv: roughly doubles the layer's cost, plus fp32 temporaries of the weight's
  size. ``merged`` mode has no per-step cost.

Strength is data (as for plain LoRA in ``unmerged.py``): each term owns one persistent buffer the binding rewrites
in place at attach (``w1_s = strength * W1`` for LoKr, ``w1a_s = strength * w1_a`` for LoHa, a 0-d
``strength`` for DoRA). Nothing in a forward reads a Python number derived from data, syncs the host or allocates
by data (shapes only): capture-safe, and a captured CUDA graph replays a new strength without recapture. At
strength 0 every buffer is zero, the term is exact zeros and the output is the base bit-for-bit.

Why hand-written: peft's LoHa/LoKr/DoRA layers (and LyCORIS' modules, not a dependency) replace the model's modules,
rebuild the dense ``dW`` in every forward (LoKr through ``torch.kron``) and keep the strength as a Python float baked
into a captured graph; none applies LoKr by the Kronecker identity or keeps the strength in capture-stable buffers.
peft serves as the reference in ``tests/lora/test_lycoris.py``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..memory.fp8_weights import weight_shape
from .dora import dora_delta
from .formats import LoraLayer
from .keymap import Target
from .lycoris import LohaLayer, LokrLayer, khatri_rao_down, khatri_rao_up


def can_add_in_place(output: torch.Tensor, dtype: torch.dtype) -> bool:
    return output.dtype == dtype and output.is_contiguous() and not (torch.is_grad_enabled() and output.requires_grad)


def lowrank_factors(target: Target) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """``(down, up)`` when ``target`` is a plain LoRA (``unmerged.py`` runs it), else None (``make_term``)."""
    layer = target.layer
    if layer.magnitude is None and isinstance(layer, LoraLayer):
        return layer.down, layer.up
    return None


class _Geometry:
    """How a term's delta meets the input: Linear, or a conv with the module's stride/padding/dilation."""

    __slots__ = ("conv", "stride", "padding", "dilation")

    def __init__(self, module: torch.nn.Module):
        self.conv = isinstance(module, torch.nn.Conv2d)
        if self.conv:
            self.stride, self.padding, self.dilation = module.stride, module.padding, module.dilation


def _add(output: torch.Tensor, y: torch.Tensor, foreign: bool):
    """The hook's return: ``output + y`` in place when possible (None), else a new tensor."""
    if not foreign and can_add_in_place(output, y.dtype):
        output.add_(y)
        return None
    return output + y.to(output.device, output.dtype)


class _KronTerm:
    """Forward hook of a LoKr layer: ``out += kron(w1_s, W2) x`` by the Kronecker identity (module docstring)."""

    __slots__ = ("w1_s", "w2", "geo", "w1_first", "__weakref__")

    def __init__(self, w1_s: torch.Tensor, w2: torch.Tensor, module: torch.nn.Module):
        self.w1_s, self.w2, self.geo = w1_s, w2, _Geometry(module)
        (o1, i1), o2, i2 = w1_s.shape, w2.shape[0], w2[0].numel()
        self.w1_first = o1 * i1 * i2 + o1 * i2 * o2 < i1 * i2 * o2 + o1 * i1 * o2

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        w1, w2 = self.w1_s, self.w2
        (o1, i1), (o2, i2) = w1.shape, w2.shape
        xr = x.reshape(-1, i1, i2)
        if self.w1_first:
            y = F.linear(torch.matmul(w1, xr), w2)  # [M, o1, i2] -> [M, o1, o2]
        else:
            y = torch.matmul(w1, F.linear(xr, w2))  # [M, i1, o2] -> [M, o1, o2]
        return y.reshape(*x.shape[:-1], o1 * o2)

    def _conv(self, x: torch.Tensor) -> torch.Tensor:
        w1, g = self.w1_s, self.geo
        o1, i1 = w1.shape
        n, c, h, w = x.shape
        t = F.conv2d(x.reshape(n * i1, c // i1, h, w), self.w2, None, g.stride, g.padding, g.dilation)
        _, o2, ho, wo = t.shape
        return torch.matmul(w1, t.reshape(n, i1, o2 * ho * wo)).reshape(n, o1 * o2, ho, wo)

    def __call__(self, module, args, output):
        x = args[0]
        foreign = x.device != self.w1_s.device or x.dtype != self.w1_s.dtype
        xin = x.to(self.w1_s.device, self.w1_s.dtype) if foreign else x
        return _add(output, self._conv(xin) if self.geo.conv else self._linear(xin), foreign)


class _LohaKhatriRao:
    """Forward hook of a LoHa layer in its rank-``r1*r2`` form: ``out += up(down(x))`` with ``up`` / ``down`` the
    Khatri-Rao products of the factors, formed per call (``R * (n + out)`` multiplies, small next to the GEMMs) so
    that nothing of size ``R`` stays resident (a rank-16 LoHa on SDXL's attention and feed-forward layers would
    hold ~2 GB of them, with the strength buffer); ``w1a_s`` is the strength-scaled buffer."""

    __slots__ = ("w1a_s", "w1b", "w2a", "w2b", "geo", "__weakref__")

    def __init__(self, w1a_s: torch.Tensor, layer: LohaLayer, module: torch.nn.Module):
        self.w1a_s, self.w1b, self.w2a, self.w2b = w1a_s, layer.w1b, layer.w2a, layer.w2b
        self.geo = _Geometry(module)

    def __call__(self, module, args, output):
        x = args[0]
        foreign = x.device != self.w1b.device or x.dtype != self.w1b.dtype
        xin = x.to(self.w1b.device, self.w1b.dtype) if foreign else x
        up, down = khatri_rao_up(self.w1a_s, self.w2a), khatri_rao_down(self.w1b, self.w2b)
        g = self.geo
        if g.conv:
            h = F.conv2d(xin, down.view(down.shape[0], xin.shape[1], *module.kernel_size), None, g.stride,
                         g.padding, g.dilation)
            return _add(output, F.conv2d(h, up[:, :, None, None]), foreign)
        h = F.linear(xin, down)
        if not foreign and can_add_in_place(output, up.dtype):
            output.view(-1, output.shape[-1]).addmm_(h.reshape(-1, h.shape[-1]), up.t())
            return None
        return output + F.linear(h, up).to(output.device, output.dtype)


class _LohaDelta:
    """``dW = (w1a_s @ w1b) * (w2a @ w2b)`` shaped like the weight (``w1a_s`` = strength-scaled buffer)."""

    __slots__ = ("w1a_s", "w1b", "w2a", "w2b", "shape")

    def __init__(self, w1a_s, layer: LohaLayer, shape: tuple):
        self.w1a_s, self.w1b, self.w2a, self.w2b, self.shape = w1a_s, layer.w1b, layer.w2a, layer.w2b, shape

    def __call__(self, module) -> torch.Tensor:
        return ((self.w1a_s @ self.w1b) * (self.w2a @ self.w2b)).view(self.shape)


class _DoraDelta:
    """``s * ((W + dW) * g - W)`` (``dora.dora_delta``) from the module's current weight; ``strength`` a 0-d fp32
    buffer."""

    __slots__ = ("layer", "strength", "dtype")

    def __init__(self, layer, strength: torch.Tensor):
        self.layer, self.strength, self.dtype = layer, strength, layer.dtype

    def __call__(self, module) -> torch.Tensor:
        w = module.weight
        delta = self.layer.delta_flat(torch.float32).to(w.device).view(w.shape)
        return dora_delta(w.float(), delta, self.layer.magnitude.to(w.device), self.strength.to(w.device)
                          ).to(self.dtype)


class _DenseTerm:
    """Forward hook adding ``delta(module)`` applied to the input as one GEMM (Linear) or conv."""

    __slots__ = ("delta", "geo", "__weakref__")

    def __init__(self, delta, module: torch.nn.Module):
        self.delta, self.geo = delta, _Geometry(module)

    def __call__(self, module, args, output):
        x = args[0]
        d = self.delta(module)
        foreign = x.device != d.device or x.dtype != d.dtype
        xin = x.to(d.device, d.dtype) if foreign else x
        g = self.geo
        if g.conv:
            return _add(output, F.conv2d(xin, d, None, g.stride, g.padding, g.dilation), foreign)
        if not foreign and can_add_in_place(output, d.dtype):
            output.view(-1, output.shape[-1]).addmm_(xin.reshape(-1, xin.shape[-1]), d.t())
            return None
        return output + F.linear(xin, d).to(output.device, output.dtype)


def make_term(target: Target) -> tuple[object, torch.Tensor, torch.Tensor]:
    """``(hook, source, buffer)`` for a target ``lowrank_factors`` returned None for: the binding writes
    ``buffer = strength * source`` at attach."""
    layer, module = target.layer, target.module
    shape = tuple(weight_shape(module))
    if layer.magnitude is not None:
        one = torch.ones((), dtype=torch.float32, device=layer.magnitude.device)
        buf = torch.zeros_like(one)
        return _DenseTerm(_DoraDelta(layer, buf), module), one, buf
    if isinstance(layer, LokrLayer):
        w2 = layer.w2_for(shape) if len(shape) == 4 else layer.w2.reshape(layer.w2.shape[0], -1)
        buf = torch.zeros_like(layer.w1)
        return _KronTerm(buf, w2, module), layer.w1, buf
    if isinstance(layer, LohaLayer):
        buf = torch.zeros_like(layer.w1a)
        if layer.khatri_rao_cheaper():
            return _LohaKhatriRao(buf, layer, module), layer.w1a, buf
        return _DenseTerm(_LohaDelta(buf, layer, shape), module), layer.w1a, buf
    raise TypeError(f"no unmerged term for a {type(layer).__name__}")  # pragma: no cover - kinds are closed


def weight_delta(target: Target, strength: float, weight: torch.Tensor) -> torch.Tensor:
    """The merged-mode delta: ``strength * dW`` (DoRA: ``dora.dora_delta`` against ``weight``), fp32, on
    ``weight``'s device, shaped like it."""
    layer = target.layer
    delta = layer.delta_flat(torch.float32).to(weight.device).reshape(weight.shape)
    if layer.magnitude is None:
        return delta * strength
    return dora_delta(weight.float(), delta, layer.magnitude.to(weight.device), strength)

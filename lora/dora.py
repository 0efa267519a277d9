"""DoRA (weight-decomposed LoRA, Liu et al. 2024) as ComfyUI applies a kohya/LyCORIS ``dora_scale``.

Math. ``W`` is the layer's weight, ``dW`` the adapter's delta at strength 1 (LoRA ``scale * up @ down``, LoHa,
LoKr: any kind's ``delta_flat``), ``m`` the file's ``dora_scale``, ``s`` the strength:

    A   = W + dW
    g   = m / (||A|| + eps)          (one norm per input channel or per output channel, see below)
    W_s = W + s * (A * g - W)        i.e. the layer adds   s * (A * g - W)

- Axis: ``dora_scale`` of shape ``[1, in]`` / ``[1, in, 1, 1]`` (kohya's and LyCORIS' default, the DoRA paper's
  column norm) normalises each *input* channel: the norm runs over the output channels and kernel taps of ``A``
  (ComfyUI's ``weight_decompose``, input-axis branch, identical). ``[out, 1]`` / ``[out, 1, 1, 1]`` (LyCORIS
  ``wd_on_out``) normalises each *output* channel, the norm over inputs and taps of ``A`` (DoRA's definition and
  LyCORIS'; ComfyUI 0.3.64 divides by ``||W||`` there instead of ``||A||``, an open bug: Comfy-Org/ComfyUI PR
  #15458). ``eps`` = fp32 machine epsilon (ComfyUI computes in fp32 and adds ``finfo(float32).eps``).
- Strength interpolates linearly between the base weight and the full DoRA weight (ComfyUI's rule since
  ComfyUI commit ffc4b7c, "DoRA as diff"): ``s = 0`` is the base model exactly; ``g`` itself does not depend on
  ``s``. LyCORIS' own merge scales ``g`` instead (``A * (s * (g - 1) + 1)``, not the base at ``s = 0``); the
  two agree at ``s = 1``.
- ``W`` is the weight the layer holds when the term is computed (the base weight in ``unmerged`` mode; in
  ``merged`` mode the weight as earlier merged LoRAs of the same chain left it, as ComfyUI's patch order does).

The term depends on ``W``, so it is not low-rank: unmerged injection builds ``s * (A * g - W)`` each forward
(``fullrank.py``), merged injection writes it once per session. PEFT's ``lora_magnitude_vector`` (strength acts
inside the norm there) is not supported (``formats.py`` refuses it).
"""
from __future__ import annotations

from typing import Optional, Union

import torch

EPS = torch.finfo(torch.float32).eps


def check_magnitude(magnitude: Optional[torch.Tensor], name: str, source: str) -> Optional[torch.Tensor]:
    """The ``dora_scale`` tensor of layer ``name``, validated without a model (None passes through)."""
    if magnitude is None:
        return None
    shape = tuple(magnitude.shape)
    if not magnitude.is_floating_point() or magnitude.ndim not in (2, 4) or not (
            shape[0] == 1 or all(d == 1 for d in shape[1:])):
        raise ValueError(f"lora {source}: layer {name} has a dora_scale of shape {shape} ({magnitude.dtype}); "
                         f"expected a float [1, in] / [1, in, 1, 1] (input-axis DoRA) or [out, 1] / [out, 1, 1, 1] "
                         f"(output-axis DoRA); the file is corrupt or not a kohya/LyCORIS DoRA")
    return magnitude


def placed_magnitude(magnitude: Optional[torch.Tensor], device: torch.device) -> Optional[torch.Tensor]:
    """The magnitude on ``device`` in fp32 (the norm math runs in fp32 whatever the model's dtype)."""
    return None if magnitude is None else magnitude.to(device=device, dtype=torch.float32)


def on_input_axis(magnitude: torch.Tensor) -> bool:
    """True for ``[1, in(, 1, 1)]`` (one magnitude per input channel), False for ``[out, 1(, 1, 1)]``."""
    return magnitude.shape[0] == 1


def magnitude_problem(magnitude: Optional[torch.Tensor], weight_shape: tuple) -> str:
    """'' when ``magnitude`` fits a weight of ``weight_shape`` ([out, in(, kh, kw)]), else a description."""
    if magnitude is None:
        return ""
    out, inp = weight_shape[0], weight_shape[1]
    axis, want = ("input", inp) if on_input_axis(magnitude) else ("output", out)
    if magnitude.numel() != want:
        return (f"its DoRA dora_scale {tuple(magnitude.shape)} is an {axis}-axis magnitude of {magnitude.numel()} "
                f"channels but the layer has {want} {axis} channels")
    return ""


def gain_shape(magnitude: torch.Tensor, ndim: int) -> tuple:
    """The broadcast shape of the per-channel gain against a weight of ``ndim`` dims: ``(1, -1, 1, 1)`` for an
    input-axis magnitude, ``(-1, 1, 1, 1)`` for an output-axis one (two entries for a Linear)."""
    return ((1, -1) if on_input_axis(magnitude) else (-1, 1)) + (1,) * (ndim - 2)


def dora_gain(weight: torch.Tensor, delta: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """``g = m / (||W + dW|| + eps)`` in fp32, shaped ``gain_shape`` (one value per input or output channel);
    ``weight`` and ``delta`` fp32 of one shape. Depends on the weights only, never on the strength."""
    if on_input_axis(magnitude):
        dims = (0,) + tuple(range(2, weight.ndim))
    else:
        dims = tuple(range(1, weight.ndim))
    shape = gain_shape(magnitude, weight.ndim)
    norm = torch.linalg.vector_norm(weight + delta, dim=dims).reshape(shape)
    return magnitude.reshape(shape) / (norm + EPS)


def dora_delta(weight: torch.Tensor, delta: torch.Tensor, magnitude: torch.Tensor,
               strength: Union[float, torch.Tensor]) -> torch.Tensor:
    """``s * ((W + dW) * m / (||W + dW|| + eps) - W)`` in fp32 (module docstring); ``weight`` and ``delta`` fp32 of
    one shape, ``strength`` a number or a 0-d tensor (the unmerged strength buffer). No host sync."""
    return ((weight + delta) * dora_gain(weight, delta, magnitude) - weight) * strength

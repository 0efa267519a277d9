"""fp8 weight storage for the denoiser: ``nn.Linear`` / ``nn.Conv2d`` weights kept as float8_e4m3fn with one
float32 scale per tensor, computed in the compute dtype (``fp8_e4m3fn``) or, on GPUs with fp8 tensor cores, as fp8
matmuls (``fp8_e4m3fn_fast``).

Math
- Quantization (per tensor): ``s = amax(|W|) / 448`` (448 is e4m3fn's largest finite value; ``s = 1`` for an
  all-zero weight; rounded to fp32 on the host, so CPU and GPU quantize to the same bytes), ``Q = round_e4m3fn(W /
  s)`` (round to nearest even, in fp32). Dequantized: ``W' = Q * s``,
  exact in fp32 up to one rounding. Error bound per element: ``|W' - W| <= max(2^-4 |W|, 2^-10 s)`` (half an ulp
  of e4m3's 3 mantissa bits for normal values; half the subnormal step ``2^-9 s`` below ``2^-6 s``).
- ``fp8_e4m3fn``: a layer computes ``op(x, dequantize(Q, s, x.dtype), b)``: the dequantized weight is formed in the
  input's dtype (one cast, one multiply by ``s`` held as a Python float, so the product is rounded once on every
  device), then the ordinary ``F.linear`` / conv. The result equals a plain layer holding ``W'`` in that dtype.
- ``fp8_e4m3fn_fast`` (Linear only): the activation is quantized per tensor on the fly and the product runs as one
  fp8 tensor-core GEMM (``torch._scaled_mm``, fp32 accumulation, bf16 out; ``memory/fp8_matmul.py``, capturable).
  Needs CUDA compute capability >= (8, 9) (``fp8_matmul_supported``, the one capability decision), bf16
  activations and ``K``, ``N`` multiples of 16 (``fast_shape_ok``, decided per layer at quantization); any layer
  or call outside that takes the dequantizing path. The output layer of a tanh-GELU feed-forward may instead take
  its input quantized per row together with the GELU (``memory/fp8_feedforward.py``, installed by the loader).

Storage scheme (why integer dtypes)
- A quantized layer is the same module object with its class swapped to ``Fp8Linear`` / ``Fp8Conv2d`` (names,
  hooks, LoRA targets, GEGLU overrides and ``isinstance(m, nn.Linear)`` all stay valid). Its ``weight`` Parameter
  is replaced by ``weight_fp8``: the e4m3fn *bytes*, held as a **uint8** Parameter (``requires_grad=False``) and
  reinterpreted at use with the zero-copy ``.view(torch.float8_e4m3fn)``; the scale is the buffer ``weight_scale``:
  the float32 *bits* held as an **int32** 0-d tensor (``.view(torch.float32)`` for ``_scaled_mm``), mirrored as the
  Python float ``fp8_scale`` for the dequantizing path. The layer's ``compute_dtype`` is the dtype of a 0-element
  floating buffer, ``fp8_compute_like``, which ``module.to(dtype)`` casts like a bias (a layer without a bias too).
- Why not float8 / float32 tensors: every generic weight path treats a floating tensor as "a weight in the compute
  dtype": ``module.to(device, dtype)`` (the engine's stage moves, the placement's ``unet.to``) casts every floating
  parameter and buffer, and float8 counts as floating, so the storage would silently become bf16 (and a float32
  scale bf16); flat layouts (``hostmem.FlatLayout``, behind ``plan.module_bytes``, the stream arena and pinned host
  buffers of ``streaming.BlockStreamer``, ``ModuleSwap``) size and copy floating tensors in the target dtype; and
  diffusers' ``ModelMixin.dtype`` reports the first floating parameter. All of them leave integer tensors alone, so
  with this scheme every VRAM policy moves the storage byte for byte (1 byte per weight element in the plan, the
  arena and host memory), the casts reach only biases and norms (which keep the compute dtype, as they should), and
  no policy module needed a branch for fp8.
- ``weight`` stays readable: a property returning the dequantized weight in the layer's ``compute_dtype`` (a new
  tensor per read, on the storage's device), for code that reads weights (diffusers' Z-Image timestep embedder reads
  ``mlp[0].weight.dtype``; a DoRA's dense fallback reads values inside a forward). It is read-only: nothing written
  to it reaches the storage, so writers must refuse fp8 layers (the merged LoRA mode does, ``lora/adapter.py``).
  Outside a forward, read ``weight_values`` (it honours a streamed layer's pinned host copy); for shapes,
  ``weight_shape`` (no dequantization).

Invariant: the fp8 bytes and the scale never change after quantization (no writer touches them), so a layer gives
the same output under every VRAM policy; on the CPU bit-identical, as for plain weights.
"""
from __future__ import annotations

import logging
import math
import struct
from dataclasses import dataclass
from typing import Mapping, Optional, Union

import torch
import torch.nn.functional as F

from .fp8_matmul import FAST_OUT_DTYPE, FP8_DTYPE, FP8_MAX, fast_shape_ok, fp8_linear_fast
from .fp8_matmul import fp8_matmul_supported, resolve_fast  # noqa: F401  (part of this module's API)
from .streaming import host_copy

logger = logging.getLogger(__name__)

STORAGE_DTYPE = torch.uint8  # what the weight Parameter holds (the fp8 bytes)
SCALE_STORAGE_DTYPE = torch.int32  # what the scale buffer holds (the float32 bits)
STORAGE_NAMES = ("fp8_e4m3fn", "fp8_e4m3fn_fast")
COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

Scale = Union[float, torch.Tensor]


# --------------------------------------------------------------------------------------------- math
def quantize(weight: torch.Tensor, name: str = "weight") -> tuple[torch.Tensor, float]:
    """``(Q, s)``: ``Q`` float8_e4m3fn shaped like ``weight``, ``s = amax / 448`` (fp32 value; 1.0 for an
    all-zero weight), ``weight ~= Q * s`` (module docstring). ``ValueError`` for a NaN / infinite weight."""
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got {getattr(weight, 'dtype', type(weight))}")
    w = weight.detach().to(torch.float32, copy=True)  # divided in place below: never the caller's tensor
    amax = float(w.abs().amax()) if w.numel() else 0.0  # exact: an fp32 value
    if not math.isfinite(amax):
        raise ValueError(f"{name}: holds NaN or infinite values, which fp8 cannot store; fix the checkpoint")
    # amax / 448 rounded once to fp32, on the host: the same scale on every device (CUDA divides a tensor by a
    # Python number as a multiplication by its reciprocal, one ulp off for some amax), then a true division by a
    # tensor on w's device (IEEE on CPU and CUDA alike), so CPU and GPU quantization give the same bytes
    scale = _fp32(amax / FP8_MAX) if amax > 0 else 1.0
    q = w.div_(torch.tensor(scale, dtype=torch.float32, device=w.device)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def _fp32(value: float) -> float:
    """``value`` rounded to the nearest float32 (as a Python float)."""
    return struct.unpack("f", struct.pack("f", value))[0]


def dequantize(q: torch.Tensor, scale: Scale, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``Q * s`` in ``dtype`` (rounded once). ``q``: float8_e4m3fn values or their uint8 storage; ``scale``: a
    float or a 1-element tensor (read with ``float``: a host sync for a device tensor)."""
    if q.dtype == STORAGE_DTYPE:
        q = q.view(FP8_DTYPE)
    if q.dtype != FP8_DTYPE:
        raise TypeError(f"q: expected float8_e4m3fn values (or their uint8 storage), got {q.dtype}")
    return q.to(dtype).mul_(float(scale))


def _scale_bits(scale: float, device) -> torch.Tensor:
    return torch.tensor(scale, dtype=torch.float32, device=device).view(SCALE_STORAGE_DTYPE)


def compute_dtype_for(device) -> torch.dtype:
    """The dtype fp8-stored layers compute in: bf16 on CUDA (fp8's range needs bf16's exponent; fp16 activations
    of the DiTs overflow), fp32 elsewhere (the CPU has no fast half-precision GEMM)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


# --------------------------------------------------------------------------------------------- layers
class _Fp8Layer:
    """What ``Fp8Linear`` and ``Fp8Conv2d`` share (mixed in before the torch class; never instantiated: layers are
    converted in place by ``quantize_module``)."""

    weight_fp8: torch.nn.Parameter  # uint8 storage of the e4m3fn values, shaped like the weight
    weight_scale: torch.Tensor  # int32 0-d: the float32 scale's bits
    fp8_scale: float
    fp8_fast: bool
    fp8_compute_like: torch.Tensor  # 0 elements, non-persistent: its dtype follows ``module.to`` like a bias's

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the layer computes in (the last ``module.to(dtype)``'s, else quantization's)."""
        return self.fp8_compute_like.dtype

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight in ``compute_dtype``, a new tensor on the storage's device. Read-only (module
        docstring): writes to it never reach the fp8 storage."""
        return dequantize(self.weight_fp8, self.fp8_scale, self.compute_dtype)

    def scale_tensor(self) -> torch.Tensor:
        """The scale as a float32 0-d tensor on the storage's device (a view of ``weight_scale``)."""
        return self.weight_scale.view(torch.float32)

    def _dequantized_for(self, x: torch.Tensor) -> torch.Tensor:
        return dequantize(self.weight_fp8, self.fp8_scale, x.dtype)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)  # type: ignore[misc]
        self.fp8_scale = float(self.weight_scale.view(torch.float32))  # keep the float mirror in step

    def _fp8_repr(self) -> str:
        return f"fp8_e4m3fn{' fast' if self.fp8_fast else ''}, scale={self.fp8_scale:.3g}"


class Fp8Linear(_Fp8Layer, torch.nn.Linear):
    """An ``nn.Linear`` whose weight is stored in fp8 (module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.fp8_fast and x.is_cuda and x.dtype == FAST_OUT_DTYPE and x.numel() > 0
                and not (torch.is_grad_enabled() and x.requires_grad)):
            return fp8_linear_fast(x, self.weight_fp8.view(FP8_DTYPE), self.scale_tensor(), self.bias)
        return F.linear(x, self._dequantized_for(x), self.bias)

    def extra_repr(self) -> str:
        return f"{torch.nn.Linear.extra_repr(self)}, {self._fp8_repr()}"


class Fp8Conv2d(_Fp8Layer, torch.nn.Conv2d):
    """An ``nn.Conv2d`` whose weight is stored in fp8 (always the dequantizing path)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(x, self._dequantized_for(x), self.bias)

    def extra_repr(self) -> str:
        return f"{torch.nn.Conv2d.extra_repr(self)}, {self._fp8_repr()}"


_FP8_CLASS = {torch.nn.Linear: Fp8Linear, torch.nn.Conv2d: Fp8Conv2d}


def is_fp8_layer(module: torch.nn.Module) -> bool:
    return isinstance(module, _Fp8Layer)


def fp8_layers(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(name, layer)`` of every fp8-stored layer inside ``module`` (itself included)."""
    return [(n, m) for n, m in module.named_modules() if is_fp8_layer(m)]


def storage_name(module: Optional[torch.nn.Module]) -> Optional[str]:
    """``"fp8_e4m3fn_fast"`` when a layer of ``module`` runs fp8 matmuls, ``"fp8_e4m3fn"`` when it has fp8-stored
    layers, else None (weights in the compute dtype)."""
    if module is None:
        return None
    layers = [m for _, m in fp8_layers(module)]
    if not layers:
        return None
    return STORAGE_NAMES[1] if any(m.fp8_fast for m in layers) else STORAGE_NAMES[0]


def weight_shape(module: torch.nn.Module) -> torch.Size:
    """The weight's shape without dequantizing (an fp8 layer's storage has the weight's shape)."""
    return module.weight_fp8.shape if is_fp8_layer(module) else module.weight.shape


def weight_storage(module: torch.nn.Module) -> torch.Tensor:
    """The tensor that holds the layer's weight values: the fp8 storage Parameter, else ``weight`` (what identifies
    the values: its storage, device and in-place write count)."""
    return module.weight_fp8 if is_fp8_layer(module) else module.weight


def weight_values(module: torch.nn.Module, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """The weight's values readable *outside* a forward, in ``dtype`` on ``device`` (default: where they are read
    from): a streamed weight's pinned host copy (its device slot holds another block's weights between forwards;
    ``streaming.host_copy``), dequantized for an fp8 layer (after the 1-byte storage moved)."""
    source = weight_storage(module)
    held = host_copy(source)
    source = (source if held is None else held).detach()
    if is_fp8_layer(module):
        return dequantize(source.to(device) if device is not None else source, module.fp8_scale, dtype)
    return source.to(device=device, dtype=dtype)


# --------------------------------------------------------------------------------------------- converting
@dataclass(frozen=True)
class Fp8Summary:
    """What ``quantize_module`` did: layers stored in fp8 (of which ``fast_layers`` run fp8 matmuls), their fp8
    bytes, and Linear / Conv2d subclasses left in the compute dtype (their own ``forward`` is kept)."""

    layers: int
    fast_layers: int
    fp8_bytes: int
    skipped: tuple = ()


def _prequantized_entry(key: str, value, layer: torch.nn.Module) -> tuple[torch.Tensor, float]:
    """Validate one ``prequantized`` entry against ``layer``: ``(uint8 storage, scale)``."""
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise TypeError(f"prequantized[{key!r}]: expected a (float8_e4m3fn tensor, scale) pair, got "
                        f"{type(value).__name__}")
    q, scale = value
    if not isinstance(q, torch.Tensor) or q.dtype != FP8_DTYPE:
        raise ValueError(f"prequantized[{key!r}]: expected a torch.float8_e4m3fn tensor, got "
                         f"{getattr(q, 'dtype', type(q).__name__)}; other fp8 formats (e5m2) must be dequantized "
                         f"and passed as ordinary weights")
    want = tuple(layer.weight.shape)
    if tuple(q.shape) != want:
        raise ValueError(f"prequantized[{key!r}]: shape {tuple(q.shape)} does not match the layer's weight {want}")
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"prequantized[{key!r}]: expected a per-tensor scale (1 element), got shape "
                             f"{tuple(scale.shape)}")
        scale = float(scale.detach().float().reshape(()))
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or not scale > 0:
        raise ValueError(f"prequantized[{key!r}]: scale={scale!r}: expected a finite positive number")
    return q.detach().contiguous().view(STORAGE_DTYPE), _fp32(float(scale))


def _convert(layer: torch.nn.Module, storage: torch.Tensor, scale: float) -> None:
    """Swap ``layer`` (an exact ``nn.Linear`` / ``nn.Conv2d``) into its fp8 class in place (``fp8_fast`` and the
    compute dtype are set by the caller)."""
    fp8_class = _FP8_CLASS[type(layer)]
    del layer._parameters["weight"]
    layer.__class__ = fp8_class
    layer.register_parameter("weight_fp8", torch.nn.Parameter(storage, requires_grad=False))
    layer.register_buffer("weight_scale", _scale_bits(scale, storage.device))
    layer.fp8_scale = scale


def _normalised_prequantized(prequantized, layers: dict) -> dict:
    if prequantized is None:
        return {}
    if not isinstance(prequantized, Mapping):
        raise TypeError(f"prequantized: expected a dict of layer name -> (float8_e4m3fn tensor, scale), got "
                        f"{type(prequantized).__name__}")
    out = {}
    for key, value in prequantized.items():
        name = key[:-len(".weight")] if isinstance(key, str) and key.endswith(".weight") else key
        if name not in layers:
            raise ValueError(f"prequantized[{key!r}]: no nn.Linear / nn.Conv2d of that name in the module (names as "
                             f"in module.named_modules(), with or without '.weight')")
        if name in out:
            raise ValueError(f"prequantized: {name!r} given twice (with and without '.weight')")
        out[name] = _prequantized_entry(key, value, layers[name])
    return out


@torch.no_grad()
def quantize_module(module: torch.nn.Module, compute_dtype: torch.dtype, fast: bool = False,
                    prequantized: Optional[Mapping[str, tuple]] = None,
                    work_device: Optional[torch.device] = None) -> Fp8Summary:
    """Store every ``nn.Linear`` / ``nn.Conv2d`` weight of ``module`` in fp8, in place, and cast its other floating
    parameters and buffers (biases, norms, embeddings) to ``compute_dtype``.

    - ``fast``: Linear layers whose shape suits ``torch._scaled_mm`` run fp8 matmuls on CUDA (decide it with
      ``resolve_fast``: this function does not check the GPU).
    - ``prequantized``: ``{layer name: (float8_e4m3fn tensor, scale)}`` for weights that are already fp8 (a split
      fp8 checkpoint): stored as given, not re-quantized. Names as in ``module.named_modules()``, with or without a
      trailing ``.weight``; the scale a float or a 1-element tensor. A layer whose ``weight`` is itself
      float8_e4m3fn (an unscaled fp8 checkpoint) is stored as is with scale 1.
    - ``work_device``: where to run the quantization (e.g. the GPU, much faster than the CPU for a multi-GB model);
      the fp8 storage goes back to each weight's own device.
    Layers already fp8-stored keep their storage (``fast`` is re-applied). Subclasses of Linear / Conv2d keep their
    weights (their ``forward`` may not be plain) and are listed in the summary's ``skipped``. Arguments and
    ``prequantized`` are validated before any layer changes; a NaN / infinite weight is found while quantizing
    (one pass over the weights) and raises ``ValueError`` naming the layer, leaving the layers before it converted
    (a load discards its modules on error).
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
    if compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype={compute_dtype!r}: expected torch.float16, torch.bfloat16 or torch.float32")
    if not isinstance(fast, bool):
        raise TypeError(f"fast: expected a bool, got {type(fast).__name__}")
    layers = {n: m for n, m in module.named_modules() if type(m) in _FP8_CLASS}
    pre = _normalised_prequantized(prequantized, layers)
    skipped = tuple(n for n, m in module.named_modules()
                    if isinstance(m, tuple(_FP8_CLASS)) and type(m) not in _FP8_CLASS and not is_fp8_layer(m))
    meta = [n for n, m in layers.items() if n not in pre and m.weight.device.type == "meta"]
    if meta:
        raise ValueError(f"module.{meta[0]}.weight is on the meta device (no values): pass its fp8 values in "
                         f"prequantized ({len(meta)} such layers)")
    for name, layer in layers.items():
        if name in pre:
            storage, scale = pre[name]
        elif layer.weight.dtype == FP8_DTYPE:
            storage, scale = layer.weight.detach().contiguous().view(STORAGE_DTYPE), 1.0
        else:
            home = layer.weight.device
            w = layer.weight.detach()
            q, scale = quantize(w if work_device is None else w.to(work_device), name=f"module.{name}.weight")
            storage = q.view(STORAGE_DTYPE).to(home)
            del q
        _convert(layer, storage, scale)
    for _, layer in fp8_layers(module):
        layer.fp8_fast = bool(fast and isinstance(layer, Fp8Linear)
                              and fast_shape_ok(layer.in_features, layer.out_features))
        layer.register_buffer("fp8_compute_like", torch.empty(0, dtype=compute_dtype,
                                                              device=layer.weight_fp8.device), persistent=False)
    module.to(dtype=compute_dtype)  # biases, norms, embeddings: the fp8 storage is integer-typed, untouched
    found = fp8_layers(module)
    summary = Fp8Summary(layers=len(found), fast_layers=sum(1 for _, m in found if m.fp8_fast),
                         fp8_bytes=sum(m.weight_fp8.numel() for _, m in found), skipped=skipped)
    if skipped:
        logger.info("fp8 storage: %d Linear/Conv2d subclasses keep %s weights: %s", len(skipped), compute_dtype,
                    ", ".join(skipped[:8]) + (" ..." if len(skipped) > 8 else ""))
    return summary


@torch.no_grad()
def dequantize_module(module: torch.nn.Module, dtype: Optional[torch.dtype] = None) -> int:
    """Undo ``quantize_module`` in place: every fp8 layer becomes a plain ``nn.Linear`` / ``nn.Conv2d`` holding its
    dequantized weight (``Q * s`` in ``dtype``, default the layer's ``compute_dtype``); the fp8 rounding stays.
    Returns how many layers changed. (The reference of the fp8 tests: an fp8 layer equals this plain layer.)"""
    count = 0
    for _, layer in fp8_layers(module):
        w = weight_values(layer, dtype or layer.compute_dtype).to(layer.weight_fp8.device)
        plain = torch.nn.Linear if isinstance(layer, Fp8Linear) else torch.nn.Conv2d
        del layer._parameters["weight_fp8"]
        del layer._buffers["weight_scale"], layer._buffers["fp8_compute_like"]
        for attr in ("fp8_scale", "fp8_fast"):
            layer.__dict__.pop(attr, None)
        layer.__class__ = plain
        layer.register_parameter("weight", torch.nn.Parameter(w, requires_grad=False))
        count += 1
    return count

"""LyCORIS LoHa and LoKr layers in the kohya layout (``lora_unet_*`` / ``lora_te*_*`` key prefixes).

LoHa (``hada_w1_a [out, r1]``, ``hada_w1_b [r1, n]``, ``hada_w2_a [out, r2]``, ``hada_w2_b [r2, n]``, optional
``alpha``; ``n = in * kh * kw``, so conv factors are 2-D and the kernel comes from the module):

    dW = scale * (w1_a @ w1_b) * (w2_a @ w2_b)        (elementwise product)     scale = alpha / r1, 1 without alpha

LoKr (``W1`` = ``lokr_w1 [o1, i1]`` or ``lokr_w1_a @ lokr_w1_b``; ``W2`` = ``lokr_w2 [o2, i2(, kh, kw)]``, or
``lokr_w2_a [o2, r] @ lokr_w2_b [r, i2 * kh * kw]``, or with ``lokr_t2 [r, r, kh, kw]`` (Tucker, conv only)
``W2[p, q, :, :] = sum_ij t2[i, j] * w2_a[i, p] * w2_b[j, q]`` with ``w2_a [r, o2]``, ``w2_b [r, i2]``):

    dW = scale * kron(W1, W2)        out = o1 * o2, in = i1 * i2 (W2 carries the kernel)
    scale = alpha / r when W1 or W2 is low-rank (r = the ``_b`` factor's rows), else 1 (also without alpha)

These are ComfyUI's rules (``comfy/weight_adapter/loha.py``, ``lokr.py``: ``alpha / w1_b.shape[0]``; LoKr
``alpha / dim`` only when a factor was decomposed) and LyCORIS' (``alpha / lora_dim``; LoKr with two full factors
forces ``alpha = lora_dim``). One difference: a stored ``alpha`` of 0 is ``scale = 0`` here and in ComfyUI (as for
plain LoRA), while LyCORIS' trainer reads it as "alpha = rank". A LoKr file whose two factors are both low-rank
with different ranks, and LoHa Tucker files (``hada_t1``), are refused. LoKr's low-rank and Tucker factors are
multiplied out here, once, in fp32 (``W1``, ``W2`` are small: their sizes multiply to the layer's).

How the terms run (``fullrank.py``): LoHa's ``dW`` equals a rank-``r1 * r2`` LoRA through the face-splitting
(row-wise Khatri-Rao) identity ``(A1 B1) * (A2 B2) = (A1 (.) A2) (B1 (.) B2)``, with ``up[o, i*r2+j] =
w1_a[o, i] w2_a[o, j]`` and ``down[i*r2+j, n] = w1_b[i, n] w2_b[j, n]`` (``khatri_rao_up`` / ``_down``); that form
is used when it costs at most one dense GEMM of the layer per token (``r1 r2 (n + out) <= n * out``, e.g. every
attention and feed-forward layer of SDXL up to rank 16), else ``dW`` is built each forward.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Optional

import torch

from .dora import placed_magnitude

LOHA_SUFFIXES = (".hada_w1_a", ".hada_w1_b", ".hada_w2_a", ".hada_w2_b")
LOKR_SUFFIXES = (".lokr_w1", ".lokr_w1_a", ".lokr_w1_b", ".lokr_w2", ".lokr_w2_a", ".lokr_w2_b", ".lokr_t2")
LYCORIS_SUFFIXES = LOHA_SUFFIXES + LOKR_SUFFIXES
_PLAIN_SUFFIXES = (".lora_down.weight", ".lora_up.weight", ".lora_mid.weight")


def alpha_value(tensor: torch.Tensor, name: str, source: str) -> float:
    """The scalar of an ``.alpha`` key (files store it 0-d or as one element, in any float or int dtype)."""
    if tensor.numel() != 1:
        raise ValueError(f"lora {source}: layer {name} has an alpha of shape {tuple(tensor.shape)} "
                         f"({tensor.numel()} values); expected one number; the file is corrupt or not a LoRA")
    return float(tensor.float().item())


def lycoris_kind(group: Mapping[str, torch.Tensor]) -> str:
    """"LoHa", "LoKr" or "" (plain LoRA) for one layer's keys (suffix -> tensor)."""
    if any(k in group for k in LOHA_SUFFIXES):
        return "LoHa"
    if any(k in group for k in LOKR_SUFFIXES):
        return "LoKr"
    return ""


def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


@dataclass(frozen=True, eq=False)
class LohaLayer:
    """One module's LoHa factors (module docstring)."""

    component: str
    name: str
    naming: str
    w1a: torch.Tensor  # [out, r1]
    w1b: torch.Tensor  # [r1, in * kh * kw]
    w2a: torch.Tensor  # [out, r2]
    w2b: torch.Tensor  # [r2, in * kh * kw]
    scale: float
    source: str
    magnitude: Optional[torch.Tensor] = None

    kind = "LoHa"

    @property
    def in_dim(self) -> int:
        return int(self.w1b.shape[1])

    @property
    def out_dim(self) -> int:
        return int(self.w1a.shape[0])

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.w1a, self.w1b, self.w2a, self.w2b, self.magnitude) if t is not None)

    @property
    def dtype(self) -> torch.dtype:
        return self.w1b.dtype

    def delta_flat(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """``dW`` as ``[out, in * kh * kw]``, computed in ``dtype`` (default: the factors')."""
        a1, b1, a2, b2 = (t.to(dtype or self.dtype) for t in (self.w1a, self.w1b, self.w2a, self.w2b))
        return (a1 @ b1) * (a2 @ b2) * self.scale

    def placed(self, device: torch.device, dtype: torch.dtype) -> "LohaLayer":
        """On ``device``/``dtype`` with the scale folded into ``w1a`` (fp32 product, rounded once)."""
        w1a = (self.w1a.to(device=device, dtype=torch.float32) * self.scale).to(dtype)
        rest = {k: getattr(self, k).to(device=device, dtype=dtype) for k in ("w1b", "w2a", "w2b")}
        return replace(self, w1a=w1a, scale=1.0, magnitude=placed_magnitude(self.magnitude, device), **rest)

    def fit_problem(self, weight_shape: tuple) -> str:
        n = 1
        for d in weight_shape[1:]:
            n *= d
        if self.out_dim != weight_shape[0] or self.in_dim != n:
            flat = f" ([{weight_shape[0]}, {n}] flattened)" if len(weight_shape) > 2 else ""
            return (f"its LoHa factors make a [{self.out_dim}, {self.in_dim}] delta but the weight is "
                    f"{list(weight_shape)}{flat}")
        return ""

    def khatri_rao_cheaper(self) -> bool:
        """True when the rank-``r1*r2`` form costs at most one dense GEMM of the layer per token:
        ``r1 r2 (n + out) <= n * out`` (module docstring)."""
        r = self.w1a.shape[1] * self.w2a.shape[1]
        return r * (self.in_dim + self.out_dim) <= self.in_dim * self.out_dim


def khatri_rao_up(w1a: torch.Tensor, w2a: torch.Tensor) -> torch.Tensor:
    """``up[o, i*r2 + j] = w1a[o, i] * w2a[o, j]`` (``[out, r1*r2]``): the row-wise Khatri-Rao product."""
    return (w1a[:, :, None] * w2a[:, None, :]).flatten(1)


def khatri_rao_down(w1b: torch.Tensor, w2b: torch.Tensor) -> torch.Tensor:
    """``down[i*r2 + j, n] = w1b[i, n] * w2b[j, n]`` (``[r1*r2, n]``), so ``up @ down = (w1a @ w1b) * (w2a @ w2b)``."""
    return (w1b[:, None, :] * w2b[None, :, :]).flatten(0, 1)


@dataclass(frozen=True, eq=False)
class LokrLayer:
    """One module's LoKr factors, multiplied out (module docstring)."""

    component: str
    name: str
    naming: str
    w1: torch.Tensor  # [o1, i1]
    w2: torch.Tensor  # [o2, i2] or [o2, i2, kh, kw], or [o2, i2 * kh * kw] for a conv
    scale: float
    source: str
    magnitude: Optional[torch.Tensor] = None

    kind = "LoKr"

    @property
    def in_dim(self) -> int:
        return int(self.w1.shape[1] * self.w2[0].numel())

    @property
    def out_dim(self) -> int:
        return int(self.w1.shape[0] * self.w2.shape[0])

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.w1, self.w2, self.magnitude) if t is not None)

    @property
    def dtype(self) -> torch.dtype:
        return self.w2.dtype

    def delta_flat(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """``dW`` as ``[out, in * kh * kw]``, computed in ``dtype`` (default: the factors')."""
        dt = dtype or self.dtype
        return torch.kron(self.w1.to(dt), self.w2.flatten(1).to(dt)) * self.scale

    def placed(self, device: torch.device, dtype: torch.dtype) -> "LokrLayer":
        """On ``device``/``dtype`` with the scale folded into ``w1`` (fp32 product, rounded once)."""
        w1 = (self.w1.to(device=device, dtype=torch.float32) * self.scale).to(dtype)
        return replace(self, w1=w1, w2=self.w2.to(device=device, dtype=dtype), scale=1.0,
                       magnitude=placed_magnitude(self.magnitude, device))

    def w2_for(self, weight_shape: tuple) -> torch.Tensor:
        """``W2`` shaped ``[o2, i2, kh, kw]`` for a conv weight of ``weight_shape`` (``fit_problem`` is '')."""
        return self.w2.reshape(self.w2.shape[0], -1, *weight_shape[2:])

    def fit_problem(self, weight_shape: tuple) -> str:
        (o1, i1), o2 = self.w1.shape, self.w2.shape[0]
        out, inp, kernel = weight_shape[0], weight_shape[1], tuple(weight_shape[2:])
        taps = 1
        for d in kernel:
            taps *= d
        if self.w2.ndim == 4 and tuple(self.w2.shape[2:]) != (kernel or (1, 1)):
            return f"its LoKr lokr_w2 has kernel {_shape(self.w2)[2:]} but the layer's kernel is {kernel or '(linear)'}"
        per_in = self.w2[0].numel()
        if o1 * o2 != out or per_in % taps or i1 * (per_in // taps) != inp:
            return (f"its LoKr factors W1 {list(self.w1.shape)} (x) W2 {list(self.w2.shape)} make a "
                    f"[{o1 * o2}, {i1 * per_in}] delta but the weight is {list(weight_shape)}")
        return ""


def _need(group: Mapping[str, torch.Tensor], keys: tuple, base: str, source: str, kind: str, why: str) -> None:
    missing = [k for k in keys if k not in group]
    if missing:
        have = ", ".join(sorted(k.lstrip(".") for k in group))
        raise ValueError(f"lora {source}: {kind} layer {base} lacks {', '.join(m.lstrip('.') for m in missing)} "
                         f"({why}; it has {have}); the file is incomplete: re-export it")


def _matrix(t: torch.Tensor, key: str, base: str, source: str, ndims: tuple = (2,)) -> torch.Tensor:
    if not t.is_floating_point() or t.ndim not in ndims or t.numel() == 0:
        raise ValueError(f"lora {source}: layer {base} has {key.lstrip('.')} of shape {_shape(t)} ({t.dtype}); "
                         f"expected a non-empty float tensor with {' or '.join(map(str, ndims))} dimensions")
    return t


def _mismatch(base: str, source: str, what: str) -> ValueError:
    return ValueError(f"lora {source}: layer {base} has inconsistent factors: {what}; the file is corrupt")


def _parse_loha(g, component, name, naming, base, source, magnitude) -> LohaLayer:
    _need(g, LOHA_SUFFIXES, base, source, "LoHa", "a LoHa layer needs all four hada_ factors")
    w1a, w1b, w2a, w2b = (_matrix(g[k], k, base, source) for k in LOHA_SUFFIXES)
    if w1a.shape[1] != w1b.shape[0] or w2a.shape[1] != w2b.shape[0]:
        raise _mismatch(base, source, f"hada_w1_a {_shape(w1a)} @ hada_w1_b {_shape(w1b)} and hada_w2_a "
                                      f"{_shape(w2a)} @ hada_w2_b {_shape(w2b)} must share their rank")
    if w1a.shape[0] != w2a.shape[0] or w1b.shape[1] != w2b.shape[1]:
        raise _mismatch(base, source, f"the two Hadamard factors hada_w1_a @ hada_w1_b [{w1a.shape[0]}, "
                                      f"{w1b.shape[1]}] and hada_w2_a @ hada_w2_b [{w2a.shape[0]}, {w2b.shape[1]}] "
                                      f"must have one shape")
    scale = alpha_value(g[".alpha"], base, source) / w1b.shape[0] if ".alpha" in g else 1.0
    return LohaLayer(component, name, naming, w1a, w1b, w2a, w2b, scale, source=base, magnitude=magnitude)


def _lokr_factor(g, which: str, base: str, source: str) -> tuple[torch.Tensor, Optional[int]]:
    """``W1`` or ``W2`` (fp32, multiplied out) and the rank it was decomposed with (None when stored whole)."""
    full, a_key, b_key = f".lokr_{which}", f".lokr_{which}_a", f".lokr_{which}_b"
    has_ab = [k for k in (a_key, b_key) if k in g]
    if full in g and has_ab:
        raise ValueError(f"lora {source}: LoKr layer {base} has both lokr_{which} and {has_ab[0].lstrip('.')}; "
                         f"expected one of them; the file is inconsistent")
    if full in g:
        return _matrix(g[full], full, base, source, (2, 4) if which == "w2" else (2,)).float(), None
    _need(g, (a_key, b_key), base, source, "LoKr",
          f"a LoKr layer needs lokr_{which}, or lokr_{which}_a with lokr_{which}_b")
    a, b = _matrix(g[a_key], a_key, base, source), _matrix(g[b_key], b_key, base, source)
    t_key = ".lokr_t2"
    if which == "w2" and t_key in g:  # Tucker: a [r, o2], b [r, i2], t [r, r, kh, kw]
        t = _matrix(g[t_key], t_key, base, source, (4,))
        if t.shape[0] != a.shape[0] or t.shape[1] != b.shape[0]:
            raise _mismatch(base, source, f"lokr_t2 {_shape(t)} must be [r, r, kh, kw] for lokr_w2_a {_shape(a)} "
                                          f"[r, o2] and lokr_w2_b {_shape(b)} [r, i2]")
        return torch.einsum("ijkl,ip,jq->pqkl", t.float(), a.float(), b.float()), int(b.shape[0])
    if a.shape[1] != b.shape[0]:
        raise _mismatch(base, source, f"lokr_{which}_a {_shape(a)} @ lokr_{which}_b {_shape(b)} must share "
                                      f"their rank")
    return a.float() @ b.float(), int(b.shape[0])


def _parse_lokr(g, component, name, naming, base, source, magnitude) -> LokrLayer:
    if ".lokr_t2" in g and ".lokr_w2_a" not in g:
        raise ValueError(f"lora {source}: LoKr layer {base} has lokr_t2 without lokr_w2_a/lokr_w2_b; the file is "
                         f"incomplete: re-export it")
    w1, r1 = _lokr_factor(g, "w1", base, source)
    w2, r2 = _lokr_factor(g, "w2", base, source)
    if r1 is not None and r2 is not None and r1 != r2:
        raise _mismatch(base, source, f"W1 is decomposed with rank {r1} and W2 with rank {r2}; LyCORIS writes one "
                                      f"rank for both")
    rank = r2 if r2 is not None else r1
    scale = alpha_value(g[".alpha"], base, source) / rank if (rank is not None and ".alpha" in g) else 1.0
    return LokrLayer(component, name, naming, w1, w2, scale, source=base, magnitude=magnitude)


def parse_lycoris(group: Mapping[str, torch.Tensor], component: str, name: str, naming: str, base: str, source: str,
                  magnitude: Optional[torch.Tensor]):
    """One kohya-layout layer group (suffix -> tensor) holding LoHa or LoKr keys -> its layer (``naming``: how
    ``name`` spells the module, ``"kohya"`` or ``"dotted"``; ``formats.PREFIXES``)."""
    kind = lycoris_kind(group)
    foreign = sorted(k.lstrip(".") for k in group if k in _PLAIN_SUFFIXES or
                     (k in LYCORIS_SUFFIXES and k not in (LOHA_SUFFIXES if kind == "LoHa" else LOKR_SUFFIXES)))
    if foreign:
        raise ValueError(f"lora {source}: layer {base} mixes {kind} factors with {', '.join(foreign)}; one layer "
                         f"holds one adapter kind; the file is inconsistent")
    parse = _parse_loha if kind == "LoHa" else _parse_lokr
    return parse(group, component, name, naming, base, source, magnitude)

"""The one place the pack reads a whole weights file: pickle-based (``.pth`` / ``.pt`` / ``.ckpt`` / ``.bin``) or
``.safetensors`` (tensors and header metadata; LoRA, upscaler and embedding files).

Invariant: such files are read only with ``torch.load(..., weights_only=True)`` on the CPU, so a pickle that would
run code is refused, never executed; every failure becomes one ``ValueError`` that names the file, says in one line
why it could not be read and what to do. PyTorch's own message for a refused pickle is several paragraphs that end
in advice to re-run with ``weights_only=False``, which the pack never does: only its reason line is kept. A
safetensors file that is cut short or garbled is the same kind of one-line ``ValueError`` (safetensors raises its
own ``SafetensorError``, whose text names no file).

Tensors read from a ``.safetensors`` file own their memory. ``safe_open`` maps the file, and the tensors it returns
are views of that mapping (safetensors 0.4.2 to 0.8.0 alike): a file then overwritten in place (``cp``,
a trainer saving a LoRA under the same name with ``open(..., "wb")``) changed the weights of a LoRA, upscaler or
embedding the pack had cached, and one overwritten by a shorter file killed ComfyUI with SIGBUS when the cached
tensor was next read. Each tensor is copied off the mapping before the file is closed; these files are small, so
the copy costs little.

A tensor holding NaN or infinite values (a diverged training run, a bad fp16 conversion) loads without complaint
and then turns every output NaN (black) or into noise; ``refuse_non_finite`` is the one scan the LoRA and upscaler
loaders run on what they read, so such a file is refused by name instead.
"""
from __future__ import annotations

import pickle
import warnings
import zipfile
from pathlib import Path
from typing import Any, Mapping, Union

import torch

_LOAD_ERRORS = (pickle.UnpicklingError, RuntimeError, EOFError, OSError, zipfile.BadZipFile, ValueError,
                AttributeError, KeyError, IndexError, TypeError, ImportError)
_REASON_MARK = "WeightsUnpickler error:"
_MAX_REASON = 200


def load_error_reason(exc: BaseException) -> str:
    """One short line saying why ``torch.load(weights_only=True)`` failed (torch's advice paragraphs dropped)."""
    text = str(exc) or type(exc).__name__
    if _REASON_MARK in text:
        tail = text.split(_REASON_MARK, 1)[1]
        lines = [ln.strip() for ln in tail.strip().splitlines() if ln.strip()]
        reason = _short(lines[0].split(". ")[0].rstrip(".")) if lines else "no reason given"  # torch's advice follows
        if "global" in reason.lower() or "class" in reason.lower():
            return f"it refers to Python code or classes, which are refused for safety ({reason})"
        return f"not a torch weights file, or corrupt (the safe unpickler stopped: {reason})"
    if isinstance(exc, EOFError) or "central directory" in text or "failed reading" in text:
        return f"the file is cut short or corrupt ({_short(text.splitlines()[0])})"
    return _short(text.splitlines()[0])


def load_tensors(path: Union[str, Path], what: str) -> Any:
    """``torch.load(path, map_location="cpu", weights_only=True)``; ``ValueError`` naming ``what`` and the file."""
    path = Path(path)
    try:
        with warnings.catch_warnings():  # "Detected pickle protocol 4": noise next to the refusal that follows
            warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
            return torch.load(str(path), map_location="cpu", weights_only=True)
    except _LOAD_ERRORS as exc:
        raise ValueError(f"{what} {path.name!r} could not be read as a torch weights file: {load_error_reason(exc)}. "
                         f"Re-download it if it is cut short, or convert it to .safetensors") from exc


def read_safetensors(path: Union[str, Path], what: str) -> tuple[dict, dict]:
    """``(tensors, metadata)`` of a ``.safetensors`` file on the CPU, the tensors in memory of their own (none a view
    of the file); ``ValueError`` naming ``what`` and the file."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return {k: f.get_tensor(k).clone() for k in f.keys()}, dict(f.metadata() or {})  # off the mapping
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise ValueError(f"{what} {path.name!r} could not be read as a safetensors file (cut short or corrupt: "
                         f"{load_error_reason(exc)}); re-download it, or re-save it") from exc


def refuse_non_finite(state_dict: Mapping[str, torch.Tensor], source: str, consequence: str, fix: str) -> None:
    """``ValueError`` naming every tensor of ``state_dict`` that holds NaN or infinite values (up to ten), with
    ``source`` (the file), what the values would do (``consequence``) and what to do (``fix``)."""
    bad = []
    for key in sorted(state_dict):
        t = state_dict[key]
        # an fp32 sum is non-finite iff an entry is (or the sum overflows: then isfinite decides); it runs ~6x faster
        # than isfinite().all() on the CPU (26 vs 170 ms per 100 M fp16 values, one thread)
        if t.is_floating_point() and not bool(torch.isfinite(t.sum(dtype=torch.float32))) and \
                not bool(torch.isfinite(t).all()):
            if t.numel() == 1:
                bad.append(f"{key} = {t.float().item()}")
            else:
                nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
                bad.append(f"{key} has {nan} NaN and {inf} infinite of {t.numel()} values")
    if bad:
        raise ValueError(f"{source}: {len(bad)} tensors hold NaN or infinite values ({'; '.join(bad[:10])}"
                         f"{' ...' if len(bad) > 10 else ''}); they would turn {consequence}; the file is corrupt (a "
                         f"diverged training run or a bad fp16 conversion): {fix}")


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _MAX_REASON else text[:_MAX_REASON - 3] + "..."

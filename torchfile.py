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
"""
from __future__ import annotations

import pickle
import warnings
import zipfile
from pathlib import Path
from typing import Any, Union

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


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _MAX_REASON else text[:_MAX_REASON - 3] + "..."

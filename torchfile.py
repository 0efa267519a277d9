"""The one place the pack reads a whole weights file: pickle-based (``.pth`` / ``.pt`` / ``.ckpt`` / ``.bin``) or
``.safetensors`` (tensors and header metadata; LoRA, upscaler and embedding files).

Invariant: such files are read only with ``torch.load(..., weights_only=True)`` on the CPU, so a pickle that would
run code is refused, never executed; every failure becomes one ``ValueError`` that names the file, says in one line
why it could not be read and what to do. PyTorch's own message for a refused pickle is several paragraphs around
advice to re-run with ``weights_only=False``, which the pack never does: only its reason is kept (for a pickle that
would run code, the global it refers to, and the way out: a ``.safetensors`` file). A
safetensors file that is cut short or garbled is the same kind of one-line ``ValueError`` (safetensors raises its
own ``SafetensorError``, whose text names no file).

Tensors read from a ``.safetensors`` file own their memory. ``safe_open`` maps the file, and the tensors it returns
are views of that mapping (safetensors 0.4.2 to 0.8.0 alike): a file then overwritten in place (``cp``,
a trainer saving a LoRA under the same name with ``open(..., "wb")``) changed the weights of a LoRA, upscaler or
embedding the pack had cached, and one overwritten by a shorter file killed ComfyUI with SIGBUS when the cached
tensor was next read. Each tensor is copied off the mapping before the file is closed; these files are small, so
the copy costs little. Models loaded from files (single-file checkpoints, diffusers folders) get the same guarantee
from ``own_file_backed``, which copies only the weights still mapped from a file, one at a time.

A tensor holding NaN or infinite values (a diverged training run, a bad fp16 conversion) loads without complaint
and then turns every output NaN (black) or into noise; ``refuse_non_finite`` is the one scan the LoRA and upscaler
loaders run on what they read, so such a file is refused by name instead.
"""
from __future__ import annotations

import bisect
import math
import pickle
import re
import warnings
import zipfile
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Union

import torch

_LOAD_ERRORS = (pickle.UnpicklingError, RuntimeError, EOFError, OSError, zipfile.BadZipFile, ValueError,
                AttributeError, KeyError, IndexError, TypeError, ImportError)
_REASON_MARK = "WeightsUnpickler error:"
_WEIGHTS_ONLY_MARK = "Weights only load failed"
# how torch's safe unpickler names what it refused: a blocked module's global, a global outside its allow-list, an
# object of a class outside it
_CODE_MARKS = (re.compile(r"unsupported GLOBAL (\S+) whose module"),
               re.compile(r"GLOBAL (\S+) was not an allowed global"),
               re.compile(r"classes allowlisted via `add_safe_globals` but got ([^\n]+)"))
# lines of torch's message that advise rather than explain (re-run with weights_only=False, allow-list the global)
_ADVICE = ("weights_only", "trusted source", "check the documentation", "please file an issue", "safe_globals",
           "re-running")
_MAX_REASON = 200


def refused_code(exc: BaseException) -> Optional[str]:
    """What code ``exc`` (from ``torch.load(weights_only=True)``) says the file would have run: the Python global or
    class it refers to, e.g. ``posix.system``; ``None`` when the file was refused for another reason."""
    text = str(exc)
    for pattern in _CODE_MARKS:
        found = pattern.search(text)
        if found:
            return _short(found.group(1).rstrip(".,;"))
    return None


def load_error_reason(exc: BaseException) -> str:
    """One short line saying why ``torch.load(weights_only=True)`` (or a ``from_pretrained`` over it) failed: torch's
    advice paragraphs, which end in re-running with ``weights_only=False``, are dropped, its reason is kept."""
    code = refused_code(exc)
    if code is not None:
        return f"loading it would run code (it refers to the Python global {code}), which is refused for safety"
    text = str(exc) or type(exc).__name__
    if _WEIGHTS_ONLY_MARK in text or _REASON_MARK in text:
        tail = text.split(_REASON_MARK if _REASON_MARK in text else _WEIGHTS_ONLY_MARK, 1)[1]
        kept = [ln.strip() for ln in tail.splitlines()
                if ln.strip() and not any(advice in ln.lower() for advice in _ADVICE)]
        reason = _short(kept[0].lstrip(". ").split(". ")[0].rstrip(".")) if kept else "no reason given"
        return f"not a torch weights file, or corrupt (the safe unpickler stopped: {reason})"
    if "TorchScript" in text:
        return "a TorchScript archive, which holds code: refused for safety"
    if "legacy .tar format" in text:
        return "a torch file in the legacy .tar format, which the safe loader does not read"
    if isinstance(exc, EOFError) or "central directory" in text or "failed reading" in text:
        return f"the file is cut short or corrupt ({_short(text.splitlines()[0])})"
    return _short(text.splitlines()[0])


def load_tensors(path: Union[str, Path], what: str) -> Any:
    """``torch.load(path, map_location="cpu", weights_only=True)``; ``ValueError`` naming ``what`` and the file. A file
    that would run code is refused saying so (and which global), with the way out: a ``.safetensors`` file."""
    path = Path(path)
    try:
        with warnings.catch_warnings():  # "Detected pickle protocol 4": noise next to the refusal that follows
            warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
            return torch.load(str(path), map_location="cpu", weights_only=True)
    except _LOAD_ERRORS as exc:
        code = refused_code(exc)
        if code is not None:
            raise ValueError(f"{what} {path.name!r} is refused: loading it would run code (it refers to the Python "
                             f"global {code}), which is refused for safety; use a .safetensors file of these weights "
                             f"instead (safetensors files hold tensors only)") from exc
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


def own_file_backed(module: torch.nn.Module) -> int:
    """Copy, tensor by tensor, every parameter and buffer of ``module`` whose memory is a view of a file (safetensors
    and ``from_pretrained`` map files, and keep the mapping when the dtype needs no cast) into memory of its own;
    returns how many were copied. Afterwards no weight aliases a file on disk: one overwritten in place no longer
    changes the model, one cut short no longer kills the process with SIGBUS when a weight is read.

    Memory torch allocated itself (its storage is resizable) is never a file view and is left alone, as are tensors
    off the CPU. Other CPU memory is copied when it lies in a file mapping of ``/proc/self/maps``, or, where that
    table does not exist (Windows, macOS), always. The copy goes through ``.data``, so a weight tied between modules
    stays one tensor; one tensor at a time, so the process holds the model once plus one tensor, not twice.
    """
    mappings = _file_mappings()
    copied = 0
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for tensor in table.values():
                if tensor is not None and _file_backed(tensor, mappings):
                    tensor.data = tensor.data.clone()
                    copied += 1
    return copied


def _file_mappings() -> Optional[tuple[list[int], list[int]]]:
    """(starts, ends) of this process's file-backed memory mappings, sorted; ``None`` without ``/proc/self/maps``."""
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
            lines = maps.read().splitlines()
    except OSError:
        return None
    spans = []
    for line in lines:
        fields = line.split()
        if len(fields) >= 6 and fields[4] != "0":  # an inode: the mapping reads a file ([heap], anonymous: 0)
            start, end = fields[0].split("-")
            spans.append((int(start, 16), int(end, 16)))
    spans.sort()
    return [a for a, _ in spans], [b for _, b in spans]


def _file_backed(tensor: torch.Tensor, mappings: Optional[tuple[list[int], list[int]]]) -> bool:
    if tensor.device.type != "cpu":
        return False
    storage = tensor.untyped_storage()
    if storage.resizable() or storage.nbytes() == 0:  # torch's own allocation (or nothing to alias)
        return False
    if mappings is None:
        return True
    starts, ends = mappings
    at = bisect.bisect_right(starts, storage.data_ptr()) - 1
    return at >= 0 and storage.data_ptr() < ends[at]


def _fp32_sum(t: torch.Tensor) -> torch.Tensor:
    """One reduction kernel: ``t``'s sum in float32 (the cast fused into the load; a complex tensor's real and
    imaginary parts together), a 0-d tensor on ``t``'s device."""
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj())
    return t.sum(dtype=torch.float32)


def any_non_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """True when one of ``tensors`` holds NaN or an infinity (tensors that are not floating-point or complex, and
    empty ones, cannot). One fp32 sum per tensor and one host sync per device for all of them: NaN and infinities
    propagate through a sum, so a finite total proves every entry finite; a non-finite total (such an entry, or
    finite fp32/fp64 values whose sum overflows) is decided exactly, tensor by tensor, with ``isfinite().all()``.
    The common (finite) case is several times faster than ``isfinite().all()`` per tensor, which writes a mask."""
    checked = [t for t in tensors if (t.is_floating_point() or t.is_complex()) and t.numel()]
    sums: dict[torch.device, list[torch.Tensor]] = {}
    for t in checked:
        sums.setdefault(t.device, []).append(_fp32_sum(t))
    if all(math.isfinite(v) for per_device in sums.values() for v in torch.stack(per_device).tolist()):
        return False
    return any(not bool(torch.isfinite(t).all()) for t in checked)


def has_non_finite(t: torch.Tensor) -> bool:
    """True when a floating-point (or complex) ``t`` holds NaN or an infinity (``any_non_finite`` of one tensor)."""
    return any_non_finite((t,))


def refuse_non_finite(state_dict: Mapping[str, torch.Tensor], source: str, consequence: str, fix: str) -> None:
    """``ValueError`` naming every tensor of ``state_dict`` that holds NaN or infinite values (up to ten), with
    ``source`` (the file), what the values would do (``consequence``) and what to do (``fix``)."""
    bad = []
    for key in sorted(state_dict):
        t = state_dict[key]
        if has_non_finite(t):
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

"""Load a LoRA file onto a device once, and cache it per (path, file identity, device, dtype, components).

Invariant: a ``LoadedLora`` is immutable and model-independent; its layers hold the factors on the target
device and dtype with the file's scale folded into one factor (LoRA: ``up_loaded = (alpha / rank) * up_file``; LoHa:
``hada_w1_a``; LoKr: ``W1``; computed in fp32 and rounded once; each loaded layer's ``scale`` is 1.0; a DoRA
magnitude stays fp32). Views and bindings share it; nothing writes to it.

Layout: the ``up`` factors of a component's plain LoRA layers (no DoRA magnitude) are consecutive views of one flat
tensor, in layer order (``to_device``), so a binding rewrites their strength-scaled copies in one pass over
one span instead of one per layer (``strength_buffers.BufferArena``).

Cache: a bounded strong LRU (``MAX_CACHED`` most recent) plus a weak map, so a LoRA stays loaded as long as any
engine view uses it and a re-run of an unchanged workflow does not re-read the file. A file changed on disk
(mtime, size, inode or ctime: also a copy that kept the old size and mtime) is a new key.
"""
from __future__ import annotations

import collections
import logging
import threading
import weakref
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable, Optional

import torch

from .formats import LoraLayer, ParsedLora, parse_lora, read_state_dict

logger = logging.getLogger(__name__)

MAX_CACHED = 4
_LOCK = threading.Lock()
_STRONG: "collections.OrderedDict[tuple, LoadedLora]" = collections.OrderedDict()
_WEAK: "weakref.WeakValueDictionary[tuple, LoadedLora]" = weakref.WeakValueDictionary()


@dataclass(frozen=True, eq=False)
class LoadedLora:
    key: tuple  # (path, mtime_ns, size, inode, ctime_ns, device, dtype, components)
    parsed: ParsedLora  # layers on the device, scale folded into up
    name: str

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.parsed.layers)


def _file_key(path: Path) -> tuple:
    """Identifies a file's contents without reading them: a file replaced by rename has another inode, one rewritten
    in place another ctime, even when a copy kept the old size and mtime (``cp -p``, ``rsync -a``)."""
    st = path.stat()
    return str(path.resolve()), st.st_mtime_ns, st.st_size, st.st_ino, st.st_ctime_ns


def to_device(parsed: ParsedLora, device: torch.device, dtype: torch.dtype,
              components: Optional[Iterable[str]] = None) -> ParsedLora:
    """A copy of ``parsed`` (only ``components`` if given) on ``device``/``dtype`` with each layer's scale folded
    into one factor (``layer.placed``) and the plain layers' ``up`` factors packed (module docstring: Layout)."""
    keep = set(components) if components is not None else None
    layers = [layer for layer in parsed.layers if keep is None or layer.component in keep]
    flats, starts = {}, {}  # component -> one flat tensor for its plain layers' ups, next free element
    for comp in {layer.component for layer in layers}:
        n = sum(layer.up.numel() for layer in layers if layer.component == comp and _plain(layer))
        flats[comp], starts[comp] = torch.empty(n, device=device, dtype=dtype), 0
    placed = []
    for layer in layers:  # one placed layer at a time: the packing holds no second copy of the ups
        moved = layer.placed(device, dtype)
        if _plain(layer):
            start, n = starts[layer.component], moved.up.numel()
            view = flats[layer.component][start:start + n].view(moved.up.shape)
            view.copy_(moved.up)
            moved, starts[layer.component] = replace(moved, up=view), start + n
        placed.append(moved)
    return ParsedLora(parsed.format, tuple(placed), parsed.source)


def _plain(layer) -> bool:
    """A plain LoRA layer: low-rank factors without a DoRA magnitude (``fullrank.lowrank_factors``)."""
    return isinstance(layer, LoraLayer) and layer.magnitude is None


def load_lora(path: str | Path, device: torch.device | str, dtype: torch.dtype,
              components: Optional[Iterable[str]] = None) -> LoadedLora:
    """Read, parse and place a LoRA file (cached). Raises ValueError for unreadable or unsupported files."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"lora file {str(path)!r} does not exist; pick a file from the loras folder")
    device = torch.device(device)
    comps = None if components is None else tuple(sorted(set(components)))
    key = _file_key(path) + (str(device), str(dtype), comps)
    with _LOCK:
        hit = _STRONG.get(key) or _WEAK.get(key)
        if hit is not None:
            _STRONG[key] = hit
            _STRONG.move_to_end(key)
            return hit
    tensors, metadata = read_state_dict(path)
    parsed = parse_lora(tensors, metadata, source=path.name)
    del tensors
    loaded = LoadedLora(key, to_device(parsed, device, dtype, comps), path.name)
    logger.info("loaded lora %s (%s, %d layers, %.1f MB on %s %s)", path.name, parsed.format,
                len(loaded.parsed.layers), loaded.nbytes / 2**20, device, dtype)
    with _LOCK:
        _WEAK[key] = loaded
        _STRONG[key] = loaded
        while len(_STRONG) > MAX_CACHED:
            _STRONG.popitem(last=False)
    return loaded


def clear_cache() -> None:
    """Drop the strong references of the cache (views still holding a LoRA keep it alive)."""
    with _LOCK:
        _STRONG.clear()

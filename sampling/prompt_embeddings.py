"""Textual-inversion files (``embedding:NAME`` in a prompt) from ComfyUI's ``embeddings`` model folder.

Lookup (ComfyUI 0.3.64 ``load_embed``): ``NAME`` is tried in the folder and in every sub-folder, first as the exact
file name, then with ``.safetensors``, ``.pt``, ``.bin`` appended. We search the top level first, then sub-folders
in sorted order (ComfyUI's order over sub-folders is a set's, i.e. unspecified). Paths resolve through
``bridge.resolve_model`` so a name never escapes the folder.

Loading: safetensors, or ``torch.load(weights_only=True)`` for ``.pt`` / ``.bin`` (old pickles that need more than
tensors are refused with a clear error; convert them to safetensors). Tensor selection follows ComfyUI:
``string_to_param`` (A1111 ``.pt``) -> its first tensor; a list of dicts -> every tensor whose width matches,
concatenated; the encoder's key (``clip_l`` / ``clip_g`` / ``clip_h``, SDXL files carry both) -> that tensor;
LoRA-bundled ``bundle_emb.*.string_to_param.*`` / ``bundle_emb.*.<key>`` -> concatenated; otherwise the first
tensor (``emb_params`` of kohya-style safetensors). The result is ``[n_vectors, width]`` float32.

Deviation from ComfyUI, on purpose: a vector whose width does not match the encoder raises ``ValueError``
(ComfyUI logs a warning, drops the vectors and shifts the rest of the chunk).
"""
from __future__ import annotations

import functools
import logging
from typing import Optional

import torch

from .. import bridge
from ..memory.finite import refuse_non_finite_input
from ..torchfile import load_tensors, read_safetensors

logger = logging.getLogger(__name__)

FOLDER = "embeddings"
EXTENSIONS = (".safetensors", ".pt", ".bin")


def available_embeddings() -> list[str]:
    """Relative names of every embedding file in the ``embeddings`` folder(s)."""
    return bridge.list_models(FOLDER, EXTENSIONS)


def find_embedding(name: str, available: Optional[list[str]] = None) -> Optional[str]:
    """The relative file name ``embedding:name`` refers to, or ``None`` when there is none."""
    if not name:
        return None
    names = available if available is not None else available_embeddings()
    present = set(names)
    folders = sorted({n.rsplit("/", 1)[0] + "/" for n in names if "/" in n})
    for prefix in [""] + folders:
        for candidate in (prefix + name,) + tuple(prefix + name + ext for ext in EXTENSIONS):
            if candidate in present:
                return candidate
    return None


def file_signature(relative: str) -> tuple:
    """(path, size, mtime, inode, ctime) of an embedding file: part of the prompt cache key, so editing or replacing
    a file invalidates, also when a copy kept the old size and mtime (``cp -p``, ``rsync -a``)."""
    path = bridge.resolve_model(FOLDER, relative, "embedding")
    st = path.stat()
    return (str(path), st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)


def _concat_matching(tensors: list, width: int) -> Optional[torch.Tensor]:
    rows = [t.reshape(-1, t.shape[-1]) for t in tensors if torch.is_tensor(t) and t.shape[-1] == width]
    return torch.cat(rows, dim=0) if rows else None


_LORA_MARKS = ("lora_down", "lora_up", "lora_A", "lora_B", ".alpha", "hada_w", "lokr_w", "lora.down", "lora.up")


def _refuse_lora(obj: dict, name: str) -> None:
    """``ValueError`` for a LoRA file named as an embedding: its first tensor is a LoRA factor or a scalar alpha."""
    lora_keys = [k for k in obj if isinstance(k, str) and any(m in k for m in _LORA_MARKS)]
    if lora_keys:
        sample = ", ".join(sorted(lora_keys)[:3])
        raise ValueError(
            f"embedding:{name} is a LoRA file (keys such as {sample}), not a textual-inversion embedding; remove "
            f"embedding:{name} from the prompt and load the file with the LoRA injector node instead")


def _select(obj, key: str, width: int, name: str) -> torch.Tensor:
    if isinstance(obj, dict) and "string_to_param" in obj:
        params = obj["string_to_param"]
        values = list(params.values()) if isinstance(params, dict) else []
        if values:
            return values[0]
    elif isinstance(obj, list):
        found = _concat_matching([t for d in obj if isinstance(d, dict) for t in d.values()], width)
        if found is not None:
            return found
    elif isinstance(obj, dict):
        if key in obj:
            return obj[key]
        for suffix in (".string_to_param.*", "." + key):
            bundled = [obj[k] for k in obj if k.startswith("bundle_emb.") and k.endswith(suffix)]
            if bundled:
                return torch.cat(bundled, dim=0)
        _refuse_lora(obj, name)
        tensors = [v for v in obj.values() if torch.is_tensor(v)]
        if tensors:
            return tensors[0]
    raise ValueError(f"embedding:{name}: the file holds no textual-inversion tensor ComfyUI would read "
                     f"(expected emb_params, string_to_param, {key} or a list of tensors)")


@functools.lru_cache(maxsize=32)
def _load_file(path: str, *signature: int):  # signature: the rest of file_signature, so a changed file is a miss
    if path.lower().endswith(".safetensors"):
        return read_safetensors(path, "embedding file")[0]
    return load_tensors(path, "embedding file")


def load_embedding(relative: str, key: str, width: int) -> torch.Tensor:
    """Vectors ``[n, width]`` float32 (CPU) of the embedding file ``relative`` for the encoder ``key``."""
    obj = _load_file(*file_signature(relative))
    tensor = _select(obj, key, width, relative)
    if not torch.is_tensor(tensor):
        raise ValueError(f"embedding:{relative}: expected a tensor under the selected key, got {type(tensor).__name__}")
    if tensor.dim() == 0:
        raise ValueError(f"embedding:{relative}: the selected tensor is a single number, not [vectors, {width}]; "
                         f"this is not a textual-inversion embedding, use an embedding file trained for this model")
    vectors = tensor.detach().reshape(-1, tensor.shape[-1]).to(torch.float32)
    refuse_non_finite_input(vectors, f"embedding:{relative}", "the file is corrupt; use another embedding file")
    if vectors.shape[-1] != width:
        raise ValueError(
            f"embedding:{relative} has vectors of width {vectors.shape[-1]}, but the {key} text encoder expects "
            f"{width}; use an embedding trained for this model family")
    return vectors

"""CLIP tokenizers for loaded models: the model folder's own, else ComfyUI's bundled files, else a clear error.

Invariant: nothing is ever fetched from a hub. Single-file checkpoints carry no tokenizer; every SD family uses
CLIP's BPE vocabulary (SD2's and SDXL's OpenCLIP towers included), so one ``vocab.json`` + ``merges.txt`` pair
serves all. OpenCLIP towers (SD2's encoder, SDXL's second encoder) pad with ``!`` (token 0) instead of the end
token, as diffusers' SD2/SDXL tokenizers and ComfyUI's SD2/SDXL CLIP-G tokenizers do.

Search order for a single-file checkpoint ``<dir>/<name>.safetensors``:
1. ``<dir>/<name>.tokenizer/`` or ``<dir>/tokenizer/`` holding ``vocab.json`` and ``merges.txt``;
2. ComfyUI's ``comfy/sd1_tokenizer/`` (through ``bridge.comfy_tokenizer_dir()``, only inside ComfyUI);
3. otherwise ``ValueError`` saying where to put the two files.

A diffusers folder without its own tokenizer files is searched the same way, with ``<folder>/tokenizer/`` first.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

from .. import bridge

logger = logging.getLogger(__name__)

OPENCLIP_PAD = "!"


def _has_bpe(folder: Path) -> bool:
    return (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file()


def find_tokenizer_dir(model: Path) -> Path:
    """The folder holding CLIP BPE files for ``model``: a single-file checkpoint (see the module docstring for the
    order) or a diffusers folder whose own ``tokenizer``/``tokenizer_2`` sub-folders lack them (then its
    ``tokenizer/``, else ComfyUI's bundled files)."""
    model = Path(model)
    folder = model.is_dir()
    if folder:
        candidates = [model / "tokenizer"]
    else:
        candidates = [model.parent / f"{model.stem}.tokenizer", model.parent / "tokenizer"]
    for candidate in candidates:
        if _has_bpe(candidate):
            return candidate
    comfy = bridge.comfy_tokenizer_dir()
    if comfy is not None and _has_bpe(Path(comfy)):
        return Path(comfy)
    if folder:
        what, where = "this diffusers folder has none", f"{candidates[0]}"
    else:
        what = "single-file checkpoints carry none"
        where = f"{candidates[1]} (or {candidates[0]}), or use a diffusers folder that has tokenizer/ sub-folders"
    raise ValueError(
        f"model={model.name!r}: no CLIP tokenizer files found ({what}); inside ComfyUI they come from "
        f"comfy/sd1_tokenizer. Outside ComfyUI put CLIP's vocab.json and merges.txt in {where}")


def load_clip_tokenizer(folder: Path, pad_token: Optional[str] = None, max_length: int = 77):
    """``CLIPTokenizer`` from local files only; ``pad_token`` overrides the folder's (``!`` for OpenCLIP)."""
    from transformers import CLIPTokenizer

    kwargs = {"pad_token": pad_token} if pad_token else {}
    try:
        tok = CLIPTokenizer.from_pretrained(str(folder), local_files_only=True, model_max_length=max_length, **kwargs)
    except Exception as exc:  # the tokenizers library reports a damaged vocabulary as a plain Exception
        raise ValueError(f"tokenizer files in {folder} could not be loaded ({type(exc).__name__}: {exc}); replace "
                         f"them with CLIP's vocab.json and merges.txt") from exc
    return tok

"""CLIP tokenizers for loaded models: the model folder's own, else ComfyUI's bundled files, else a clear error.

Invariant: nothing is ever fetched from a hub. Single-file checkpoints carry no tokenizer; every SD family uses
CLIP's BPE vocabulary (SD2's and SDXL's OpenCLIP towers included), so one ``vocab.json`` + ``merges.txt`` pair
serves all. OpenCLIP towers (SD2's encoder, SDXL's second encoder) pad with ``!`` (token 0) instead of the end
token, as diffusers' SD2/SDXL tokenizers and ComfyUI's SD2/SDXL CLIP-G tokenizers do.

Search order for a single-file checkpoint ``<dir>/<name>.safetensors``:
1. ``<dir>/<name>.tokenizer/`` or ``<dir>/tokenizer/`` holding ``vocab.json`` and ``merges.txt``;
2. ComfyUI's ``comfy/sd1_tokenizer/`` (through ``bridge.comfy_tokenizer_dir()``, only inside ComfyUI);
3. otherwise ``ValueError`` saying where to put the two files.
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


def find_tokenizer_dir(checkpoint: Path) -> Path:
    """The folder holding CLIP BPE files for ``checkpoint`` (see the module docstring for the order)."""
    checkpoint = Path(checkpoint)
    candidates = [checkpoint.parent / f"{checkpoint.stem}.tokenizer", checkpoint.parent / "tokenizer"]
    for folder in candidates:
        if _has_bpe(folder):
            return folder
    comfy = bridge.comfy_tokenizer_dir()
    if comfy is not None and _has_bpe(Path(comfy)):
        return Path(comfy)
    raise ValueError(
        f"model={checkpoint.name!r}: no CLIP tokenizer files found. Single-file checkpoints carry none; inside "
        f"ComfyUI they come from comfy/sd1_tokenizer. Outside ComfyUI put CLIP's vocab.json and merges.txt in "
        f"{candidates[1]} (or {candidates[0]}), or use a diffusers folder that has tokenizer/ sub-folders")


def load_clip_tokenizer(folder: Path, pad_token: Optional[str] = None, max_length: int = 77):
    """``CLIPTokenizer`` from local files only; ``pad_token`` overrides the folder's (``!`` for OpenCLIP)."""
    from transformers import CLIPTokenizer

    kwargs = {"pad_token": pad_token} if pad_token else {}
    try:
        tok = CLIPTokenizer.from_pretrained(str(folder), local_files_only=True, model_max_length=max_length, **kwargs)
    except (OSError, ValueError) as exc:
        raise ValueError(f"tokenizer files in {folder} could not be loaded ({exc}); they must be CLIP's vocab.json "
                         f"and merges.txt") from exc
    return tok

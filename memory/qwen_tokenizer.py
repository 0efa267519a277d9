"""The Qwen tokenizer for Z-Image / Qwen-Image split files, from files already on this machine (never fetched).

Split files carry no tokenizer. Search order:
1. the ``tokenizer`` sub-folder of a diffusers folder of the same family in ``models/diffusers`` (a folder whose
   ``model_index.json`` names a Z-Image, resp. Qwen-Image, pipeline; the first in name order that has tokenizer
   files);
2. ComfyUI's bundled Qwen tokenizer (``comfy/text_encoders/qwen25_tokenizer``, through the bridge, only inside
   ComfyUI; ComfyUI's Qwen-Image uses it too): Qwen3 shares Qwen2.5's vocabulary and chat tokens;
3. otherwise ``ValueError`` saying where to put the files.

Invariant: the tokenizer returned tokenizes the chat markers the flow sampler renders (``<|im_start|>``,
``<|im_end|>``) as one id each; files that do not are refused here rather than encoding a different prompt.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

from .. import bridge
from ..torchfile import load_error_reason
from .folders import PIPELINES

logger = logging.getLogger(__name__)

CHAT_MARKERS = ("<|im_start|>", "<|im_end|>")
SAME_TOKENIZER = {"qwen_image": ("qwen_image", "qwen_image_edit")}  # Qwen-Image-Edit folders carry Qwen-Image's
WHERE_FROM = {"zimage": "Z-Image (Tongyi-MAI/Z-Image-Turbo)", "qwen_image": "Qwen-Image (Qwen/Qwen-Image)"}


def _has_files(folder: Path) -> bool:
    return (folder / "tokenizer.json").is_file() or ((folder / "vocab.json").is_file()
                                                     and (folder / "merges.txt").is_file())


def _folder_tokenizer(name: str, family: str) -> Optional[Path]:
    try:
        folder = bridge.resolve_model("diffusers", name, "diffusers folder")
        index = json.loads((folder / "model_index.json").read_text())
    except (OSError, ValueError) as exc:  # an unreadable folder is skipped: it is not this input's file
        logger.debug("skipping diffusers folder %s while looking for a Qwen tokenizer: %s", name, exc)
        return None
    if not isinstance(index, dict) or PIPELINES.get(index.get("_class_name")) not in SAME_TOKENIZER.get(family,
                                                                                                       (family,)):
        return None
    return folder / "tokenizer" if _has_files(folder / "tokenizer") else None


def find_qwen_tokenizer_dir(family: str = "zimage") -> Path:
    """The folder to load the Qwen tokenizer of ``family`` (``zimage`` or ``qwen_image``) from (see the module
    docstring for the order)."""
    for name in bridge.list_models("diffusers", marker="model_index.json"):
        found = _folder_tokenizer(name, family)
        if found is not None:
            return found
    comfy = bridge.comfy_qwen_tokenizer_dir()
    if comfy is not None:
        return Path(comfy)
    raise ValueError(
        "text_encoder: no Qwen tokenizer files found (split files carry none); inside ComfyUI they come from "
        "comfy/text_encoders/qwen25_tokenizer. Outside ComfyUI put the tokenizer/ sub-folder and model_index.json "
        f"of a {WHERE_FROM.get(family, WHERE_FROM['zimage'])} diffusers model into models/diffusers/<any name>/; no "
        "other file of that folder is needed")


def load_qwen_tokenizer(folder: Path):
    """``AutoTokenizer`` from ``folder``'s local files, checked to keep the chat markers whole."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:  # the tokenizers library reports damaged files as a plain Exception
        raise ValueError(f"text_encoder: the Qwen tokenizer files in {folder} could not be loaded "
                         f"({load_error_reason(exc)}); replace them with a Z-Image tokenizer/ folder") from exc
    for marker in CHAT_MARKERS:
        if len(tokenizer(marker, add_special_tokens=False).input_ids) != 1:
            raise ValueError(f"text_encoder: the tokenizer in {folder} splits Qwen's chat marker {marker} into "
                             f"pieces, so it is not a Qwen tokenizer; replace it with a Z-Image tokenizer/ folder")
    return tokenizer

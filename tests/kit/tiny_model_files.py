"""Tiny random stand-in model files, for the runner's ``--tiny`` and the integration tests.

``python -m leandiffusion.tests.kit.tiny_model_files FOLDER [KIND=PATH ...]`` writes each named file into FOLDER
(PATH relative to it); without KIND=PATH arguments, every kind under its default name (``runner/tiny.py`` ``FILES``).
A file that exists is kept; a new one is written under a temporary name and renamed when complete, so a run cut
short never leaves a truncated file another run would take as done.

Kinds:
- ``lora``: a kohya LoRA for the tiny SD1 model (``memory/tiny.py``): UNet attention and feed-forward layers and the
  text encoder's linears, rank 4;
- ``upscaler``: a tiny compact (SRVGGNetCompact) x4 upscaler;
- ``clip_l`` / ``sd1_clip_l``: a random full-size CLIP-L and an SD1 checkpoint holding the same CLIP-L
  (``clip_l.py``: ComfyUI's CLIP loaders build CLIP-L at full size), always written together;
- ``zimage``: the tiny Z-Image (``memory/tiny_zimage.py``) as the split loader's three files (PATH names the
  diffusion model; the text encoder and VAE go to ``text_encoders/`` and ``vae/`` under the same tag) and as
  ``diffusers/<tag>`` (the loader takes the tokenizer from a Z-Image diffusers folder); the diffusion model file is
  written last, so its presence means the set is complete;
- ``qwen_image_edit``: the tiny Qwen-Image (``memory/tiny_qwen_image.py``) likewise, its text encoder the whole
  Qwen2.5-VL (``visual.*`` included, so the split loader's model can edit) and its diffusers folder a
  ``QwenImageEditPlusPipeline`` one (the tokenizer's source for Qwen-Image split files).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable


def write_lora(path: Path) -> None:
    from ..lora import lorafiles
    from . import tiny_components

    c = tiny_components("sd1")
    lora = lorafiles.kohya_state_dict({"unet": c["unet"], "text_encoder": c["text_encoder"]},
                                      {"unet": lorafiles.ATTN_FF, "text_encoder": lorafiles.TE_LINEARS})
    lorafiles.write(lora, path)


def write_upscaler(path: Path) -> None:
    from safetensors.torch import save_file

    from ...bench.upscale_weights import random_compact

    save_file(random_compact(), str(path))


def write_zimage(folder: Path, dit_path: Path) -> None:
    """The tiny Z-Image's text encoder, VAE and diffusers folder under ``folder``, then its DiT at ``dit_path``."""
    import shutil

    from ...memory.tiny_zimage import build_tiny_zimage, save_zimage_folder
    from ...runner.tiny import ZIMAGE_TAG
    from .zimage_split import write_split_files

    components = build_tiny_zimage(seed=0)
    save_zimage_folder(components, folder / "diffusers" / ZIMAGE_TAG)
    names = write_split_files(components, folder, ZIMAGE_TAG, dtype="bf16", comfy=True)
    shutil.move(str(folder / "diffusion_models" / names["diffusion_model"]), str(dit_path))


def write_qwen_image_edit(folder: Path, dit_path: Path) -> None:
    """The tiny Qwen-Image-Edit's text encoder, VAE and diffusers folder under ``folder``, then its DiT at
    ``dit_path``."""
    import shutil

    from ...memory.tiny_qwen_image import build_tiny_qwen_image, save_qwen_image_edit_folder
    from ...runner.tiny import QWEN_EDIT_TAG
    from .qwen_image_split import write_split_files

    components = build_tiny_qwen_image(seed=0)
    save_qwen_image_edit_folder(components, folder / "diffusers" / QWEN_EDIT_TAG)
    names = write_split_files(components, folder, QWEN_EDIT_TAG, dtype="bf16", comfy=True)
    shutil.move(str(folder / "diffusion_models" / names["diffusion_model"]), str(dit_path))


def _written(path: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp)`` beside ``path``, then renamed to ``path`` (kept when it exists)."""
    if path.is_file():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.partial{path.suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_files(folder: str | Path, paths: dict[str, str]) -> None:
    """Write ``{kind: path relative to folder}`` (module docstring)."""
    from .clip_l import write_clip_l_pair

    folder = Path(folder)
    unknown = set(paths) - {"lora", "upscaler", "clip_l", "sd1_clip_l", "zimage", "qwen_image_edit"}
    if unknown:
        raise ValueError(f"unknown kinds {sorted(unknown)}: expected lora, upscaler, clip_l, sd1_clip_l, zimage, "
                         f"qwen_image_edit")
    if "zimage" in paths:
        _written(folder / paths["zimage"], lambda tmp: write_zimage(folder, tmp))
    if "qwen_image_edit" in paths:
        _written(folder / paths["qwen_image_edit"], lambda tmp: write_qwen_image_edit(folder, tmp))
    if "lora" in paths:
        _written(folder / paths["lora"], write_lora)
    if "upscaler" in paths:
        _written(folder / paths["upscaler"], write_upscaler)
    if "clip_l" in paths or "sd1_clip_l" in paths:
        from ...runner.tiny import CLIP_L, FILES, SD1_CLIP_L

        clip = folder / paths.get("clip_l", f"{FILES[CLIP_L][1]}/{CLIP_L}")
        checkpoint = folder / paths.get("sd1_clip_l", f"{FILES[SD1_CLIP_L][1]}/{SD1_CLIP_L}")
        if not (clip.is_file() and checkpoint.is_file()):
            for path in (clip, checkpoint):  # the pair holds the same CLIP-L: never one file of another pair
                path.unlink(missing_ok=True)
            _written(checkpoint, lambda tmp: write_clip_l_pair(tmp, clip))  # the checkpoint is renamed last


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    from ...runner.tiny import FILES

    pairs = dict(arg.split("=", 1) for arg in argv[1:] if "=" in arg)
    if len(pairs) != len(argv) - 1:
        print("expected KIND=PATH arguments after the folder, e.g. lora=loras/x.safetensors", file=sys.stderr)
        return 2
    write_files(argv[0], pairs or {kind: f"{sub}/{name}" for name, (kind, sub) in FILES.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

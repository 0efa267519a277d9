"""The Stream Edit Sampler's images: an IMAGE batch and/or a folder of ComfyUI's input directory, as one ordered list.

Invariants (what makes item ``n`` of a run equal a one-image Fused Edit Sampler run on "its" IMAGE):
- Order: the rows of ``images`` first, then the folder's image files (``IMAGE_EXTENSIONS``, not in sub-folders)
  sorted by name; item ``n`` of that list is edit ``n`` (seeded ``seed + n`` by the caller).
- A row of ``images`` becomes its 8-bit picture (``edit_images.to_picture``); a file becomes the 8-bit RGB picture
  ComfyUI's Load Image makes of it (first frame, EXIF orientation applied, ``convert("RGB")``), so a file's edit
  equals the one-image run on Load Image's IMAGE of it.
- Each item's sizes are ``edit_images.edit_sizes`` of its own picture: images of one aspect ratio share an output
  size whatever their resolution; the caller groups by ``EditItem.size_key``.
- Every check runs before any model: no image at all, a bad IMAGE, a side under ``MIN_SIDE_PX``, a folder that is
  missing, outside the input directory, holds no image or a file that is not a readable image; each error names the
  input (``images`` or ``folder``, with the file's name).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, Optional

import torch

from ... import bridge
from . import edit_images

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")
MAX_IMAGES = 4096


@dataclass(frozen=True, eq=False)
class EditItem:
    """Edit ``index`` of the run: its 8-bit picture, its sizes and where it came from (for messages)."""

    index: int
    picture: Any  # PIL.Image, RGB
    sizes: edit_images.EditSizes
    source: str  # "images[3]" or "folder 'shots/a.png'"

    @property
    def size_key(self) -> tuple:
        """What a batch must share: the noise's size and the reference's VAE size (so its token grid)."""
        return self.sizes.output, self.sizes.vae


def collect_items(images: Optional[torch.Tensor], folder: str, megapixels: float) -> list[EditItem]:
    """Every image of the run in order (module docstring)."""
    pictures: list[tuple[Any, str]] = []
    if images is not None:
        (batch,) = edit_images.check_images(images, names=("images",))
        pictures += [(edit_images.to_picture(batch, b), f"images[{b}]") for b in range(int(batch.shape[0]))]
    if not isinstance(folder, str):
        raise TypeError(f"folder: expected a folder name (text), got {type(folder).__name__}")
    if folder.strip():
        pictures += folder_pictures(folder.strip())
    if not pictures:
        raise ValueError("images: no image to edit; connect an IMAGE (a Load Image node) to images, or set folder "
                         "to a folder of images inside ComfyUI's input directory")
    if len(pictures) > MAX_IMAGES:
        raise ValueError(f"folder: {len(pictures)} images in one run; at most {MAX_IMAGES}: split the folder")
    items = []
    for index, (picture, source) in enumerate(pictures):
        width, height = picture.size
        if min(width, height) < edit_images.MIN_SIDE_PX:
            raise ValueError(f"{source}: {width}x{height} px is smaller than {edit_images.MIN_SIDE_PX} px on a side; "
                             f"upscale it or leave it out")
        shape = torch.empty((1, height, width, 3), device="meta")  # edit_sizes reads the shape only
        items.append(EditItem(index, picture, edit_images.edit_sizes([shape], megapixels, names=(source,)), source))
    return items


def folder_path(folder: str) -> Path:
    """``folder`` resolved inside ComfyUI's input directory (``bridge.input_directory``); ``ValueError`` naming
    ``folder`` when it is absolute, leaves that directory, or is not a folder there."""
    posix, windows = PurePosixPath(folder), PureWindowsPath(folder)
    if posix.is_absolute() or windows.drive or windows.root or ".." in posix.parts or ".." in windows.parts:
        raise ValueError(f"folder={folder!r} points outside ComfyUI's input directory; give a folder name relative "
                         f"to it (e.g. 'to_edit' for input/to_edit)")
    root = bridge.input_directory()
    if root is None:
        raise ValueError(f"folder={folder!r}: ComfyUI's input directory is not known (outside ComfyUI set "
                         f"LEANDIFFUSION_INPUT); or connect the images to the images input instead")
    path = root / folder
    if not path.is_dir():
        raise ValueError(f"folder={folder!r} is not a folder in ComfyUI's input directory ({root}); create it there "
                         f"and put the images to edit in it")
    return path


def folder_pictures(folder: str) -> list[tuple[Any, str]]:
    """``(picture, source)`` for every image file of ``folder``, sorted by name (module docstring)."""
    path = folder_path(folder)
    files = sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())
    if not files:
        raise ValueError(f"folder={folder!r} holds no image ({', '.join(IMAGE_EXTENSIONS)}); put the images to edit "
                         f"in {path}")
    if len(files) > MAX_IMAGES:
        raise ValueError(f"folder={folder!r} holds {len(files)} images; at most {MAX_IMAGES} a run: split the folder")
    return [(load_picture(f, f"folder {folder!r}"), f"folder '{Path(folder, f.name).as_posix()}'") for f in files]


def load_picture(path: Path, what: str):
    """The 8-bit RGB picture Load Image makes of ``path`` (first frame, EXIF orientation applied)."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    try:
        with Image.open(path) as opened:
            picture = ImageOps.exif_transpose(opened)
            if picture.mode == "I":
                picture = picture.point(lambda v: v * (1 / 255))
            return picture.convert("RGB")
    except (UnidentifiedImageError, OSError) as exc:
        raise ValueError(f"{what}: {path.name} could not be read as an image ({exc}); remove it from the folder or "
                         f"replace it") from exc


def folder_fingerprint(folder: str) -> str:
    """What the node's ``IS_CHANGED`` returns: the folder's image files' names, sizes and modification times (a
    changed folder re-runs the node); never raises (the run reports a bad folder)."""
    try:
        path = folder_path(folder.strip())
        entries = sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())
        return ";".join(f"{p.name}|{os.stat(p).st_size}|{os.stat(p).st_mtime_ns}" for p in entries)
    except (OSError, ValueError, AttributeError):
        return str(folder)

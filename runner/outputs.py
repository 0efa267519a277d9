"""Where a downloaded output image goes: a name checked to stay inside ``--out``, claimed without overwriting.

Invariant: a file is written only inside ``--out``, under a name the server gave that is a plain relative name by
both POSIX and Windows rules (the server may run on either); an existing file is never overwritten (``name_N.ext``).
"""
from __future__ import annotations

import os
from pathlib import Path, PurePosixPath, PureWindowsPath

from .errors import ExecutionFailed


def checked_output_name(image: dict, out_dir: Path) -> tuple[str, str, tuple[str, ...]]:
    """``(filename, subfolder, subfolder parts)`` of a server-listed image, refused (``ExecutionFailed``) unless the
    file lands inside ``out_dir``: each name is read with POSIX and with Windows rules (a server may run on either),
    and none may be absolute, carry a drive, contain ``..`` or name no file (empty, ``.``)."""
    filename, subfolder = str(image.get("filename") or ""), str(image.get("subfolder") or "")
    unusable = ExecutionFailed(f"ComfyUI listed an output image with an unusable name: {image!r}; the runner saves "
                               f"only plain names inside --out")
    for flavour in (PurePosixPath, PureWindowsPath):
        sub, name = flavour(subfolder), flavour(filename)
        if (sub.is_absolute() or sub.drive or sub.root or ".." in sub.parts or name.drive or name.root
                or len(name.parts) != 1 or name.parts[0] in (".", "..") or "\0" in subfolder + filename):
            raise unusable
    parts = PureWindowsPath(subfolder).parts  # splits on "/" and "\\": a Windows server's subfolder maps here too
    root = Path(out_dir).resolve()
    target = root.joinpath(*parts, filename).resolve()
    if target.parent != root.joinpath(*parts).resolve() or root not in target.parents:
        raise unusable
    return filename, subfolder, parts


def _numbered(path: Path, n: int) -> Path:
    return path if n == 0 else path.with_name(f"{path.stem}_{n}{path.suffix}")


def _unique(path: Path) -> Path:
    """``path``, or ``name_1.ext``, ``name_2.ext`` ... when it exists: earlier runs' images are never overwritten."""
    n = 0
    while _numbered(path, n).exists():
        n += 1
    return _numbered(path, n)


def place_without_overwriting(tmp: Path, path: Path) -> Path:
    """Give the complete file ``tmp`` the name ``path`` (or ``name_N.ext``, the first free one) and return it.

    The name is claimed with a hard link, which fails if the name exists, so a file that appears between looking
    and placing (a second runner saving into the same ``--out``) is never overwritten. Where the filesystem has no
    hard links, the checked rename (``_unique`` then ``os.replace``) is the fallback."""
    n = 0
    while True:
        candidate = _numbered(path, n)
        try:
            os.link(tmp, candidate)
        except FileExistsError:
            n += 1
            continue
        except OSError:  # no hard links here (FAT, some network shares)
            candidate = _unique(path)
            os.replace(tmp, candidate)
            return candidate
        os.unlink(tmp)
        return candidate

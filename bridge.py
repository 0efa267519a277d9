"""The one place that talks to ComfyUI's own modules, lazily, and degrades to plain behaviour outside ComfyUI.

Invariant: importing this module (or any module of the pack) never imports ``comfy``, ``folder_paths``,
``server`` or ComfyUI's ``nodes``. Each helper imports them inside the function, only when ComfyUI has already
loaded them (``sys.modules``), so a plain Python process never pulls ComfyUI in by accident.

Outside ComfyUI:
- progress bars are tqdm bars (or silent when ``quiet``),
- the interruption check is a no-op,
- model folders resolve against ``$LEANDIFFUSION_MODELS/<folder>`` (ComfyUI's ``models/`` names, ``FOLDER_ALIASES``),
- ComfyUI's memory manager hooks do nothing,
- ComfyUI's bundled tokenizer path is ``None`` and its input folder ``$LEANDIFFUSION_INPUT``.
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Callable, Optional

logger = logging.getLogger(__name__)

MODELS_ENV = "LEANDIFFUSION_MODELS"
MAX_NAME = 1024  # characters of a model name, well under PATH_MAX (4096) with the folder's own path in front


def _comfy_module(name: str):
    """Return ComfyUI's module ``name`` if this process is running ComfyUI, else ``None``."""
    if "comfy" not in sys.modules and name != "folder_paths":
        return None
    if name == "folder_paths" and "folder_paths" not in sys.modules:
        return None
    try:
        return __import__(name, fromlist=["_"])
    except ImportError:
        return None


# --------------------------------------------------------------------------------------------- progress
class ProgressBar:
    """A progress bar over ``total`` units: ComfyUI's when inside ComfyUI, tqdm otherwise."""

    def __init__(self, total: int, desc: str = "", quiet: bool = False):
        self.total = int(total)
        self._comfy = None
        self._tqdm = None
        utils = _comfy_module("comfy.utils")
        if utils is not None:
            self._comfy = utils.ProgressBar(self.total)
        elif not quiet:
            from tqdm.auto import tqdm

            self._tqdm = tqdm(total=self.total, desc=desc, leave=False, disable=None)

    def update(self, n: int = 1) -> None:
        if self._comfy is not None:
            self._comfy.update(n)
        if self._tqdm is not None:
            self._tqdm.update(n)

    def set(self, value: int, total: int) -> None:
        """Jump to ``value`` of a new ``total`` (a run that re-plans its work midway, e.g. smaller tiles after an
        out-of-memory error, keeps the bar below its total and moving)."""
        self.total = int(total)
        if self._comfy is not None:
            self._comfy.update_absolute(int(value), self.total)
        if self._tqdm is not None:
            self._tqdm.reset(total=self.total)
            self._tqdm.update(int(value))

    def close(self) -> None:
        if self._tqdm is not None:
            self._tqdm.close()
            self._tqdm = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


# --------------------------------------------------------------------------------------------- interruption
_test_interrupt_hook: Optional[Callable[[], None]] = None


def set_interrupt_hook(hook: Optional[Callable[[], None]]) -> None:
    """Install a callable run at every interruption check (tests use it to interrupt mid-run)."""
    global _test_interrupt_hook
    _test_interrupt_hook = hook


def check_interrupted() -> None:
    """Raise ComfyUI's interruption exception if the user pressed Cancel; no-op outside ComfyUI."""
    if _test_interrupt_hook is not None:
        _test_interrupt_hook()
    mm = _comfy_module("comfy.model_management")
    if mm is not None:
        mm.throw_exception_if_processing_interrupted()


class Interrupted(Exception):
    """Raised by test hooks (and usable by callers) to stop a run between steps."""


# --------------------------------------------------------------------------------------------- model folders
# A folder and its older names, all searched (ComfyUI's ``folder_paths.map_legacy``: ``unet``, ``clip``).
FOLDER_ALIASES = {"diffusion_models": ("diffusion_models", "unet"), "text_encoders": ("text_encoders", "clip")}


def _folder_roots(folder: str) -> list[Path]:
    fp, base = _comfy_module("folder_paths"), os.environ.get(MODELS_ENV)
    roots: list[Path] = []
    for name in FOLDER_ALIASES.get(folder, (folder,)):
        try:
            found = fp.get_folder_paths(name) if fp is not None else ([Path(base) / name] if base else [])
        except KeyError:  # a ComfyUI without this folder name
            found = []
        roots += [Path(p) for p in found if Path(p) not in roots]
    return roots


def input_directory() -> Optional[Path]:
    """ComfyUI's input folder (Load Image's); outside ComfyUI ``$LEANDIFFUSION_INPUT``, else ``None``."""
    fp, base = _comfy_module("folder_paths"), os.environ.get("LEANDIFFUSION_INPUT")
    return Path(fp.get_input_directory()) if fp is not None else (Path(base) if base else None)


def _in_link_cycle(dirpath: str, root: str) -> bool:
    """True when ``dirpath`` (under ``root``) is the same real folder as one of its ancestors (a link cycle)."""
    real = os.path.realpath(dirpath)
    parent = os.path.dirname(dirpath)
    while len(parent) >= len(root):
        if os.path.realpath(parent) == real:
            return True
        if parent == root:
            break
        parent = os.path.dirname(parent)
    return False


def list_models(folder: str, extensions: tuple[str, ...] = (".safetensors",), marker: Optional[str] = None) -> list[str]:
    """Names (relative paths with '/') of files with ``extensions`` in ``folder``, or, with ``marker``, of the
    sub-folders at any depth that hold a file named ``marker`` (diffusers folders: ``model_index.json``, as
    ComfyUI's DiffusersLoader lists them).

    Links are followed, files and sub-folders alike, as ComfyUI's own model lists do (``folder_paths`` walks with
    ``followlinks=True``); a link cycle is entered once. Dangling links are left out.
    """
    names: set[str] = set()
    suffixes = tuple(e.lower() for e in extensions)
    for root in _folder_roots(folder):
        if not root.is_dir():
            continue
        top = str(root)
        for dirpath, subdirs, filenames in os.walk(top, followlinks=True):
            if dirpath != top and _in_link_cycle(dirpath, top):
                subdirs[:] = []
                continue
            if marker is not None:
                if dirpath != top and marker in filenames:
                    names.add(Path(os.path.relpath(dirpath, top)).as_posix())
                continue
            for filename in filenames:
                full = os.path.join(dirpath, filename)
                if filename.lower().endswith(suffixes) and os.path.isfile(full):
                    names.add(Path(os.path.relpath(full, top)).as_posix())
    return sorted(names)


def _model_name(folder: str, name: str, input_name: str) -> Path:
    """``name`` as a relative path that stays inside its folder under both POSIX and Windows rules, whatever the OS:
    a name is data from outside (a saved workflow, an API prompt), and ``C:x`` or ``\\x`` are plain names to POSIX
    but a drive or the drive's root to Windows. Parts longer than a file system allows (255 bytes) and names past
    ``MAX_NAME`` characters are refused here, before the OS answers with a bare ``OSError``."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"{input_name}: expected a model name from the '{folder}' folder, got {name!r}")
    shown = repr(name) if len(name) <= 80 else f"{name[:60]!r}... ({len(name)} characters)"
    posix, windows = PurePosixPath(name), PureWindowsPath(name)
    if posix.is_absolute() or windows.drive or windows.root or ".." in posix.parts or ".." in windows.parts:
        raise ValueError(
            f"{input_name}={shown} points outside the '{folder}' model folder; "
            f"give a name relative to that folder (as listed in the node's menu)"
        )
    if len(name) > MAX_NAME or any(len(part.encode("utf-8", "surrogatepass")) > 255 for part in windows.parts):
        raise ValueError(f"{input_name}={shown} is longer than a model file name can be (at most 255 bytes a path "
                         f"part, {MAX_NAME} characters in all); pick a name from the node's menu")
    return Path(name)


def resolve_model(folder: str, name: str, input_name: str = "model_name") -> Path:
    """Resolve ``name`` to a file or folder inside one of ``folder``'s roots.

    Refuses absolute paths, drives and ``..`` escapes (POSIX and Windows forms alike) and over-long names: a model
    *name* resolves only inside its model folder. Links that the user placed inside the folder are followed, as
    ComfyUI's ``folder_paths.get_full_path`` does (and as :func:`list_models` lists them). Returns the resolved
    path. Raises ``ValueError`` naming the input, the value and what to do.
    """
    candidate = _model_name(folder, name, input_name)
    roots = _folder_roots(folder)
    if not roots:
        raise ValueError(
            f"{input_name}={name!r}: no '{folder}' model folder is configured; inside ComfyUI put the file in "
            f"models/{folder}/, outside ComfyUI set {MODELS_ENV} to a folder that has a '{folder}' sub-folder"
        )
    for root in roots:
        path = root / candidate
        try:
            if path.exists():  # follows links; a dangling one does not exist
                return path.resolve()
        except OSError as exc:  # e.g. a permission denied on the way: the OS's text names no input
            raise ValueError(f"{input_name}={name!r} could not be looked up in {root} ({exc.strerror or exc}); "
                             f"check the folder's permissions, or pick another name from the node's menu") from exc
    searched = ", ".join(str(r) for r in roots)
    raise ValueError(f"{input_name}={name!r} was not found in the '{folder}' folder(s): {searched}")


def model_fingerprint(folder: str, name: str) -> str:
    """What a node's ``IS_CHANGED`` returns for a model-file input: a digest of the resolved file's identity
    (path, mtime, size, inode, ctime) or, for a folder (diffusers), of every file in it. ComfyUI caches node outputs
    by their inputs, so without this a LoRA or upscaler file replaced on disk under the same name would keep the
    old output until the server restarts. Never raises: a name that does not resolve gives the name itself (the
    node then reports the problem when it runs).
    """
    import hashlib

    try:
        path = resolve_model(folder, name)
        paths = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        digest = hashlib.sha1(str(path).encode())
        for item in paths:
            st = item.stat()
            digest.update(f"{item}|{st.st_mtime_ns}|{st.st_size}|{st.st_ino}|{st.st_ctime_ns}\n".encode())
        return digest.hexdigest()
    except (OSError, ValueError):
        return str(name)


# --------------------------------------------------------------------------------------------- device
def default_device():
    """The device the pack's models run on when a node does not say: ComfyUI's device inside ComfyUI (so ``--cpu``
    keeps the pack on the CPU, as it keeps ComfyUI's own models), else the current CUDA device, else the CPU. The
    pack runs on CUDA or the CPU only: another ComfyUI device (MPS, XPU, DirectML) gives the CPU, with a warning."""
    import torch

    mm = _comfy_module("comfy.model_management")
    if mm is not None and hasattr(mm, "get_torch_device"):
        comfy_device = torch.device(mm.get_torch_device())
        if comfy_device.type == "cuda" and torch.cuda.is_available():
            index = torch.cuda.current_device() if comfy_device.index is None else comfy_device.index
            return torch.device("cuda", index)
        if comfy_device.type != "cpu":
            logger.warning("ComfyUI runs on %s; LeanDiffusion runs on NVIDIA GPUs (CUDA) or the CPU, so its nodes "
                           "use the CPU", comfy_device)
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


# --------------------------------------------------------------------------------------------- memory manager
def free_comfy_memory(bytes_needed: int, device) -> None:
    """Ask ComfyUI's memory manager to unload its own models until ``bytes_needed`` are free on ``device``."""
    mm = _comfy_module("comfy.model_management")
    if mm is None:
        return
    try:
        mm.free_memory(int(bytes_needed), device)
    except Exception as exc:  # ComfyUI internals vary between versions; freeing is best effort by design
        logger.warning("ComfyUI could not free %d bytes on %s: %s", bytes_needed, device, exc)


def soft_empty_cache() -> None:
    """Return cached blocks to the driver (ComfyUI's helper inside ComfyUI, torch's outside)."""
    mm = _comfy_module("comfy.model_management")
    if mm is not None:
        mm.soft_empty_cache()
        return
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _comfy_files(sub: str) -> Optional[Path]:
    """``comfy/<sub>`` of the running ComfyUI when it holds a ``vocab.json``, else ``None`` (also outside ComfyUI)."""
    mm = _comfy_module("comfy.model_management")
    if mm is None or not getattr(mm, "__file__", None):
        return None
    path = Path(mm.__file__).resolve().parent / sub
    return path if (path / "vocab.json").is_file() else None


def comfy_tokenizer_dir() -> Optional[Path]:
    """Folder of ComfyUI's bundled CLIP tokenizer files (``comfy/sd1_tokenizer``), or ``None`` outside ComfyUI."""
    return _comfy_files("sd1_tokenizer")


def comfy_qwen_tokenizer_dir() -> Optional[Path]:
    """Folder of ComfyUI's bundled Qwen2.5 tokenizer files (Qwen3's vocabulary too), or ``None`` outside ComfyUI."""
    return _comfy_files("text_encoders/qwen25_tokenizer")


# --------------------------------------------------------------------------------------------- pack memory owners
class _PackLoadedModel:
    """What ComfyUI's ``current_loaded_models`` list sees for a pack model holding GPU memory.

    ComfyUI's ``free_memory`` (run by ``/free``, ``unload_all_models`` and its own loads when VRAM runs short) walks
    that list and calls ``model_unload`` on entries of the device: ours calls ``release`` (the pack frees its GPU
    weights; its engine reloads them on next use) and ComfyUI drops the entry. ``cleanup_models`` drops it when the
    owner has been garbage collected (``real_model()`` is then None). The owner is held weakly.
    """

    class _View:
        def __init__(self, entry):
            self._entry = entry

        @property
        def model(self):
            return self._entry.real_model()

        def is_clone(self, other) -> bool:
            return False

        def model_size(self) -> int:
            return self._entry.model_memory()

        def loaded_size(self) -> int:
            return self._entry.model_memory()

    def __init__(self, owner, device, size_fn: Callable[[], int], release: Callable[[], None]):
        import weakref

        self.device = device
        self.currently_used = False
        self.real_model = weakref.ref(owner)
        # bound methods of the owner are held weakly too, or ComfyUI's list would keep the owner alive
        self._size_fn = weakref.WeakMethod(size_fn) if hasattr(size_fn, "__self__") else (lambda: size_fn)
        self._release = weakref.WeakMethod(release) if hasattr(release, "__self__") else (lambda: release)
        self.model = _PackLoadedModel._View(self)

    def model_memory(self) -> int:
        fn = self._size_fn()
        return int(fn()) if fn is not None and self.real_model() is not None else 0

    def model_loaded_memory(self) -> int:
        return self.model_memory()

    def model_offloaded_memory(self) -> int:
        return 0

    def model_memory_required(self, device) -> int:
        return 0

    def model_use_more_vram(self, extra_memory, force_patch_weights=False) -> int:
        return 0

    def is_dead(self) -> bool:
        return False

    def model_unload(self, memory_to_free=None, unpatch_weights=True) -> bool:
        fn = self._release()
        if fn is not None and self.real_model() is not None:
            fn()
        return True


def register_memory_owner(owner, device, size_fn: Callable[[], int], release: Callable[[], None]):
    """Let ComfyUI's memory manager free ``owner``'s GPU memory (calls ``release()``); no-op outside ComfyUI.

    Returns a handle for :func:`unregister_memory_owner`, or ``None`` outside ComfyUI. ``size_fn()`` reports the
    bytes the owner holds on ``device``.
    """
    mm = _comfy_module("comfy.model_management")
    if mm is None or not hasattr(mm, "current_loaded_models"):
        return None
    entry = _PackLoadedModel(owner, device, size_fn, release)
    mm.current_loaded_models.append(entry)
    return entry


def unregister_memory_owner(handle) -> None:
    """Remove a handle returned by :func:`register_memory_owner` (no-op if ComfyUI already dropped it)."""
    mm = _comfy_module("comfy.model_management")
    if handle is None or mm is None:
        return
    models = getattr(mm, "current_loaded_models", [])
    for i, entry in enumerate(models):
        if entry is handle:
            models.pop(i)
            return


# --------------------------------------------------------------------------------------------- model loading
def load_comfy_model(patcher, memory_required: int = 0) -> None:
    """Have ComfyUI load a ``ModelPatcher`` (e.g. ``VAE.patcher``) onto its device; no-op outside ComfyUI."""
    mm = _comfy_module("comfy.model_management")
    if mm is None or patcher is None:
        return
    mm.load_models_gpu([patcher], memory_required=int(memory_required))

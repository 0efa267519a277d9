"""Import ComfyUI's own modules from a source tree (``COMFYUI_PATH``) for tests that compare against them.

ComfyUI's code is a reference here, never part of the pack: tests marked ``comfyui`` call ``use_comfyui_source()``
and then import ``comfy.*``. On a machine without CUDA it sets ``--cpu`` first, as ``main.py --cpu`` does (it must
precede the first import of ``comfy.model_management``).
"""
import importlib.machinery
import os
import sys
import types
from contextlib import contextmanager

import pytest
import torch


def use_comfyui_source() -> str:
    """Put ``COMFYUI_PATH`` on ``sys.path`` (once) and select ComfyUI's CPU mode when there is no GPU; returns it."""
    path = os.environ["COMFYUI_PATH"]
    if path not in sys.path:
        sys.path.insert(0, path)
    if "comfy.model_management" not in sys.modules and not torch.cuda.is_available():
        import comfy.cli_args

        comfy.cli_args.args.cpu = True
    return path


@contextmanager
def comfyui_imports():
    """``use_comfyui_source()``, then the ``comfy.*`` imports of the ``with`` body. A requirement of ComfyUI that this
    interpreter lacks (e.g. ``einops``: the pack's test extra does not install ComfyUI's requirements) skips the
    test with its name and the fix, instead of an error; a missing ``comfy`` module is still an error."""
    use_comfyui_source()
    try:
        yield
    except ModuleNotFoundError as exc:
        if (exc.name or "comfy").split(".")[0] == "comfy":
            raise
        pytest.skip(f"COMFYUI_PATH is set, but ComfyUI's requirement {exc.name!r} is not installed in this "
                    f"interpreter ({sys.executable}): install ComfyUI's requirements.txt into it to run this "
                    f"comparison")


@contextmanager
def without_torchvision():
    """ComfyUI's model modules import torchvision at import time (only its video/vision models use it); its compiled
    ops do not load with this torch, so a stub stands in while comfy imports and is removed afterwards."""
    names = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional", "torchvision.ops",
             "torchvision.io", "torchvision.utils")
    saved = {n: sys.modules.get(n) for n in names}
    try:
        import torchvision  # noqa: F401
        yield
        return
    except Exception:  # ImportError or the broken compiled ops (OSError/RuntimeError): stub it
        pass

    class _Stub(types.ModuleType):
        def __getattr__(self, attr):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return _Stub(f"{self.__name__}.{attr}")

        def __call__(self, *args, **kwargs):
            return None

    for n in names:
        stub = _Stub(n)
        stub.__spec__ = importlib.machinery.ModuleSpec(n, None)
        stub.__path__ = []
        sys.modules[n] = stub
    try:
        yield
    finally:
        for n, old in saved.items():
            if old is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = old

"""Lets PyPI's torchvision import next to a CPU-only torch when its compiled ops cannot load.

Installed ONLY into the ComfyUI virtual environment that ``scripts/setup_comfyui.sh`` builds (as
``_leandiffusion_tv_shim.py`` plus a one-line ``.pth``), never into the pack or the test environment.

Why: PyPI's Linux torchvision wheels are CUDA builds; next to the CPU torch wheel their ``torchvision/_C.so``
fails to load. torchvision tolerates that everywhere except ``torchvision/_meta_registrations.py``, which calls
``torch.library.register_fake("torchvision::nms")`` (and ``qnms``) unconditionally and so raises
"operator torchvision::nms does not exist" at ``import torchvision`` -- and ComfyUI imports torchvision at start-up.

What it does: a meta-path hook wraps the loader of ``torchvision.extension``; right after that module ran, if the
compiled ops did not load (``_has_ops()`` is False), it declares the schemas of those two operators (no kernel),
so the fake registration succeeds. Every other torchvision feature is unchanged; calling ``torchvision.ops.nms``
still raises torchvision's own "Couldn't load custom C++ ops" error. Importing the hook costs nothing: torch is
touched only when torchvision itself is imported.
"""
import importlib.abc
import sys

_TARGET = "torchvision.extension"
_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_libraries = []  # torch.library.Library objects unregister their schemas when collected: keep them alive


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        if not module._has_ops():
            import torch

            lib = torch.library.Library("torchvision", "FRAGMENT")
            for schema in _SCHEMAS:
                lib.define(schema)
            _libraries.append(lib)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader)
                return spec
        return None


if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())

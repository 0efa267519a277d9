"""Node registry: merges ``NODE_CLASS_MAPPINGS`` / ``NODE_DISPLAY_NAME_MAPPINGS`` from every module here.

Invariants
- Each node module declares its own mappings; a node ID appears in exactly one module (a duplicate is an
  import-time error, because node IDs are an API that saved workflows reference).
- The node modules import diffusers and transformers lazily, so the nodes register even where one is missing
  (saved workflows still open); importing the registry then logs one warning naming what is missing and the
  ``pip install -r requirements.txt`` line for this Python, instead of leaving the user to find a bare
  ``No module named 'diffusers'`` at the first run.
- ``requirements.txt`` leaves torch to ComfyUI, so pip never raises an old one: a PyTorch below ``MIN_TORCH`` (the
  floor of pyproject.toml, tested: docs/troubleshooting.md, "Library versions") gets one start-up warning saying
  what fails under it.
"""
import importlib
import importlib.metadata
import importlib.util
import logging
import os
import pkgutil
import re
import sys

logger = logging.getLogger(__name__)

# what the model nodes import lazily (requirements.txt); torch, numpy and pillow are ComfyUI's own requirements
REQUIRED_MODULES = {"diffusers": "diffusers", "transformers": "transformers", "safetensors": "safetensors"}

MIN_TORCH = (2, 4)  # pyproject.toml's torch floor

NODE_CLASS_MAPPINGS = {}
NODE_DISPLAY_NAME_MAPPINGS = {}

for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if _info.name.startswith("_"):
        continue
    _module = importlib.import_module(f"{__name__}.{_info.name}")
    for _node_id, _cls in getattr(_module, "NODE_CLASS_MAPPINGS", {}).items():
        if _node_id in NODE_CLASS_MAPPINGS:
            raise RuntimeError(f"node ID {_node_id!r} is declared twice (second time in {_module.__name__})")
        NODE_CLASS_MAPPINGS[_node_id] = _cls
    NODE_DISPLAY_NAME_MAPPINGS.update(getattr(_module, "NODE_DISPLAY_NAME_MAPPINGS", {}))


def _findable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a finder that refuses the name, or a half-imported module
        return False


def missing_requirements() -> list:
    """The distributions of ``REQUIRED_MODULES`` that this Python cannot import (looked up, not imported)."""
    return [dist for module, dist in REQUIRED_MODULES.items() if not _findable(module)]


def warn_missing_requirements() -> None:
    missing = missing_requirements()
    if missing:
        requirements = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "requirements.txt")
        one = len(missing) == 1
        logger.warning("LeanDiffusion: %s %s not installed in this Python; the nodes that need %s fail until you "
                       "install the pack's requirements: %s -m pip install -r %s", " and ".join(missing),
                       "is" if one else "are", "it" if one else "them", sys.executable, requirements)


def torch_too_old(version: str) -> bool:
    """Whether a PyTorch version string (``2.3.1+cu121``, ``2.13.0+cpu``) is below ``MIN_TORCH``."""
    major, minor = (int(re.match(r"\d+", part).group()) for part in version.split(".")[:2])
    return (major, minor) < MIN_TORCH


def warn_old_torch(version: str) -> None:
    if torch_too_old(version):
        logger.warning("LeanDiffusion: PyTorch %s is older than %d.%d, the oldest the pack is tested with: under it "
                       "ESRGAN Upscale's out-of-memory retry and cancel end in AttributeError, and compile+cuda_graph "
                       "keeps applying a LoRA that was removed (PyTorch 2.3). Upgrade the PyTorch of this Python (%s)", version,
                       *MIN_TORCH, sys.executable)


def installed_torch_version():
    """The installed PyTorch's version, read from its metadata (torch is not imported here), or None."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


warn_missing_requirements()
_TORCH_VERSION = installed_torch_version()
if _TORCH_VERSION is not None:
    warn_old_torch(_TORCH_VERSION)

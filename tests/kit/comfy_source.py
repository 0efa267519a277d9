"""Import ComfyUI's own modules from a source tree (``COMFYUI_PATH``) for tests that compare against them.

ComfyUI's code is a reference here, never part of the pack: tests marked ``comfyui`` call ``use_comfyui_source()``
and then import ``comfy.*``. On a machine without CUDA it sets ``--cpu`` first, as ``main.py --cpu`` does (it must
precede the first import of ``comfy.model_management``).
"""
import os
import sys

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

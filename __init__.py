"""LeanDiffusion: a ComfyUI node pack for fast, lean diffusion inference.

ComfyUI imports this folder from ``custom_nodes/<any name>/``; ``pip install -e .`` exposes the same tree as
the import package ``leandiffusion``. This file only exports the node mappings; importing it never imports
ComfyUI's own modules (see ``bridge.py``).
"""
from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

WEB_DIRECTORY = None
__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]

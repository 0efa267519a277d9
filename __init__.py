"""LeanDiffusion: a ComfyUI node pack for fast, lean diffusion inference.

ComfyUI imports this folder from ``custom_nodes/<any name>/``; ``pip install -e .`` exposes the same tree as
the import package ``leandiffusion``. This file only exports the node mappings; importing it never imports
ComfyUI's own modules (see ``bridge.py``).

The node registry (and with it torch and diffusers) is imported on first access to ``NODE_CLASS_MAPPINGS`` or
``NODE_DISPLAY_NAME_MAPPINGS`` (PEP 562 module ``__getattr__``), so ``python -m leandiffusion.run`` -- the headless
runner, standard library and websocket-client only -- starts without loading torch and also works on a client
machine that only talks to a remote ComfyUI. ComfyUI reads the mappings right after importing this file, so an
import error of the nodes surfaces there exactly as an eager import would.
"""
WEB_DIRECTORY = None
__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]


def __getattr__(name: str):
    if name in __all__:
        from . import nodes
        return getattr(nodes, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

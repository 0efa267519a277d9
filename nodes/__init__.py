"""Node registry: merges ``NODE_CLASS_MAPPINGS`` / ``NODE_DISPLAY_NAME_MAPPINGS`` from every module here.

Invariant: each node module declares its own mappings; a node ID appears in exactly one module (a duplicate is
an import-time error, because node IDs are an API that saved workflows reference).
"""
import importlib
import pkgutil

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

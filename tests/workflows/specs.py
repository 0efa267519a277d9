"""Node specs for checking workflows without ComfyUI: the pack's own declarations in ``/object_info`` form plus the
recorded ComfyUI core-node snapshot (``tests/fixtures/core_object_info.json``, made by ``snapshot_core_nodes.py``).

``pack_object_info()`` builds each pack node's entry the way ComfyUI's server does (``server.py`` ``node_info``):
``input`` (required / optional as declared), ``input_order``, ``output`` = RETURN_TYPES, ``output_name`` =
RETURN_NAMES or RETURN_TYPES, ``output_is_list``, ``name``, ``display_name``, ``category``; JSON round-tripped, so
tuples become lists exactly as ``GET /object_info`` shows them.

Which COMBO inputs list files (any value is legal there, because the real list depends on the user's model
folders): for core nodes, the snapshot's ``dynamic_combos``; for pack nodes, those whose options change when the
model folders (``$LEANDIFFUSION_MODELS``, read by ``bridge.list_models``) hold a probe file and sub-folder of each
kind. The probe runs in a temporary folder and restores the variable afterwards.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

PACK_ROOT = Path(__file__).resolve().parent.parent.parent
CORE_SNAPSHOT = PACK_ROOT / "tests" / "fixtures" / "core_object_info.json"
WORKFLOWS_DIR = PACK_ROOT / "workflows"  # editor files: ComfyUI's template browser lists this folder
API_WORKFLOWS_DIR = PACK_ROOT / "workflows_api"  # their API twins: a folder the template browser does not list
PROBE = "zz_probe"
PROBE_FOLDERS = ("checkpoints", "diffusers", "loras", "upscale_models", "vae", "embeddings", "text_encoders", "clip",
                 "diffusion_models", "unet")
PROBE_EXTENSIONS = (".safetensors", ".sft", ".pth", ".pt", ".ckpt", ".bin")
MODELS_ENV = "LEANDIFFUSION_MODELS"


def node_info(node_id: str, cls: Any, display_name: str | None = None) -> dict:
    """One pack node's ``/object_info`` entry, as ComfyUI's server builds it for a V1 node."""
    declared = cls.INPUT_TYPES()
    sections = {k: dict(declared[k]) for k in ("required", "optional") if declared.get(k)}
    outputs = list(cls.RETURN_TYPES)
    info = {
        "input": sections,
        "input_order": {k: list(v) for k, v in sections.items()},
        "output": outputs,
        "output_is_list": list(getattr(cls, "OUTPUT_IS_LIST", [False] * len(outputs))),
        "output_name": list(getattr(cls, "RETURN_NAMES", None) or outputs),
        "name": node_id,
        "display_name": display_name or node_id,
        "description": getattr(cls, "DESCRIPTION", ""),
        "python_module": "custom_nodes.leandiffusion",
        "category": getattr(cls, "CATEGORY", ""),
        "output_node": bool(getattr(cls, "OUTPUT_NODE", False)),
    }
    return json.loads(json.dumps(info))


def pack_object_info() -> dict:
    """``/object_info`` entries of every node the pack registers (``NODE_CLASS_MAPPINGS``)."""
    from leandiffusion import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

    return {nid: node_info(nid, cls, NODE_DISPLAY_NAME_MAPPINGS.get(nid)) for nid, cls in NODE_CLASS_MAPPINGS.items()}


def core_snapshot(path: Path = CORE_SNAPSHOT) -> dict:
    """The recorded snapshot: ``{"comfyui_version", "dynamic_combos", "object_info"}``."""
    return json.loads(Path(path).read_text())


def _combo_options(conf: Any) -> list | None:
    if not isinstance(conf, list) or not conf:
        return None
    if isinstance(conf[0], list):
        return conf[0]
    if conf[0] == "COMBO" and len(conf) > 1 and isinstance(conf[1], dict):
        return conf[1].get("options")
    return None


def _combos(info: dict) -> dict[tuple[str, str], list]:
    out = {}
    for nid, spec in info.items():
        for section in ("required", "optional"):
            for name, conf in (spec.get("input", {}).get(section) or {}).items():
                options = _combo_options(conf)
                if options is not None:
                    out[(nid, name)] = options
    return out


def pack_dynamic_combos() -> set[tuple[str, str]]:
    """(node id, input) of every pack COMBO whose options come from the model folders."""
    saved = os.environ.get(MODELS_ENV)
    try:
        with tempfile.TemporaryDirectory(prefix="leandiffusion-probe-") as tmp:
            empty, probed = Path(tmp) / "empty", Path(tmp) / "probed"
            empty.mkdir()
            for folder in PROBE_FOLDERS:
                (probed / folder / f"{PROBE}_dir").mkdir(parents=True)
                for ext in PROBE_EXTENSIONS:
                    (probed / folder / f"{PROBE}{ext}").write_bytes(b"")
            os.environ[MODELS_ENV] = str(empty)
            before = _combos(pack_object_info())
            os.environ[MODELS_ENV] = str(probed)
            after = _combos(pack_object_info())
    finally:
        if saved is None:
            os.environ.pop(MODELS_ENV, None)
        else:
            os.environ[MODELS_ENV] = saved
    return {key for key in after if before.get(key) != after[key]}


def combined() -> tuple[dict, set[tuple[str, str]]]:
    """(object_info of the pack and the core snapshot, the set of file-list COMBO inputs)."""
    snap = core_snapshot()
    info = dict(snap["object_info"])
    pack = pack_object_info()
    clash = sorted(set(pack) & set(info))
    if clash:
        raise ValueError(f"pack node ids {clash} shadow ComfyUI core nodes; rename them in the pack")
    info.update(pack)
    dynamic = {(nid, name) for nid, names in snap["dynamic_combos"].items() for name in names}
    return info, dynamic | pack_dynamic_combos()

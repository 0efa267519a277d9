"""Regenerate ``tests/fixtures/core_object_info.json``: the ``/object_info`` specs of the ComfyUI core nodes that
the shipped workflows (and users' graphs around the pack) use, recorded from the real ComfyUI.

The consistency test (``test_workflow_consistency.py``) checks the workflows against the pack's own declarations plus
this snapshot, so it runs in CI without ComfyUI. Run it again after moving to another ComfyUI version::

    COMFYUI_PATH=/path/to/ComfyUI python -m leandiffusion.tests.workflows.snapshot_core_nodes [--out FILE]

How file lists are told from fixed option lists: ComfyUI is started with a probe file (``zz_probe.*``) in every
model folder and in its input folder. A COMBO whose options include a probe lists files: it is written with its
probes removed and named under ``dynamic_combos`` (any value is legal there; the real list depends on the machine).
A COMBO that is empty in a probed run lists a folder the probe could not reach; it is named there too.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from leandiffusion.runner.client import ComfyClient
from leandiffusion.runner.local import LocalComfyUI

CORE_NODES = (
    "CheckpointLoaderSimple", "VAELoader", "CLIPLoader", "DualCLIPLoader", "CLIPSetLastLayer", "LoraLoader",
    "LoraLoaderModelOnly", "UpscaleModelLoader", "CLIPTextEncode", "CLIPTextEncodeSDXL", "ConditioningCombine",
    "ConditioningConcat", "ConditioningZeroOut", "ConditioningSetArea", "EmptyLatentImage", "LatentUpscale",
    "LatentUpscaleBy", "KSampler", "KSamplerAdvanced", "VAEDecode", "VAEEncode", "VAEDecodeTiled", "VAEEncodeTiled",
    "ImageUpscaleWithModel", "ImageScale", "ImageScaleBy", "ImageInvert", "ImageBatch", "EmptyImage", "LoadImage",
    "SaveImage", "PreviewImage",
)
PROBE = "zz_probe"
PROBE_EXTENSIONS = (".safetensors", ".pth", ".pt", ".ckpt", ".bin", ".gguf")
MODEL_FOLDERS = ("checkpoints", "configs", "loras", "vae", "text_encoders", "clip", "diffusion_models", "unet",
                 "clip_vision", "style_models", "embeddings", "diffusers", "vae_approx", "controlnet", "gligen",
                 "upscale_models", "hypernetworks", "photomaker", "classifiers", "model_patches", "audio_encoders")
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "fixtures" / "core_object_info.json"


def _probe_tree(root: Path) -> tuple[Path, Path, Path]:
    models, inputs = root / "models", root / "input"
    for folder in MODEL_FOLDERS:
        (models / folder / f"{PROBE}_dir").mkdir(parents=True)
        for ext in PROBE_EXTENSIONS + (".yaml",):
            (models / folder / f"{PROBE}{ext}").write_bytes(b"")
    inputs.mkdir()
    (inputs / f"{PROBE}.png").write_bytes(b"")
    config = root / "probe_paths.yaml"
    config.write_text("probe:\n  base_path: " + str(models) + "\n"
                      + "".join(f"  {folder}: {folder}\n" for folder in MODEL_FOLDERS))
    return models, inputs, config


def _strip_probes(spec: dict) -> list[str]:
    """Remove probe options from ``spec``'s COMBOs in place; return the names of the inputs that list files."""
    dynamic = []
    for section in ("required", "optional"):
        for name, conf in (spec.get("input", {}).get(section) or {}).items():
            options = conf[0] if conf else None
            if conf and conf[0] == "COMBO" and len(conf) > 1 and isinstance(conf[1], dict):
                options = conf[1].get("options")
            if not isinstance(options, list):
                continue
            kept = [o for o in options if not (isinstance(o, str) and PROBE in o)]
            if len(kept) != len(options) or not options:
                dynamic.append(name)
            options[:] = kept
    return dynamic


def snapshot(comfyui_path: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="leandiffusion-probe-") as tmp:
        _, inputs, config = _probe_tree(Path(tmp))
        with LocalComfyUI(comfyui_path, cpu=True, input_dir=inputs,
                          extra_args=["--extra-model-paths-config", str(config)]) as server:
            client = ComfyClient(server.url)
            info = client.object_info()
            version = client.get_json("/system_stats").get("system", {}).get("comfyui_version", "unknown")
    missing = [n for n in CORE_NODES if n not in info]
    if missing:
        raise SystemExit(f"this ComfyUI lacks core nodes {', '.join(missing)}; edit CORE_NODES or use another version")
    nodes, dynamic = {}, {}
    for name in CORE_NODES:
        spec = info[name]
        names = _strip_probes(spec)
        if names:
            dynamic[name] = names
        nodes[name] = spec
    return {"_about": "ComfyUI core node specs from GET /object_info, recorded by "
                      "tests/workflows/snapshot_core_nodes.py; file-list COMBOs are named in dynamic_combos.",
            "comfyui_version": version, "dynamic_combos": dynamic, "object_info": nodes}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--comfyui", default=os.environ.get("COMFYUI_PATH"), help="ComfyUI folder ($COMFYUI_PATH)")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help=f"output file (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    if not args.comfyui:
        parser.error("give --comfyui PATH or set COMFYUI_PATH")
    data = snapshot(args.comfyui)
    Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
    sys.stdout.write(f"wrote {len(data['object_info'])} core node specs (ComfyUI {data['comfyui_version']}) "
                     f"to {args.out}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``--tiny``: run a workflow without its models, on the pack's tiny random stand-ins (the pictures are noise).

Invariant: a workflow's model inputs change only when the user asks with ``--tiny``; every change is listed on
stderr (``note: --tiny: node 1 (LeanModelLoader) model: 'v1-5-pruned-emaonly.safetensors' -> 'tiny-random
(test)'``) unless ``-q``, and ``--set`` applies after it, so the user's own values win. Nothing else changes: sizes,
steps, prompts, seeds and accelerations stay as the workflow says. Without ``--tiny`` a missing model is refused by
ComfyUI's validation (exit 2), and the runner's message then names ``--tiny``.

What ``--tiny`` sets, where the node declares the input (``TINY_INPUTS``): the Memory Pool Loader's ``model`` to the
loader's built-in ``tiny-random (test)`` (an SD1.x-like model; ``tiny-random Z-Image (test)`` in a workflow with
the Fused Flow Sampler; in a workflow with ComfyUI's own CLIP or checkpoint loader, a small SD1 checkpoint holding a
random full-size CLIP-L, since ComfyUI builds CLIP-L at full size and the sampler needs its 768-wide context) and its
``weight_dtype`` to ``auto`` (a precision chosen for the real model's memory; ``auto`` is fp32 on the CPU, where fp16
runs many times slower), LoRA and upscaler names to tiny random files, ``target_blocks`` to "" (block names are the
real architecture's; the tiny UNet has fewer), ComfyUI's ``CLIPLoader`` / ``CheckpointLoaderSimple`` to the
random CLIP-L files, and the split-file loader's three files to the tiny Z-Image's (written with a diffusers folder
of it, whose tokenizer the loader finds before ComfyUI's full-vocabulary Qwen files); in a workflow with the Fused
Edit Sampler or the Stream Edit Sampler, to the tiny Qwen-Image-Edit's (``memory/tiny_qwen_image.py``: the whole
Qwen2.5-VL, vision tower included, so the loaded model can edit; likewise with a Qwen-Image-Edit diffusers folder for
its tokenizer). LoadImage keeps its file: a started ComfyUI reads it from its input folder (``--input-dir``, else
ComfyUI's own ``input/``, which ships the shipped workflows' ``example.png``).

The stand-in files: with ``--comfyui``, written once into ``tiny_models_dir()`` by ComfyUI's own interpreter
(``python -m leandiffusion.tests.kit.tiny_model_files``: torch and the pack's requirements are there, the runner
itself needs only the standard library) and added to the started ComfyUI's model folders; only the files the
workflow's node types need are written (the CLIP-L pair is ~740 MB, the others are small). With ``--server`` the
runner cannot write into that ComfyUI's folders: it says which files the workflow needs and how to write them.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterable

from .convert import input_names
from .errors import ServerUnreachable

TINY_SD = "tiny-random (test)"
TINY_ZIMAGE = "tiny-random Z-Image (test)"
# stand-in files: name -> (the writer's kind, model sub-folder)
LORA = "leandiffusion_tiny_sd1_lora.safetensors"
UPSCALER = "leandiffusion_tiny_compact_x4.safetensors"
CLIP_L = "leandiffusion_tiny_clip_l.safetensors"
SD1_CLIP_L = "leandiffusion_tiny_sd1_clip_l.safetensors"
ZIMAGE_TAG = "leandiffusion_tiny_zimage"  # the tiny Z-Image's split files (and a diffusers folder for its tokenizer)
ZIMAGE_DIT = f"{ZIMAGE_TAG}_diffusion_model.safetensors"
ZIMAGE_TE = f"{ZIMAGE_TAG}_text_encoder.safetensors"
ZIMAGE_VAE = f"{ZIMAGE_TAG}_vae.safetensors"
QWEN_EDIT_TAG = "leandiffusion_tiny_qwen_image_edit"  # the tiny Qwen-Image-Edit's, likewise
QWEN_EDIT_DIT = f"{QWEN_EDIT_TAG}_diffusion_model.safetensors"
QWEN_EDIT_TE = f"{QWEN_EDIT_TAG}_text_encoder.safetensors"
QWEN_EDIT_VAE = f"{QWEN_EDIT_TAG}_vae.safetensors"
FILES = {LORA: ("lora", "loras"), UPSCALER: ("upscaler", "upscale_models"), CLIP_L: ("clip_l", "text_encoders"),
         SD1_CLIP_L: ("sd1_clip_l", "checkpoints"), ZIMAGE_DIT: ("zimage", "diffusion_models"),
         QWEN_EDIT_DIT: ("qwen_image_edit", "diffusion_models")}
WRITER = "leandiffusion.tests.kit.tiny_model_files"

# (class type, input) -> stand-in value, set where the workflow's node declares that input
TINY_INPUTS: dict[tuple[str, str], Any] = {
    ("LeanModelLoader", "model"): TINY_SD,
    ("LeanModelLoader", "weight_dtype"): "auto",  # the device's own precision: fp32 on the CPU, where fp16 crawls
    ("LeanLoraInjector", "lora_name"): LORA,
    ("LeanLoraInjector", "target_blocks"): "",
    ("LeanESRGANUpscale", "model_name"): UPSCALER,
    ("CLIPLoader", "clip_name"): CLIP_L,
    ("CLIPLoader", "type"): "stable_diffusion",
    ("CheckpointLoaderSimple", "ckpt_name"): SD1_CLIP_L,
    ("LeanSplitModelLoader", "diffusion_model"): ZIMAGE_DIT,
    ("LeanSplitModelLoader", "text_encoder"): ZIMAGE_TE,
    ("LeanSplitModelLoader", "vae"): ZIMAGE_VAE,
    ("LeanSplitModelLoader", "weight_dtype"): "auto",
}
# a workflow holding a node of one of these types gets this stand-in for the Memory Pool Loader instead (first match)
LOADER_BY_NEIGHBOUR = (("LeanFlowSampler", TINY_ZIMAGE), ("CLIPLoader", SD1_CLIP_L),
                       ("CheckpointLoaderSimple", SD1_CLIP_L))
# a workflow holding a node of one of these types gets these stand-ins for the split-file loader instead (first match)
QWEN_EDIT_SPLIT = {"diffusion_model": QWEN_EDIT_DIT, "text_encoder": QWEN_EDIT_TE, "vae": QWEN_EDIT_VAE}
SPLIT_BY_NEIGHBOUR = (("LeanEditSampler", QWEN_EDIT_SPLIT), ("LeanEditStreamSampler", QWEN_EDIT_SPLIT))
# the stand-in files each node type needs
NEEDS = {"LeanLoraInjector": (LORA,), "LeanESRGANUpscale": (UPSCALER,), "CLIPLoader": (CLIP_L, SD1_CLIP_L),
         "CheckpointLoaderSimple": (CLIP_L, SD1_CLIP_L), "LeanSplitModelLoader": (ZIMAGE_DIT,)}
MODEL_INPUTS = {name for (_, name) in TINY_INPUTS if name not in ("target_blocks", "type", "weight_dtype")}


def class_types(kind: str, workflow: dict) -> set[str]:
    """The node types of a workflow as read from the file (API ``class_type``, editor ``type``), before conversion."""
    if kind == "api":
        return {node.get("class_type") for node in workflow.values() if isinstance(node, dict)} - {None}
    return {node.get("type") for node in workflow.get("nodes") or [] if isinstance(node, dict)} - {None}


def _table(types: set) -> dict[tuple[str, str], Any]:
    """``TINY_INPUTS`` with the loaders' stand-ins chosen by what else a workflow of these node types holds."""
    loader = next((value for neighbour, value in LOADER_BY_NEIGHBOUR if neighbour in types), TINY_SD)
    split = next((files for neighbour, files in SPLIT_BY_NEIGHBOUR if neighbour in types), {})
    return {**TINY_INPUTS, ("LeanModelLoader", "model"): loader,
            **{("LeanSplitModelLoader", name): value for name, value in split.items()}}


def files_needed(types: Iterable[str]) -> list[str]:
    """The stand-in files (``FILES`` keys) a workflow with these node types needs, in a fixed order: each node
    type's ``NEEDS``, the split-file loader's being the diffusion model file ``--tiny`` gives it."""
    types = set(types)
    split_dit = _table(types)[("LeanSplitModelLoader", "diffusion_model")]
    wanted = {name for t in types for name in NEEDS.get(t, ())}
    if "LeanSplitModelLoader" in types:
        wanted = (wanted - set(NEEDS["LeanSplitModelLoader"])) | {split_dit}
    return [name for name in FILES if name in wanted]


def tiny_overrides(prompt: dict, object_info: dict) -> list[tuple[str, str, Any]]:
    """``(node id, input, stand-in)`` for every input ``--tiny`` sets in the API ``prompt`` (module docstring)."""
    table = _table({node.get("class_type") for node in prompt.values()})
    out = []
    for node_id in sorted(prompt, key=lambda k: (len(k), k)):
        node = prompt[node_id]
        spec = object_info.get(node.get("class_type"))
        declared = input_names(spec) if spec else []
        for (class_type, name), value in table.items():
            if node.get("class_type") == class_type and name in declared:
                out.append((node_id, name, value))
    return out


def tiny_notes(prompt: dict, overrides: list[tuple[str, str, Any]]) -> list[str]:
    """One ``note:`` line per input whose value ``--tiny`` changes."""
    lines = []
    for node_id, name, value in overrides:
        node = prompt[node_id]
        before = node.get("inputs", {}).get(name) if isinstance(node.get("inputs"), dict) else None
        if before != value:
            lines.append(f"note: --tiny: node {node_id} ({node['class_type']}) {name}: {before!r} -> {value!r}")
    return lines


def tiny_models_dir() -> Path:
    """Where the runner keeps the stand-in files: ``$LEANDIFFUSION_TINY_MODELS``, else
    ``$XDG_CACHE_HOME/leandiffusion/tiny-models``, else ``~/.cache/leandiffusion/tiny-models``."""
    if os.environ.get("LEANDIFFUSION_TINY_MODELS"):
        return Path(os.environ["LEANDIFFUSION_TINY_MODELS"]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "leandiffusion" / "tiny-models"


def writer_command(python: str, folder: Path, names: Iterable[str]) -> list[str]:
    return [python, "-m", WRITER, str(folder)] + [f"{FILES[n][0]}={FILES[n][1]}/{n}" for n in names]


def write_files(python: str, pack_dir: Path, folder: Path, names: list[str], timeout: float = 900.0,
                quiet: bool = False) -> None:
    """Write the missing stand-in files ``names`` into ``folder`` with ``python`` (ComfyUI's interpreter), the pack
    importable as ``leandiffusion`` through a temporary link; ``ServerUnreachable`` (exit 4) when it fails."""
    missing = [n for n in names if not (folder / FILES[n][1] / n).is_file()]
    if not missing:
        return
    if not quiet:
        print(f"note: --tiny: writing the stand-in model files {', '.join(missing)} into {folder} (once)",
              file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="leandiffusion-tiny-") as link:
        (Path(link) / "leandiffusion").symlink_to(Path(pack_dir).resolve(), target_is_directory=True)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (link, os.environ.get("PYTHONPATH")) if p))
        try:
            done = subprocess.run(writer_command(python, folder, missing), env=env, stdin=subprocess.DEVNULL,
                                  capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.SubprocessError) as exc:
            raise ServerUnreachable(f"--tiny: could not write the stand-in model files with {python}: {exc}") from exc
    if done.returncode != 0:
        tail = [line for line in (done.stderr or done.stdout).strip().splitlines() if line.strip()][-8:]
        raise ServerUnreachable(f"--tiny: writing the stand-in model files with {python} failed",
                                [f"--tiny: writing the stand-in model files with {python} failed (exit "
                                 f"{done.returncode}); install the pack's requirements.txt with that python. Its "
                                 f"output ends:"] + [f"  {line}" for line in tail])


def server_note(names: list[str]) -> list[str]:
    """What to tell a ``--server`` user whose workflow needs stand-in files the runner cannot write there."""
    if not names:
        return []
    where = ", ".join(f"{FILES[n][1]}/{n}" for n in names)
    return [f"note: --tiny: this workflow needs the stand-in files {where} in the server's model folders; write "
            f"them with that ComfyUI's python: python -m {WRITER} COMFYUI/models"]

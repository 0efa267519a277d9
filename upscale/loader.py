"""Read an upscaler file (``.safetensors`` or ``.pth``/``.pt``/``.ckpt``) and build an ``Upscaler``.

Invariant: weights are read only through ``safetensors`` or ``torch.load(..., weights_only=True)``; a file that
cannot be read, is cut short, or holds no known upscaler raises ``ValueError`` naming the file and the fix.
Our own architectures (``detect.REGISTRY``) are tried first; any other architecture loads through ``spandrel``
when that package imports (it does inside ComfyUI), wrapped so the runner treats it the same way. Building an
upscaler leaves torch's global random generator as it was (later nodes' seeds must not depend on it).

Safetensors metadata ``leandiffusion.output_scale`` (written by ``convert_ncnn`` for ncnn graphs that end in a
fixed resize, e.g. Real-ESRGAN's animevideov3 x2/x3 which are the x4 net followed by a bicubic downscale) sets
what ``output_scale = 0`` means for that file.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Mapping, Optional, Union

import torch

from ..torchfile import load_tensors, read_safetensors
from .descriptor import Upscaler
from .detect import detect

logger = logging.getLogger(__name__)

OUTPUT_SCALE_KEY = "leandiffusion.output_scale"
EXTENSIONS = (".safetensors", ".pth", ".pt", ".ckpt")


# Containers trainers wrap weights in (BasicSR/Real-ESRGAN "params_ema"/"params", traiNNer "params-ema", ...): the
# keys spandrel's ``canonicalize_state_dict`` unwraps (what ComfyUI's own upscale loader accepts), EMA first.
WRAPPER_KEYS = ("params_ema", "params-ema", "params", "state_dict", "model_state_dict", "model", "net")
# Prefixes removed when every key carries them (DataParallel's "module.", old BasicSR generators' "netG.").
COMMON_PREFIXES = ("module.", "netG.")


def _unwrap(obj, path: Path) -> dict:
    if isinstance(obj, Mapping):
        for key in WRAPPER_KEYS:
            inner = obj.get(key)
            if isinstance(inner, Mapping) and inner:
                obj = inner
                break
        else:
            if len(obj) == 1 and isinstance(next(iter(obj.values())), Mapping):  # one unknown wrapping key
                obj = next(iter(obj.values()))
    if not isinstance(obj, Mapping) or not obj:
        raise ValueError(f"{path}: holds {type(obj).__name__}, not a state dict of tensors; an upscaler file "
                         f"must be a (possibly 'params_ema'-wrapped) mapping of layer names to tensors")
    sd = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
    if not sd:
        raise ValueError(f"{path}: the mapping holds no tensors, so it is not a model's weights")
    for prefix in COMMON_PREFIXES:
        if all(k.startswith(prefix) for k in sd):
            sd = {k[len(prefix):]: v for k, v in sd.items()}
    return sd


def read_state_dict(path: Union[str, Path]) -> tuple[dict, dict]:
    """``(state_dict, metadata)`` of an upscaler file; ``ValueError`` when the file is unreadable or cut short."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"upscaler file {path} does not exist; put it in the 'upscale_models' folder")
    suffix = path.suffix.lower()
    if suffix not in EXTENSIONS:
        raise ValueError(f"upscaler file {path}: extension {suffix!r} is not one of {EXTENSIONS}")
    metadata: dict = {}
    if suffix == ".safetensors":
        obj, metadata = read_safetensors(path, "upscaler file")
    else:
        obj = load_tensors(path, "upscaler file")
    return _unwrap(obj, path), metadata


def _spandrel_call(desc):
    """Run spandrel's per-architecture call function on the runner's (device/dtype) copy of the module."""
    call_fn = getattr(desc, "_call_fn", None) or (lambda model, image: model(image))
    return lambda module, x, work_bytes: call_fn(module, x)


def _spandrel_upscaler(sd: dict, path: Path) -> Optional[Upscaler]:
    try:
        import spandrel
    except (ImportError, RuntimeError, OSError) as exc:  # spandrel drags in torchvision, which may fail to load
        logger.debug("spandrel unavailable: %s", exc)
        return None
    try:
        with torch.random.fork_rng(devices=[]):  # spandrel builds with random init before loading: keep the seed
            desc = spandrel.ModelLoader().load_from_state_dict(sd)
    except spandrel.UnsupportedModelError:
        return None
    if not isinstance(desc, spandrel.ImageModelDescriptor):
        raise ValueError(f"{path}: spandrel recognises a {desc.architecture.name} model, which is not a "
                         f"single-image upscaler (it needs a mask or other inputs)")
    req = desc.size_requirements
    if req.square:
        raise ValueError(f"{path}: {desc.architecture.name} needs square inputs, which tiling cannot promise")
    return Upscaler(desc.model.eval(), f"spandrel:{desc.architecture.name}", int(desc.scale),
                    desc.input_channels, desc.output_channels, min_size=max(1, req.minimum),
                    multiple_of=max(1, req.multiple_of), supports_half=desc.supports_half,
                    supports_bf16=desc.supports_bfloat16, context=None,
                    call=_spandrel_call(desc), tags=tuple(desc.tags))


def build_upscaler(sd: Mapping[str, torch.Tensor], metadata: Optional[dict] = None,
                   source: str = "<state dict>") -> Upscaler:
    """An ``Upscaler`` from a state dict (our registry first, then spandrel); ``ValueError`` if none fits."""
    entry = detect(sd)
    if entry is not None:
        try:
            up = entry.build(sd)
        except ValueError as exc:
            raise ValueError(f"{source}: looks like {entry.name} but does not load: {exc}") from exc
    else:
        up = _spandrel_upscaler(dict(sd), Path(source))
        if up is None:
            sample = sorted(sd.keys())[:4]
            raise ValueError(f"{source}: not a known upscaler (keys start {sample}); supported here are "
                             f"ESRGAN/Real-ESRGAN RRDBNet and SRVGGNetCompact, plus every architecture spandrel "
                             f"knows when spandrel is installed (it is inside ComfyUI)")
    value = (metadata or {}).get(OUTPUT_SCALE_KEY)
    if value is not None:
        from dataclasses import replace

        up = replace(up, default_output_scale=float(value))
    return up


def load_upscaler(path: Union[str, Path]) -> Upscaler:
    """Read ``path`` and build its ``Upscaler`` (see the module docstring)."""
    sd, metadata = read_state_dict(path)
    return build_upscaler(sd, metadata, str(path))

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

from ..torchfile import load_tensors, read_safetensors, refuse_non_finite
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


def _import_spandrel():
    """spandrel (ComfyUI's upscale-model library) when it imports here, else ``None``."""
    try:
        import spandrel
    except (ImportError, RuntimeError, OSError) as exc:  # spandrel drags in torchvision, which may fail to load
        logger.debug("spandrel unavailable: %s", exc)
        return None
    return spandrel


def _spandrel_upscaler(spandrel, sd: dict, path: Path) -> Optional[Upscaler]:
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


# Files that are not upscalers but land in models/upscale_models (a checkpoint saved to the wrong folder, a
# download named like an upscaler): (key fragments, what the file is, ComfyUI's models folder for it). The first
# entry with a key containing one of its fragments names the file in the error, so the user learns where it goes.
OTHER_MODEL_KINDS = (
    (("model.diffusion_model.", "first_stage_model.", "cond_stage_model.", "conditioner.embedders."),
     "a Stable Diffusion checkpoint", "checkpoints"),
    (("lora_unet_", "lora_te", ".lora_down.", ".lora_up.", ".lora_A.", ".lora_B.", ".lora.down."), "a LoRA", "loras"),
    (("control_model.", "controlnet_cond_embedding.", "controlnet_down_blocks."), "a ControlNet", "controlnet"),
    (("encoder.conv_in.", "decoder.conv_in.", "encoder.down_blocks.", "decoder.up_blocks."), "a VAE", "vae"),
    (("text_model.", "text_projection", "encoder.block.0.layer.0."), "a text encoder", "text_encoders"),
    (("emb_params", "clip_l", "clip_g"), "a textual-inversion embedding", "embeddings"),
)


def _not_an_upscaler(sd: Mapping[str, torch.Tensor], source: str, spandrel) -> ValueError:
    """The error for a state dict no loader takes: the file, what it looks like, and what to do."""
    sample = sorted(sd.keys())[:4]
    for fragments, kind, folder in OTHER_MODEL_KINDS:
        hit = next((k for k in sorted(sd) if any(f in k for f in fragments)), None)
        if hit is not None:
            return ValueError(f"{source}: not an upscaler: it looks like {kind} (key {hit!r}); move it to "
                              f"models/{folder} and choose an upscale model (ESRGAN, Real-ESRGAN, ...) here")
    if spandrel is None:
        tried = ("spandrel, which loads the other architectures (SwinIR, HAT, DAT, ...), is not installed in "
                 "this Python (it is inside ComfyUI)")
    else:
        tried = (f"spandrel {getattr(spandrel, '__version__', '')} (ComfyUI's upscale-model library) does not "
                 f"know it either, so ComfyUI's Load Upscale Model refuses it too")
    return ValueError(f"{source}: not a known upscaler (keys start {sample}); built in are ESRGAN/Real-ESRGAN "
                      f"RRDBNet and SRVGGNetCompact, and {tried}; check that the file is an image upscale model "
                      f"and was downloaded completely")


def build_upscaler(sd: Mapping[str, torch.Tensor], metadata: Optional[dict] = None,
                   source: str = "<state dict>") -> Upscaler:
    """An ``Upscaler`` from a state dict (our registry first, then spandrel); ``ValueError`` if none fits."""
    refuse_non_finite(sd, f"upscaler file {source}", "every upscaled image NaN (black) or noise",
                      "download the model again or use another one")
    entry = detect(sd)
    if entry is not None:
        try:
            up = entry.build(sd)
        except ValueError as exc:
            raise ValueError(f"{source}: looks like {entry.name} but does not load: {exc}") from exc
    else:
        spandrel = _import_spandrel()
        up = None if spandrel is None else _spandrel_upscaler(spandrel, dict(sd), Path(source))
        if up is None:
            raise _not_an_upscaler(sd, source, spandrel)
    value = (metadata or {}).get(OUTPUT_SCALE_KEY)
    if value is not None:
        from dataclasses import replace

        up = replace(up, default_output_scale=float(value))
    return up


def load_upscaler(path: Union[str, Path]) -> Upscaler:
    """Read ``path`` and build its ``Upscaler`` (see the module docstring)."""
    sd, metadata = read_state_dict(path)
    return build_upscaler(sd, metadata, str(path))

"""Single-file LDM checkpoints (``.safetensors``) -> diffusers/transformers modules, offline.

Pipeline: read the safetensors header (names + shapes) -> detect the family (``memory/families.py``) -> infer
configs from shapes (``memory/ldm_config.py``) -> convert the state dict with diffusers' own converters
(``convert_ldm_unet_checkpoint``, ``convert_ldm_vae_checkpoint``, ``convert_ldm_clip_checkpoint``,
``convert_open_clip_checkpoint``) -> build each module and load it with ``strict=True``.

Invariants
- Only safetensors files are read (no pickle). A truncated file or one that is not safetensors raises
  ``ValueError`` naming the file before any module is built.
- Every module is loaded strictly: a missing or unexpected tensor is an error, never a silently random weight.
- Modules are created on the meta device and take the file's tensors by assignment (no random init), then copy
  each weight still a view of the file's mapping into memory of their own (``torchfile.own_file_backed``): a file
  overwritten or cut short later never changes or crashes a loaded model. The returned modules are on the CPU, in
  eval mode, without gradients, in the file's dtype.
- Hand-written here (no library does it): only key-prefix fitting between transformers versions (``CLIPTextModel``
  lost its ``text_model.`` wrapper in transformers 5.6), the same fitting for old SD1 files that store CLIP-L
  without ``text_model.`` (as ComfyUI's ``SD15.process_clip_state_dict`` renames them), and dropping SD2's unused
  last OpenCLIP block.
- Sampling settings a file records (``v_pred``, ``ztsnr``) or that SD2 leaves to a rule come from
  ``families.scheduler_overrides``; every error raised while converting names the file.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Callable, Optional

import torch

from ..torchfile import own_file_backed, refuse_non_finite
from . import ldm_config
from .families import detect_family, family_defaults, scheduler_overrides
from .tokenizers import OPENCLIP_PAD, find_tokenizer_dir, load_clip_tokenizer

logger = logging.getLogger(__name__)


def read_header(path: Path, arg: str = "model") -> dict[str, tuple]:
    """Tensor names -> shapes from the safetensors header; ``ValueError`` naming the input ``arg`` for truncated or
    non-safetensors files."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{arg}={path.name!r}: {path} is not a file")
    size = path.stat().st_size
    try:
        with safe_open(str(path), framework="pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as exc:  # safetensors raises its own SafetensorError (and OSError); both mean "unreadable"
        raise ValueError(f"{arg}={path.name!r} ({size} bytes) is truncated or not a safetensors checkpoint: {exc}. "
                         f"Re-download or re-save the file") from exc
    return shapes


# Old SD1 files (saved with transformers < 4.?, e.g. many early SD1.x merges) name CLIP-L without the
# ``text_model.`` level: ``cond_stage_model.transformer.embeddings...``. ComfyUI's ``SD15.process_clip_state_dict``
# renames them; so does this loader, before detection.
_OLD_CLIP = "cond_stage_model.transformer."
_NEW_CLIP = "cond_stage_model.transformer.text_model."


def canonical_name(key: str) -> str:
    """The name the converters expect for a tensor stored under ``key`` (see ``_OLD_CLIP``)."""
    if key.startswith(_OLD_CLIP) and not key.startswith(_NEW_CLIP):
        return _NEW_CLIP + key[len(_OLD_CLIP):]
    return key


def read_tensors(path: Path, arg: str = "model") -> dict[str, torch.Tensor]:
    """Every tensor of the file, under :func:`canonical_name` names (errors name the input ``arg``)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {canonical_name(k): f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # a file can pass the header check and still fail mid-read (truncated data)
        raise ValueError(f"{arg}={Path(path).name!r} could not be read completely ({exc}); the file is truncated or "
                         f"damaged") from exc


def build_module(factory: Callable[[], torch.nn.Module], state_dict: dict, what: str,
                 finish: Optional[Callable[[torch.nn.Module], None]] = None) -> torch.nn.Module:
    """``factory()`` on the meta device, then ``load_state_dict(strict=True, assign=True)`` from ``state_dict``;
    ``finish(module)`` then gives values to non-persistent buffers no file holds (a rotary embedding's frequencies)."""
    with torch.device("meta"):
        module = factory()
    try:
        module.load_state_dict(state_dict, strict=True, assign=True)
    except RuntimeError as exc:
        raise ValueError(f"{what}: the checkpoint's tensors do not fit the inferred architecture ({exc}); the file is "
                         f"incomplete or not a standard checkpoint of its kind: re-download it") from exc
    if finish is not None:
        finish(module)
    for name, buf in list(module.named_buffers()):
        if buf.is_meta:  # non-persistent buffers are not in any state dict; CLIP's position ids are the only ones
            if not name.endswith("position_ids"):
                raise ValueError(f"{what}: buffer {name} has no value in the checkpoint")
            owner = module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
            owner.register_buffer(name.rsplit(".", 1)[-1], torch.arange(buf.shape[-1]).expand(1, -1), persistent=False)
    return module.eval().requires_grad_(False)


def fit_clip_keys(model: torch.nn.Module, state_dict: dict) -> dict:
    """Add or strip the ``text_model.`` prefix to match this transformers version; drop stray ``position_ids``."""
    wrapped = hasattr(model, "text_model")
    out = {}
    for key, value in state_dict.items():
        if key.endswith("position_ids"):
            continue
        if wrapped and not key.startswith("text_model.") and not key.startswith("text_projection"):
            key = "text_model." + key
        elif not wrapped and key.startswith("text_model."):
            key = key[len("text_model."):]
        out[key] = value
    return out


def _clip_l(tensors: dict, shapes: dict, prefix: str):
    from diffusers.loaders.single_file_utils import convert_ldm_clip_checkpoint
    from transformers import CLIPTextConfig, CLIPTextModel

    config = CLIPTextConfig(**ldm_config.clip_l_config(shapes, prefix))
    sub = {k: v for k, v in tensors.items() if k.startswith(prefix)}
    with torch.device("meta"):
        probe = CLIPTextModel(config)
    sd = fit_clip_keys(probe, convert_ldm_clip_checkpoint(sub))
    return build_module(lambda: CLIPTextModel(config), sd, f"text encoder ({prefix}*)")


def _open_clip(tensors: dict, shapes: dict, prefix: str, with_projection: bool, drop_last: bool):
    from diffusers.loaders.single_file_utils import convert_open_clip_checkpoint
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    cfg = ldm_config.open_clip_config(shapes, prefix, drop_last=drop_last)
    config = CLIPTextConfig(**cfg)
    cls = CLIPTextModelWithProjection if with_projection else CLIPTextModel
    with torch.device("meta"):
        probe = cls(config)
    sub = {k: v for k, v in tensors.items() if k.startswith(prefix)}
    converted = convert_open_clip_checkpoint(probe, sub, prefix=prefix)
    n = cfg["num_hidden_layers"]
    layer = re.compile(r"(?:text_model\.)?encoder\.layers\.(\d+)\.")
    kept = {}
    for key, value in converted.items():
        m = layer.match(key)
        if m and int(m.group(1)) >= n:
            continue  # SD2's last OpenCLIP block: SD2 conditions on the penultimate layer
        if key.startswith("text_projection") and not with_projection:
            continue
        kept[key] = value
    return build_module(lambda: cls(config), fit_clip_keys(probe, kept), f"text encoder ({prefix}*)")


def convert_checkpoint(tensors: dict, shapes: dict, family: str) -> dict:
    """diffusers/transformers modules (no tokenizers) for an already-detected ``family`` (sd1, sd2, sdxl)."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint, convert_ldm_vae_checkpoint

    ucfg = ldm_config.unet_config(shapes, family)
    unet = build_module(lambda: UNet2DConditionModel(**ucfg), convert_ldm_unet_checkpoint(tensors, ucfg), "UNet")
    vcfg = ldm_config.vae_config(shapes, family)
    vae = build_module(lambda: AutoencoderKL(**vcfg), convert_ldm_vae_checkpoint(tensors, vcfg), "VAE")
    out = {"unet": unet, "vae": vae}
    if family == "sd1":
        out["text_encoder"] = _clip_l(tensors, shapes, "cond_stage_model.transformer.")
    elif family == "sd2":
        out["text_encoder"] = _open_clip(tensors, shapes, "cond_stage_model.model.", False, drop_last=True)
    else:
        out["text_encoder"] = _clip_l(tensors, shapes, "conditioner.embedders.0.transformer.")
        out["text_encoder_2"] = _open_clip(tensors, shapes, "conditioner.embedders.1.model.", True, drop_last=False)
    return out


def load_ldm_checkpoint(path: Path) -> dict:
    """Read, detect, convert: a components dict (as ``memory.tiny.build_tiny_components`` returns) for ``path``."""
    path = Path(path)
    source = f"model={path.name!r}"
    shapes = {canonical_name(k): v for k, v in read_header(path).items()}
    family = detect_family(shapes, source=source).name
    tok_dir = find_tokenizer_dir(path)  # fail on a missing or damaged tokenizer before the expensive conversion
    tokenizers = {"tokenizer": load_clip_tokenizer(tok_dir, pad_token=OPENCLIP_PAD if family == "sd2" else None)}
    if family == "sdxl":
        tokenizers["tokenizer_2"] = load_clip_tokenizer(tok_dir, pad_token=OPENCLIP_PAD)
    tensors = read_tensors(path)
    engine_family, overrides = scheduler_overrides(family, shapes, path, read=tensors.__getitem__)
    try:
        components = convert_checkpoint(tensors, shapes, family)
    except ValueError as exc:  # name the file: the converters only know tensor names
        raise ValueError(f"{source} (detected as {family}): {exc}") from exc
    for part, module in components.items():
        own_file_backed(module)  # the file's tensors are views of its mapping: the modules get their own copy
        refuse_non_finite(module.state_dict(), f"{source} ({part})", "every image black or into noise",
                          "re-download the checkpoint")
    del tensors
    components["family"] = engine_family
    components["scheduler_config"] = {**family_defaults(engine_family)["scheduler"], **overrides}
    components.update(tokenizers)
    logger.info("loaded %s as %s%s", path.name, engine_family, f" with {overrides}" if overrides else "")
    return components

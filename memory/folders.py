"""diffusers pipeline folders (``model_index.json`` + one sub-folder per component) -> modules, offline.

Invariant: components load with diffusers' / transformers' own ``from_pretrained(local_files_only=True)``, each
weight then in memory of its own, never a view of a file on disk (``torchfile.own_file_backed``); the
family comes from a declarative table of pipeline classes plus the UNet config (SD1 vs SD2 by the UNet's
projection style, the one architectural difference) and the scheduler's ``prediction_type``. Tokenizers: the
folder's own ``tokenizer``/``tokenizer_2``, else the single-file search order of ``memory/tokenizers.py``.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from ..torchfile import load_error_reason, own_file_backed, refuse_non_finite
from .families import UnsupportedFamilyError, family_defaults
from .tokenizers import OPENCLIP_PAD, find_tokenizer_dir, load_clip_tokenizer

logger = logging.getLogger(__name__)

# pipeline class -> "sd" (SD1 or SD2, told apart by the UNet), "sdxl", or a refused family's description.
PIPELINES = {
    "StableDiffusionPipeline": "sd", "StableDiffusionImg2ImgPipeline": "sd", "StableDiffusionXLPipeline": "sdxl",
    "StableDiffusionXLImg2ImgPipeline": "sdxl", "ZImagePipeline": "zimage", "ZImageImg2ImgPipeline": "zimage",
}
REFUSED = {
    "StableDiffusion3Pipeline": "sd3 (Stable Diffusion 3 / 3.5)", "FluxPipeline": "flux (Flux)",
    "StableDiffusionInpaintPipeline": "inpaint (inpainting UNet)",
    "StableDiffusionXLInpaintPipeline": "inpaint (SDXL inpainting UNet)",
    "StableDiffusionUpscalePipeline": "sd-upscale (x4 upscaler)", "PixArtAlphaPipeline": "pixart (PixArt)",
    "StableCascadePriorPipeline": "stable-cascade", "KandinskyV22Pipeline": "kandinsky",
}


def is_diffusers_folder(path: Path) -> bool:
    return Path(path).is_dir() and (Path(path) / "model_index.json").is_file()


def load_diffusers_folder(folder: Path) -> dict:
    """A components dict (as ``memory.tiny.build_tiny_components`` returns) from a diffusers pipeline folder."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    folder = Path(folder)
    if not is_diffusers_folder(folder):
        raise ValueError(f"model={folder.name!r}: {folder} has no model_index.json, so it is not a diffusers folder")
    try:
        index = json.loads((folder / "model_index.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise ValueError(f"model={folder.name!r}: its model_index.json is not readable JSON "
                         f"({load_error_reason(exc)}); re-download or re-save the folder") from exc
    if not isinstance(index, dict):
        raise ValueError(f"model={folder.name!r}: its model_index.json holds {type(index).__name__}, not the "
                         f"pipeline's component table; re-download or re-save the folder")
    cls = index.get("_class_name", "")
    if cls in REFUSED:
        raise UnsupportedFamilyError(f"model={folder.name!r}: detected family '{REFUSED[cls]}' ({cls}), which "
                                     f"LeanDiffusion does not run; supported families are SD1.x, SD2.x and SDXL base")
    kind = PIPELINES.get(cls)
    if kind is None:
        raise UnsupportedFamilyError(f"model={folder.name!r}: pipeline class {cls!r} is not an SD1.x/SD2.x/SDXL "
                                     f"or Z-Image text-to-image pipeline")
    if kind == "zimage":
        return load_zimage_folder(folder)
    for part in ("unet", "vae", "text_encoder") + (("text_encoder_2",) if kind == "sdxl" else ()):
        if not (folder / part).is_dir():
            what = "an SDXL refiner (no first text encoder)" if part == "text_encoder" and kind == "sdxl" else "incomplete"
            raise UnsupportedFamilyError(f"model={folder.name!r}: the folder has no '{part}' sub-folder ({what})")
    kw = dict(local_files_only=True)
    unet = _component(folder, "unet", UNet2DConditionModel, kw)
    if unet.config.in_channels != 4:
        raise UnsupportedFamilyError(f"model={folder.name!r}: UNet with {unet.config.in_channels} input channels "
                                     f"(inpainting/upscaler/pix2pix family) is not supported")
    components = {"unet": unet, "vae": _component(folder, "vae", AutoencoderKL, kw)}
    if kind == "sdxl":
        components["text_encoder"] = _component(folder, "text_encoder", CLIPTextModel, kw)
        components["text_encoder_2"] = _component(folder, "text_encoder_2", CLIPTextModelWithProjection, kw)
        family = "sdxl"
    else:
        components["text_encoder"] = _component(folder, "text_encoder", CLIPTextModel, kw)
        family = "sd2" if unet.config.use_linear_projection else "sd1"
    family, components["scheduler_config"] = _scheduler_config(folder, family)
    components["family"] = family
    for module in ("unet", "vae", "text_encoder", "text_encoder_2"):
        if module in components:
            components[module].eval().requires_grad_(False)
    openclip_first = family in ("sd2", "sd2-v")
    components["tokenizer"] = _tokenizer(folder, "tokenizer", OPENCLIP_PAD if openclip_first else None)
    if kind == "sdxl":
        components["tokenizer_2"] = _tokenizer(folder, "tokenizer_2", OPENCLIP_PAD)
    return components


def load_zimage_folder(folder: Path) -> dict:
    """A Z-Image components dict (``transformer``, Qwen3 ``text_encoder``, ``tokenizer``, 16-channel ``vae``,
    ``scheduler_config``) from a ``ZImagePipeline`` folder, as ``memory.tiny_zimage.build_tiny_zimage`` returns."""
    from diffusers import AutoencoderKL, ZImageTransformer2DModel
    from transformers import AutoTokenizer, Qwen3Model

    for part in ("transformer", "vae", "text_encoder", "tokenizer"):
        if not (folder / part).is_dir():
            raise UnsupportedFamilyError(f"model={folder.name!r}: the Z-Image folder has no '{part}' sub-folder "
                                         f"(incomplete download); re-download the whole folder")
    kw = dict(local_files_only=True)
    components = {"family": "zimage", "transformer": _component(folder, "transformer", ZImageTransformer2DModel, kw),
                  "text_encoder": _component(folder, "text_encoder", Qwen3Model, kw),
                  "vae": _component(folder, "vae", AutoencoderKL, kw)}
    try:
        components["tokenizer"] = AutoTokenizer.from_pretrained(str(folder / "tokenizer"), **kw)
    except (OSError, ValueError) as exc:
        raise ValueError(f"model={folder.name!r}: the 'tokenizer' sub-folder could not be loaded "
                         f"({load_error_reason(exc)}); re-download the folder") from exc
    _, components["scheduler_config"] = _scheduler_config(folder, "zimage")
    for module in ("transformer", "text_encoder", "vae"):
        components[module].eval().requires_grad_(False)
    return components


def _scheduler_config(folder: Path, family: str) -> tuple[str, dict]:
    """(family, scheduler config): SD2 whose scheduler predicts ``v_prediction`` is ``sd2-v``; the config is the
    family's defaults overridden by every key of the folder's own (as diffusers' ``DDIMScheduler.from_pretrained``
    takes them: rescale_betas_zero_snr, trained_betas, thresholding ...)."""
    sched_file = folder / "scheduler" / "scheduler_config.json"
    try:
        scheduler = json.loads(sched_file.read_text()) if sched_file.is_file() else {}
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"model={folder.name!r}: scheduler/scheduler_config.json is not readable JSON "
                         f"({load_error_reason(exc)}); re-download or re-save the folder") from exc
    if family == "sd2" and scheduler.get("prediction_type") == "v_prediction":
        family = "sd2-v"
    config = dict(family_defaults(family)["scheduler"])
    config.update({k: v for k, v in scheduler.items() if not k.startswith("_")})
    return family, config


def _component(folder: Path, part: str, cls, kw: dict):
    """``cls.from_pretrained(folder / part)``; a missing, truncated or garbled file is one ``ValueError`` naming the
    input, the sub-folder and the fix (diffusers/transformers raise their own types, some without the file's name:
    a truncated safetensors file gives a bare ``SafetensorError: invalid header length``)."""
    from safetensors import SafetensorError

    try:
        module = cls.from_pretrained(str(folder / part), **kw)
    except (OSError, ValueError, RuntimeError, KeyError, SafetensorError) as exc:
        raise ValueError(f"model={folder.name!r}: the '{part}' sub-folder could not be loaded "
                         f"({load_error_reason(exc)}); re-download or re-save the folder") from exc
    own_file_backed(module)  # from_pretrained keeps weights as views of the mapped files where no cast is needed
    if isinstance(module, torch.nn.Module):
        refuse_non_finite(module.state_dict(), f"model={folder.name!r} ({part})", "every image black or into noise",
                          "re-download or re-save the folder")
    return module


def _tokenizer(folder: Path, sub: str, fallback_pad):
    own = folder / sub
    if (own / "vocab.json").is_file() or (own / "tokenizer.json").is_file():
        return load_clip_tokenizer(own)  # the folder's own settings (pad token included) win
    return load_clip_tokenizer(find_tokenizer_dir(folder), pad_token=fallback_pad)

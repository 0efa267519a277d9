"""diffusers pipeline folders (``model_index.json`` + one sub-folder per component) -> modules, offline.

Invariant: components load with diffusers' / transformers' own ``from_pretrained(local_files_only=True)``, each
weight then in memory of its own, never a view of a file on disk (``torchfile.own_file_backed``); the
family comes from a declarative table of pipeline classes (``model_index.json``'s ``_class_name``, never the
folder's name) plus the UNet config (SD1 vs SD2 by the UNet's projection style, the one architectural difference)
and the scheduler's ``prediction_type``. Tokenizers: the folder's own ``tokenizer``/``tokenizer_2``, else the
single-file search order of ``memory/tokenizers.py``; a DiT folder (Z-Image, Qwen-Image) must carry its own.
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
    "QwenImagePipeline": "qwen_image", "QwenImageImg2ImgPipeline": "qwen_image",
    "QwenImageEditPipeline": "qwen_image_edit", "QwenImageEditPlusPipeline": "qwen_image_edit",
}
# pipeline class -> (family, model) this pack will run but does not yet (refused with "not supported yet").
NOT_YET: dict = {}
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
    if cls in NOT_YET:
        family, display = NOT_YET[cls]
        raise UnsupportedFamilyError(f"model={folder.name!r}: detected family '{family}' ({display}, {cls}), which "
                                     f"is not supported yet; Qwen-Image text-to-image folders (QwenImagePipeline) "
                                     f"load")
    kind = PIPELINES.get(cls)
    if kind is None:
        raise UnsupportedFamilyError(f"model={folder.name!r}: pipeline class {cls!r} is not an SD1.x/SD2.x/SDXL "
                                     f"or Z-Image text-to-image pipeline (nor Qwen-Image's QwenImagePipeline or "
                                     f"QwenImageEdit(Plus)Pipeline)")
    if kind in DIT_FOLDERS:
        return DIT_FOLDERS[kind](folder)
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
    from transformers import Qwen3Model

    return _dit_folder(folder, "zimage", "Z-Image", {"transformer": ZImageTransformer2DModel,
                                                     "text_encoder": Qwen3Model, "vae": AutoencoderKL})


def load_qwen_image_folder(folder: Path) -> dict:
    """A Qwen-Image components dict from a ``QwenImagePipeline`` folder: ``transformer``, ``vae``
    (``AutoencoderKLQwenImage``), ``tokenizer``, ``scheduler_config`` and as ``text_encoder`` the *language model*
    of the folder's ``Qwen2_5_VLForConditionalGeneration``: text-to-image reads only its last hidden state over
    text, so the vision tower and the LM head are dropped after loading (a decoder-only model, as Z-Image's)."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLForConditionalGeneration

    components = _dit_folder(folder, "qwen_image", "Qwen-Image",
                             {"transformer": QwenImageTransformer2DModel,
                              "text_encoder": Qwen2_5_VLForConditionalGeneration, "vae": AutoencoderKLQwenImage})
    model = components["text_encoder"].model
    components["text_encoder"] = getattr(model, "language_model", model)  # transformers < 4.52: the text model
    return components


def load_qwen_image_edit_folder(folder: Path) -> dict:
    """A Qwen-Image-Edit components dict from a ``QwenImageEditPipeline`` / ``QwenImageEditPlusPipeline`` folder:
    as :func:`load_qwen_image_folder`, but the text stage keeps the whole Qwen2.5-VL (``Qwen2_5_VLModel``: vision tower
    and language model; only the LM head is dropped), and ``image_processor`` is the ``processor/`` sub-folder's
    Qwen2-VL image processor (the processor's tokenizer is the folder's ``tokenizer``)."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessor

    if not (folder / "processor" / "preprocessor_config.json").is_file():
        raise UnsupportedFamilyError(f"model={folder.name!r}: the Qwen-Image-Edit folder has no 'processor' sub-folder "
                                     f"with a preprocessor_config.json (incomplete download); re-download the whole "
                                     f"folder")
    components = _dit_folder(folder, "qwen_image_edit", "Qwen-Image-Edit",
                             {"transformer": QwenImageTransformer2DModel,
                              "text_encoder": Qwen2_5_VLForConditionalGeneration, "vae": AutoencoderKLQwenImage})
    components["text_encoder"] = components["text_encoder"].model
    try:
        components["image_processor"] = Qwen2VLImageProcessor.from_pretrained(str(folder / "processor"),
                                                                               local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"model={folder.name!r}: the 'processor' sub-folder could not be loaded "
                         f"({load_error_reason(exc)}); re-download the folder") from exc
    return components


DIT_FOLDERS = {"zimage": load_zimage_folder, "qwen_image": load_qwen_image_folder,
               "qwen_image_edit": load_qwen_image_edit_folder}


def _dit_folder(folder: Path, family: str, display: str, classes: dict) -> dict:
    """``family``'s components from a DiT pipeline folder: each module of ``classes`` (sub-folder -> class), the
    ``tokenizer`` (``AutoTokenizer``) and the scheduler config; a missing sub-folder is refused first."""
    from transformers import AutoTokenizer

    for part in (*classes, "tokenizer"):
        if not (folder / part).is_dir():
            raise UnsupportedFamilyError(f"model={folder.name!r}: the {display} folder has no '{part}' sub-folder "
                                         f"(incomplete download); re-download the whole folder")
    kw = dict(local_files_only=True)
    components = {"family": family, **{part: _component(folder, part, cls, kw) for part, cls in classes.items()}}
    try:
        components["tokenizer"] = AutoTokenizer.from_pretrained(str(folder / "tokenizer"), **kw)
    except (OSError, ValueError) as exc:
        raise ValueError(f"model={folder.name!r}: the 'tokenizer' sub-folder could not be loaded "
                         f"({load_error_reason(exc)}); re-download the folder") from exc
    _, components["scheduler_config"] = _scheduler_config(folder, family)
    for part in classes:
        components[part].eval().requires_grad_(False)
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

"""ComfyUI's split layout of Z-Image or Qwen-Image (a diffusion model, a text encoder and a VAE file) -> an engine.

Pipeline: resolve the three names -> read the three safetensors headers -> detect each file's part, model and key
layout (``memory/zimage_layouts.py``, ``memory/qwen_image_layouts.py``), take the family the files agree on (the
diffusion model's, unless the other two agree on another: then the diffusion model is the odd one) and check that
the files fit each other -> find the Qwen tokenizer (``memory/qwen_tokenizer.py``) -> only then read tensors, file
by file: upcast fp8 (``memory/fp8_upcast.py``), convert to diffusers' layout with diffusers' own converters
(Z-Image: ``convert_z_image_transformer_checkpoint_to_diffusers``, ``convert_ldm_vae_checkpoint``; Qwen-Image:
``convert_wan_vae_to_diffusers``; the DiTs otherwise only lose ComfyUI's prefix, the Qwen3 / Qwen2.5-VL files
their ``model.`` prefix and ``lm_head``, the Qwen2.5-VL file keeps its vision tower when it has one, for
Qwen-Image-Edit, with Qwen2-VL's image processor built in code: ``memory/qwen_vision.py``), infer the config from shapes (``memory/zimage_configs.py``,
``memory/qwen_image_layouts.py``) and load strictly into meta-built modules.

Invariants
- Every input is checked (names, what each file holds, that they fit together, the tokenizer) before any tensor
  is read; a bad one raises ``ValueError`` naming the input, what was found and the fix.
- The result is the components dict ``load_zimage_folder`` returns, with each weight in memory of its own (never a
  view of a file) and finite; modules are loaded strictly, so no weight is ever left at random.
- A failed load leaves nothing behind: modules exist only inside this call until all three are built.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import bridge
from ..torchfile import own_file_backed, refuse_non_finite
from .engine import LeanEngine
from .families import family_defaults
from .fp8_upcast import upcast_fp8
from .keyrules import shapes_of
from .ldm import build_module, read_header, read_tensors
from .load import load_engine_from
from .qwen_tokenizer import find_qwen_tokenizer_dir, load_qwen_tokenizer
from .qwen_vision import edit_image_processor, vision_patching
from .zimage_configs import qwen3_config, transformer_config, vae_config
from . import qwen_image_layouts as qwen_layouts
from . import zimage_layouts
from .keyrules import first_match
from .zimage_layouts import DIT_PREFIX, INPUTS, TEXT_PREFIX, WHERE, Layout

logger = logging.getLogger(__name__)

# part -> the model folder its input lists (ComfyUI's names; the older ``unet`` / ``clip`` are searched too)
FOLDERS = {"transformer": "diffusion_models", "text_encoder": "text_encoders", "vae": "vae"}
EXTENSIONS = (".safetensors",)
REGISTRY = qwen_layouts.ROWS + zimage_layouts.REGISTRY  # first match wins; the rows of the two never overlap
MODELS = {"zimage": "Z-Image", "qwen_image": qwen_layouts.MODEL}
WANTED = {"zimage": zimage_layouts.WANTED, "qwen_image": qwen_layouts.WANTED}
ROLES = ("transformer", "text_encoder", "vae")
VISION_MARKERS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")  # Qwen2-VL's, in its vocabulary


@dataclass(frozen=True)
class SplitFile:
    role: str
    name: str
    path: Path
    shapes: dict
    layout: Layout

    @property
    def arg(self) -> str:
        return f"{INPUTS[self.role]}={self.name!r}"


def split_choices(role: str) -> list[str]:
    """The COMBO of the input for ``role``: the ``.safetensors`` files of its model folder(s)."""
    return bridge.list_models(FOLDERS[role], EXTENSIONS)


def _fix(family: str, role: str) -> str:
    return zimage_layouts._fix(role, WANTED[family])


def _agreed_family(rows: dict) -> str:
    """The diffusion model's family when another input agrees, else the family the other two agree on (the
    diffusion model is then the odd input), else the diffusion model's (Z-Image when nothing is known)."""
    fam = {role: row.family for role, row in rows.items() if row is not None and row.role == role and row.supported}
    dit = fam.get("transformer")
    if dit and dit in (fam.get("text_encoder"), fam.get("vae")):
        return dit
    if fam.get("text_encoder") and fam.get("text_encoder") == fam.get("vae"):
        return fam["text_encoder"]
    return dit or fam.get("text_encoder") or fam.get("vae") or "zimage"


def detect_layouts(shapes: dict, names: dict) -> tuple[str, dict]:
    """(family, role -> registry row) for the three headers; ``ValueError`` naming the input, what its file holds
    and the fix when a file is unknown, another part, a refused model or a part of the other family."""
    rows = {role: first_match(REGISTRY, shapes[role]) for role in ROLES}
    family = _agreed_family(rows)
    for role, row in rows.items():
        arg = f"{INPUTS[role]}={names[role]!r}"
        if row is None:
            keys = ", ".join(list(shapes[role])[:3]) or "no tensors"
            raise ValueError(f"{arg}: not a known Z-Image or Qwen-Image part (first keys: {keys}); "
                             f"{_fix(family, role)}")
        if row.role != role:
            raise ValueError(f"{arg}: this file holds a {row.display}, which belongs in the '{INPUTS[row.role]}' "
                             f"input (folder {WHERE[row.role]}), not here; {_fix(family, role)}")
        if not row.supported or row.family != family:
            raise ValueError(f"{arg}: detected a {row.display}, which {MODELS[family]} does not use; "
                             f"{_fix(family, role)}")
    return family, rows


def inspect_split_files(diffusion_model: str, text_encoder: str, vae: str) -> tuple[str, dict[str, SplitFile]]:
    """Resolve the three names, read their headers, detect each file's layout and the family they agree on;
    ``ValueError`` for a name that does not resolve, a file that is another part or model, or files that do not
    fit each other."""
    names = {"transformer": diffusion_model, "text_encoder": text_encoder, "vae": vae}
    paths = {role: bridge.resolve_model(folder, names[role], INPUTS[role]) for role, folder in FOLDERS.items()}
    shapes = {role: read_header(path, INPUTS[role]) for role, path in paths.items()}
    family, rows = detect_layouts(shapes, names)
    files = {role: SplitFile(role, names[role], paths[role], shapes[role], rows[role]) for role in ROLES}
    args = {INPUTS[role]: name for role, name in names.items()}
    if family == "qwen_image":
        qwen_layouts.check_together(shapes["transformer"], shapes["text_encoder"], shapes["vae"], args,
                                    lambda role: _fix(family, role))
    else:
        zimage_layouts.check_together(shapes["transformer"], shapes["text_encoder"], shapes["vae"], args)
    return family, files


def _strip(tensors: dict, prefix: str) -> dict:
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in tensors.items()}


def _transformer(tensors: dict, file: SplitFile) -> torch.nn.Module:
    from diffusers import ZImageTransformer2DModel
    from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers

    if file.layout.name == "original":  # fused qkv, out, q_norm/k_norm, x_embedder/final_layer; drops norm_final
        sd = convert_z_image_transformer_checkpoint_to_diffusers(dict(tensors))
    else:
        sd = _strip(tensors, DIT_PREFIX)
    config = transformer_config(shapes_of(sd), file.arg)
    return build_module(lambda: ZImageTransformer2DModel(**config), sd, f"{file.arg} (Z-Image DiT)")


def _text_encoder(tensors: dict, file: SplitFile) -> torch.nn.Module:
    from transformers import Qwen3Model
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    sd = {k: v for k, v in _strip(tensors, TEXT_PREFIX).items() if not k.startswith("lm_head.")}
    config = qwen3_config(shapes_of(sd), file.arg)

    def rotary(model):  # the rotary frequencies are non-persistent buffers: no file holds them
        model.rotary_emb = Qwen3RotaryEmbedding(config=config)

    return build_module(lambda: Qwen3Model(config), sd, f"{file.arg} (Qwen3)", finish=rotary)


def _vae(tensors: dict, file: SplitFile) -> torch.nn.Module:
    from diffusers import AutoencoderKL
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    sd = dict(tensors)
    if file.layout.name == "original":
        levels = len({k.split(".")[2] for k in sd if k.startswith("encoder.down.")})
        sd = convert_ldm_vae_checkpoint(sd, {"down_block_types": (None,) * levels, "up_block_types": (None,) * levels})
    config = vae_config(shapes_of(sd), file.arg)
    return build_module(lambda: AutoencoderKL(**config), sd, f"{file.arg} (VAE)")


def _qwen_transformer(tensors: dict, file: SplitFile) -> torch.nn.Module:
    from diffusers import QwenImageTransformer2DModel

    sd = _strip(tensors, DIT_PREFIX)  # ComfyUI's names are diffusers' (diffusers' own single-file map is identity)
    config = qwen_layouts.transformer_config(shapes_of(sd), file.arg)

    def rope(model):  # the RoPE tables are plain attributes computed at construction: rebuild them off the meta device
        with torch.device("cpu"):
            model.pos_embed = type(model.pos_embed)(theta=model.pos_embed.theta, axes_dim=model.pos_embed.axes_dim,
                                                    scale_rope=model.pos_embed.scale_rope)

    return build_module(lambda: QwenImageTransformer2DModel(**config), sd, f"{file.arg} (Qwen-Image DiT)",
                        finish=rope)


def _qwen_text_encoder(tensors: dict, file: SplitFile, tokenizer=None) -> torch.nn.Module:
    """Qwen2.5-VL without its LM head. Without ``visual.*`` tensors (or ``tokenizer``): the language model alone (what
    ``load_qwen_image_folder`` keeps; text-to-image reads only its last hidden state). With them: the whole
    ``Qwen2_5_VLModel`` (vision tower + language model, what ``load_qwen_image_edit_folder`` keeps), its vision
    markers' ids from ``tokenizer``, so the model can edit images."""
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (Qwen2_5_VLModel, Qwen2_5_VLRotaryEmbedding,
                                                                    Qwen2_5_VLTextModel,
                                                                    Qwen2_5_VLVisionRotaryEmbedding)

    stripped = {k: v for k, v in _strip(tensors, TEXT_PREFIX).items() if not k.startswith("lm_head.")}
    sd = {k: v for k, v in stripped.items() if not k.startswith(("visual.", "model.visual."))}
    config = qwen_layouts.text_config(shapes_of(sd), file.arg)
    if tokenizer is None or not any(k.startswith("visual.") for k in stripped):
        def rotary(model):  # the rotary frequencies are non-persistent buffers: no file holds them
            model.rotary_emb = Qwen2_5_VLRotaryEmbedding(config=config)

        return build_module(lambda: Qwen2_5_VLTextModel(config), sd, f"{file.arg} (Qwen2.5-VL)", finish=rotary)
    marks = dict(zip(("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"),
                     tokenizer.convert_tokens_to_ids(list(VISION_MARKERS))))
    full = Qwen2_5_VLConfig(text_config=config.to_dict(), tie_word_embeddings=False, **marks,
                            vision_config=qwen_layouts.vision_config(shapes_of(stripped), file.arg))
    sd = {**{"language_model." + k: v for k, v in sd.items()},
          **{k: v for k, v in stripped.items() if k.startswith("visual.")}}

    def rotaries(model):  # the rotary frequencies of both towers are non-persistent buffers: no file holds them
        with torch.device("cpu"):
            model.language_model.rotary_emb = Qwen2_5_VLRotaryEmbedding(config=model.config.text_config)
            model.visual.rotary_pos_emb = Qwen2_5_VLVisionRotaryEmbedding(model.config.vision_config)

    return build_module(lambda: Qwen2_5_VLModel(full), sd, f"{file.arg} (Qwen2.5-VL with vision tower)",
                        finish=rotaries)


def _qwen_vae(tensors: dict, file: SplitFile) -> torch.nn.Module:
    from diffusers import AutoencoderKLQwenImage
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    sd = convert_wan_vae_to_diffusers(dict(tensors)) if file.layout.name == "wan" else dict(tensors)
    config = qwen_layouts.vae_config(shapes_of(sd), file.arg)
    return build_module(lambda: AutoencoderKLQwenImage(**config), sd, f"{file.arg} (Qwen-Image VAE)")


BUILDERS = {"zimage": {"transformer": _transformer, "text_encoder": _text_encoder, "vae": _vae},
            "qwen_image": {"transformer": _qwen_transformer, "text_encoder": _qwen_text_encoder, "vae": _qwen_vae}}


def load_part(file: SplitFile, tokenizer=None) -> torch.nn.Module:
    """One file -> its module on the CPU (eval, no gradients), fp8 upcast, every weight its own memory; a Qwen2.5-VL
    file is told the ``tokenizer`` (its vision markers' ids)."""
    tensors = upcast_fp8(read_tensors(file.path, INPUTS[file.role]), file.arg)
    build = BUILDERS[file.layout.family][file.role]
    module = build(tensors, file, tokenizer) if build is _qwen_text_encoder else build(tensors, file)
    del tensors
    own_file_backed(module)
    refuse_non_finite(module.state_dict(), file.arg, "every image black or into noise", "re-download the file")
    return module


def _check_tokenizer(tokenizer, text: SplitFile) -> None:
    vocab = text.shapes.get("embed_tokens.weight", text.shapes.get(TEXT_PREFIX + "embed_tokens.weight"))[0]
    if len(tokenizer) > vocab:
        raise ValueError(f"{text.arg}: its vocabulary has {vocab} entries but the Qwen tokenizer found has "
                         f"{len(tokenizer)}, so they do not belong together; "
                         f"{_fix(text.layout.family, 'text_encoder')}")


def load_split_components(diffusion_model: str, text_encoder: str, vae: str) -> dict:
    """The components dict (as ``memory.folders.load_zimage_folder`` / ``load_qwen_image_folder`` return) from three
    split files of Z-Image or Qwen-Image."""
    family, files = inspect_split_files(diffusion_model, text_encoder, vae)
    tokenizer = load_qwen_tokenizer(find_qwen_tokenizer_dir(family))
    _check_tokenizer(tokenizer, files["text_encoder"])
    modules = {role: load_part(file, tokenizer) for role, file in files.items()}
    logger.info("loaded %s split files: %s", MODELS[family],
                ", ".join(f"{f.arg} ({f.layout.display})" for f in files.values()))
    components = {"family": family, **modules, "tokenizer": tokenizer,
                  "scheduler_config": dict(family_defaults(family)["scheduler"])}
    if getattr(modules["text_encoder"], "visual", None) is not None:  # Qwen-Image-Edit can run it
        shapes = _strip(files["text_encoder"].shapes, TEXT_PREFIX)
        components["image_processor"] = edit_image_processor(**vision_patching(shapes))
    return components


def load_split_engine(diffusion_model: str, text_encoder: str, vae: str, vram_policy: str = "auto",
                      vram_budget_gb: float = 4.0, weight_dtype: str = "auto", vae_dtype: str = "auto",
                      device=None) -> LeanEngine:
    """The split loader node's whole job: three files -> an engine under the VRAM policy (three progress stages,
    Cancel between them, every input checked before a tensor is read; see ``memory.load.load_engine_from``)."""
    return load_engine_from(lambda: (load_split_components(diffusion_model, text_encoder, vae),
                                     Path(str(diffusion_model)).stem),
                            vram_policy, vram_budget_gb, weight_dtype, vae_dtype, device)

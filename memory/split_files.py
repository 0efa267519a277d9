"""ComfyUI's split layout of Z-Image (a diffusion model, a text encoder and a VAE file) -> an engine, offline.

Pipeline: resolve the three names -> read the three safetensors headers -> detect each file's part and key layout
(``memory/zimage_layouts.py``) and check that the files fit each other -> find the Qwen tokenizer
(``memory/qwen_tokenizer.py``) -> only then read tensors, file by file: upcast fp8 (``memory/fp8_upcast.py``),
convert to diffusers' layout with diffusers' own converters (``convert_z_image_transformer_checkpoint_to_diffusers``,
``convert_ldm_vae_checkpoint``; the Qwen3 file only loses its ``model.`` prefix and ``lm_head``), infer the config
from shapes (``memory/zimage_configs.py``) and load strictly into meta-built modules.

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
from .zimage_configs import qwen3_config, transformer_config, vae_config
from .zimage_layouts import DIT_PREFIX, INPUTS, TEXT_PREFIX, Layout, check_together, detect_layout

logger = logging.getLogger(__name__)

# part -> the model folder its input lists (ComfyUI's names; the older ``unet`` / ``clip`` are searched too)
FOLDERS = {"transformer": "diffusion_models", "text_encoder": "text_encoders", "vae": "vae"}
EXTENSIONS = (".safetensors",)


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


def inspect_split_files(diffusion_model: str, text_encoder: str, vae: str) -> dict[str, SplitFile]:
    """Resolve the three names, read their headers and detect each file's layout; ``ValueError`` for a name that
    does not resolve, a file that is another part or model, or files that do not fit each other."""
    names = {"transformer": diffusion_model, "text_encoder": text_encoder, "vae": vae}
    paths = {role: bridge.resolve_model(folder, names[role], INPUTS[role]) for role, folder in FOLDERS.items()}
    files = {}
    for role, path in paths.items():
        shapes = read_header(path, INPUTS[role])
        files[role] = SplitFile(role, names[role], path, shapes, detect_layout(shapes, role, names[role]))
    check_together(files["transformer"].shapes, files["text_encoder"].shapes, files["vae"].shapes,
                   {INPUTS[role]: name for role, name in names.items()})
    return files


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


BUILDERS = {"transformer": _transformer, "text_encoder": _text_encoder, "vae": _vae}


def load_part(file: SplitFile) -> torch.nn.Module:
    """One file -> its module on the CPU (eval, no gradients), fp8 upcast, every weight its own memory."""
    tensors = upcast_fp8(read_tensors(file.path, INPUTS[file.role]), file.arg)
    module = BUILDERS[file.role](tensors, file)
    del tensors
    own_file_backed(module)
    refuse_non_finite(module.state_dict(), file.arg, "every image black or into noise", "re-download the file")
    return module


def _check_tokenizer(tokenizer, text: SplitFile) -> None:
    vocab = text.shapes.get("embed_tokens.weight", text.shapes.get(TEXT_PREFIX + "embed_tokens.weight"))[0]
    if len(tokenizer) > vocab:
        raise ValueError(f"{text.arg}: its vocabulary has {vocab} entries but the Qwen tokenizer found has "
                         f"{len(tokenizer)}, so they do not belong together; pick the Qwen3-4B text encoder")


def load_split_components(diffusion_model: str, text_encoder: str, vae: str) -> dict:
    """The Z-Image components dict (as ``memory.folders.load_zimage_folder`` returns) from three split files."""
    files = inspect_split_files(diffusion_model, text_encoder, vae)
    tokenizer = load_qwen_tokenizer(find_qwen_tokenizer_dir())
    _check_tokenizer(tokenizer, files["text_encoder"])
    modules = {role: load_part(file) for role, file in files.items()}
    logger.info("loaded Z-Image split files: %s", ", ".join(f"{f.arg} ({f.layout.display})" for f in files.values()))
    return {"family": "zimage", **modules, "tokenizer": tokenizer,
            "scheduler_config": dict(family_defaults("zimage")["scheduler"])}


def load_split_engine(diffusion_model: str, text_encoder: str, vae: str, vram_policy: str = "auto",
                      vram_budget_gb: float = 4.0, weight_dtype: str = "auto", vae_dtype: str = "auto",
                      device=None) -> LeanEngine:
    """The split loader node's whole job: three files -> an engine under the VRAM policy (three progress stages,
    Cancel between them, every input checked before a tensor is read; see ``memory.load.load_engine_from``)."""
    return load_engine_from(lambda: (load_split_components(diffusion_model, text_encoder, vae),
                                     Path(str(diffusion_model)).stem),
                            vram_policy, vram_budget_gb, weight_dtype, vae_dtype, device)

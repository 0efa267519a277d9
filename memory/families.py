"""Checkpoint families, detected by a declarative registry of key and shape conditions (``keyrules``).

Invariant: a family is decided from tensor *names and shapes only* (the safetensors header), never from class
names, file names or tensor values, except for the one thing SD2 checkpoints do not record, SD2's prediction type
(see :func:`sd2_prediction_type`). Rules are checked in order; the first whose conditions all hold wins.
Unsupported families (SD3, Flux, the SDXL refiner, inpainting UNets, Playground v2.5, ...) have rules too, so the
error names them. The prediction type and noise schedule of a supported file come from the marker tensors ComfyUI
writes and reads (``v_pred``, ``ztsnr``), see :func:`scheduler_overrides`.

Detection of a supported family only says which converter to use; the converter then infers every size from
shapes (``memory/ldm_config.py``), so a checkpoint that matches a rule but has a different layout still fails
loudly at load time, never silently.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from .keyrules import AllOf, AnyOf, Has, Lacks, Shapes, all_of, any_of, first_match

if TYPE_CHECKING:
    import torch

UNET = "model.diffusion_model."
UNET_IN = UNET + "input_blocks.0.0.weight"
CLIP_L_SD1 = "cond_stage_model.transformer.text_model.embeddings.token_embedding.weight"
OPENCLIP_SD2 = "cond_stage_model.model.token_embedding.weight"
CLIP_L_SDXL = "conditioner.embedders.0.transformer.text_model.embeddings.token_embedding.weight"
OPENCLIP_SDXL = "conditioner.embedders.1.model.token_embedding.weight"
VAE_IN = "first_stage_model.encoder.conv_in.weight"


@dataclass(frozen=True)
class Family:
    """One registry row: ``name`` is what the engine stores (``sd1``, ``sd2``, ``sdxl``) or the refused family."""

    name: str
    display: str
    supported: bool
    rule: AllOf


def _both(key: str) -> AnyOf:
    """A key that appears with or without ComfyUI's ``model.diffusion_model.`` prefix."""
    return any_of(key, UNET + key)


def _unet_in(channels: int) -> Has:
    """The UNet's first convolution takes ``channels`` input channels."""
    return Has(UNET_IN, ndim=4, axis=1, size=channels)


REGISTRY: tuple[Family, ...] = (
    # Refused families first: their keys can coexist with SD-like keys (an SD3 file has a VAE, say).
    Family("sd3", "Stable Diffusion 3 / 3.5 (MMDiT)", False,
           all_of(_both("joint_blocks.0.context_block.adaLN_modulation.1.bias"))),
    Family("flux", "Flux (double/single-stream DiT)", False,
           all_of(_both("double_blocks.0.img_attn.norm.key_norm.scale"))),
    Family("sdxl-refiner", "SDXL refiner (OpenCLIP-G only, no CLIP-L)", False,
           all_of("conditioner.embedders.0.model.text_projection")),
    Family("inpaint", "inpainting UNet (9 input channels)", False, all_of(_unet_in(9))),
    Family("instruct-pix2pix", "InstructPix2Pix UNet (8 input channels)", False, all_of(_unet_in(8))),
    Family("sd-upscale", "Stable Diffusion x4 upscaler (7 input channels)", False, all_of(_unet_in(7))),
    Family("stable-cascade", "Stable Cascade", False,
           all_of(any_of("clip_txt_mapper.weight", "down_blocks.1.0.channelwise.0.weight"))),
    # SDXL-architecture files that sample on a different schedule (ComfyUI's ``SDXL.model_type`` keys): loading them
    # as SDXL base would run them on the DDPM epsilon schedule and give noise, so they are refused by name.
    Family("playground-v2.5", "Playground v2.5 (SDXL UNet with EDM sampling and its own latent scaling)", False,
           all_of("edm_mean", "edm_std")),
    Family("sdxl-edm-v", "EDM v-prediction SDXL (CosXL and similar; 'edm_vpred.sigma_max' key)", False,
           all_of("edm_vpred.sigma_max")),
    Family("controlnet", "ControlNet (not a full checkpoint)", False,
           all_of(any_of("control_model.time_embed.0.weight", "controlnet_cond_embedding.conv_in.weight"))),
    # Supported families.
    Family("sdxl", "SDXL base", True, all_of(_unet_in(4), UNET + "label_emb.0.0.weight", CLIP_L_SDXL, OPENCLIP_SDXL,
                                             VAE_IN)),
    Family("sd2", "Stable Diffusion 2.x", True, all_of(_unet_in(4), OPENCLIP_SD2, VAE_IN,
                                                       Lacks(UNET + "label_emb.0.0.weight"))),
    Family("sd1", "Stable Diffusion 1.x", True, all_of(_unet_in(4), CLIP_L_SD1, VAE_IN,
                                                      Lacks(UNET + "label_emb.0.0.weight"))),
)

SUPPORTED = tuple(f.name for f in REGISTRY if f.supported)


class UnsupportedFamilyError(ValueError):
    """The checkpoint belongs to a family this pack does not run (the message names it)."""


def detect_family(shapes: Shapes, source: str = "checkpoint") -> Family:
    """The first registry family whose conditions all hold; raises :class:`UnsupportedFamilyError` otherwise."""
    family = first_match(REGISTRY, shapes)
    if family is None:
        raise UnsupportedFamilyError(f"{source}: {_describe_unknown(shapes)}")
    if not family.supported:
        raise UnsupportedFamilyError(
            f"{source}: detected family '{family.name}' ({family.display}), which LeanDiffusion does not "
            f"run; supported families are SD1.x, SD2.x (epsilon and v) and SDXL base (epsilon and v)")
    return family


def _describe_unknown(shapes: Shapes) -> str:
    keys = list(shapes)
    if not keys:
        return "the file holds no tensors, so it is not a model checkpoint"
    if any("lora_" in k or ".lora." in k or k.endswith(".alpha") for k in keys[:2000]):
        return "this looks like a LoRA file, not a checkpoint; load a full checkpoint and apply the LoRA with the LoRA node"
    guess = _diffusers_guess(shapes)
    if guess:
        return (f"detected family '{guess}' (by diffusers' key table), which LeanDiffusion does not run; supported "
                f"families are SD1.x, SD2.x and SDXL base")
    has_unet = any(k.startswith(UNET) for k in keys)
    missing = []
    if not has_unet:
        missing.append("a UNet (model.diffusion_model.*)")
    if not any(k.startswith("first_stage_model.") for k in keys):
        missing.append("a VAE (first_stage_model.*)")
    if not any(k.startswith(("cond_stage_model.", "conditioner.")) for k in keys):
        missing.append("text encoders (cond_stage_model.* / conditioner.*)")
    if missing:
        return (f"not a complete SD1.x/SD2.x/SDXL checkpoint: it lacks {', '.join(missing)} "
                f"(first keys: {', '.join(keys[:3])}); use an all-in-one checkpoint or a diffusers folder")
    return f"unknown checkpoint family (first keys: {', '.join(keys[:3])}); supported: SD1.x, SD2.x, SDXL base"


class _ShapeOnly:
    def __init__(self, shape):
        self.shape = tuple(shape)


def _diffusers_guess(shapes: Shapes) -> Optional[str]:
    """diffusers' own model-type guess for a non-SD file, when it names something specific (else None)."""
    try:
        from diffusers.loaders.single_file_utils import infer_diffusers_model_type
    except ImportError:
        return None
    proxy = {k: _ShapeOnly(v) for k, v in shapes.items()}
    try:
        name = infer_diffusers_model_type(proxy)
    except (KeyError, IndexError, AttributeError, TypeError, ValueError):
        return None
    return None if name in ("v1", "v2", "xl_base") else name


# --------------------------------------------------------------------------------------------- prediction type
_V_NAME = re.compile(r"(^|[^0-9])768([^0-9]|$)|(^|[-_.\s])v([-_.\s]|$)|v[-_]?pred", re.IGNORECASE)
_PARAMETERIZATION = re.compile(r"^\s*parameterization:\s*[\"']?([A-Za-z_]+)[\"']?\s*(#.*)?$", re.MULTILINE)
# ComfyUI's SD2 v-prediction test (``comfy/supported_models.py`` ``SD20.model_type``): the population standard
# deviation of this LayerNorm bias is above 0.09 in the 768 v models and below it in the 512 epsilon models.
SD2_V_PROBE = UNET + "output_blocks.11.1.transformer_blocks.0.norm1.bias"
SD2_V_STD = 0.09


def sd2_prediction_type(shapes: Shapes, path: Optional[Path] = None,
                        read: Optional[Callable[[str], "torch.Tensor"]] = None) -> str:
    """SD2 checkpoints do not record epsilon vs v-prediction; decide by this documented rule, first hit wins.

    1. a ``v_pred`` tensor in the file (ComfyUI's convention when it saves a v-prediction model; the test kit too)
       -> ``v_prediction``;
    2. a sidecar ``<name>.yaml`` next to the file (the original ``v2-inference(-v).yaml`` convention A1111 uses):
       ``parameterization: "v"`` -> ``v_prediction``, any other or no ``parameterization`` -> ``epsilon`` (so the
       sidecar overrides every rule below, in both directions);
    3. ComfyUI's own test, when the file has the full-size SD2 UNet's ``output_blocks.11`` attention and ``read``
       gives tensor values: the standard deviation of its first transformer block's ``norm1.bias`` > 0.09 ->
       ``v_prediction``, else ``epsilon`` (what ComfyUI's CheckpointLoaderSimple decides for the same file);
    4. a file name with the token ``768``, ``v`` or ``vpred`` (``v2-1_768-ema-pruned``, ``sd21-v``,
       ``model_vpred``) -> ``v_prediction`` (Stability's 768 models are the v models);
    5. otherwise ``epsilon`` (the 512 "base" models).
    """
    if "v_pred" in shapes:
        return "v_prediction"
    if path is not None:
        sidecar = Path(path).with_suffix(".yaml")
        if sidecar.is_file():
            found = _PARAMETERIZATION.search(sidecar.read_text(errors="replace"))
            return "v_prediction" if found and found.group(1).lower() == "v" else "epsilon"
    if read is not None and SD2_V_PROBE in shapes:
        import torch

        std = torch.std(read(SD2_V_PROBE).float(), unbiased=False).item()
        return "v_prediction" if std > SD2_V_STD else "epsilon"
    if path is not None and _V_NAME.search(Path(path).stem):
        return "v_prediction"
    return "epsilon"


def scheduler_overrides(family: str, shapes: Shapes, path: Optional[Path] = None,
                        read: Optional[Callable[[str], "torch.Tensor"]] = None) -> tuple[str, dict]:
    """The engine family and the scheduler-config keys a single file sets beyond its family's defaults.

    - ``sd2``: :func:`sd2_prediction_type` decides between ``sd2`` and ``sd2-v``.
    - ``sd1`` / ``sdxl``: the marker tensors ComfyUI reads (``comfy/supported_models.py`` ``SDXL.model_type``;
      ComfyUI's ``state_dict_for_saving`` writes ``v_pred`` for every v-prediction model it saves): ``v_pred`` ->
      ``prediction_type="v_prediction"`` (NoobAI-XL V-Pred and other v-prediction SDXL fine-tunes); ``v_pred`` with
      ``ztsnr`` -> also the zero-terminal-SNR schedule (``rescale_betas_zero_snr=True``, Lin et al. 2023, with the
      ``trailing`` timestep spacing that paper prescribes so sampling starts at the last, pure-noise timestep as
      ComfyUI's samplers do from the schedule's largest sigma).
    """
    if family == "sd2":
        return ("sd2-v" if sd2_prediction_type(shapes, path, read) == "v_prediction" else "sd2"), {}
    if "v_pred" not in shapes:
        return family, {}
    overrides = {"prediction_type": "v_prediction"}
    if "ztsnr" in shapes:
        overrides.update(rescale_betas_zero_snr=True, timestep_spacing="trailing")
    return family, overrides


# --------------------------------------------------------------------------------------------- shipped defaults
_DEFAULTS_FILE = Path(__file__).resolve().parent / "configs" / "families.json"


def family_defaults(name: str) -> dict:
    """Shipped per-family defaults (scheduler config, VAE scaling, native size, fp16 VAE overflow); see the JSON.
    Returns a fresh copy: callers may change it."""
    import copy

    table = _defaults_table()
    if name not in table or name.startswith("_"):
        raise ValueError(f"family={name!r}: expected one of {', '.join(k for k in table if not k.startswith('_'))}")
    return copy.deepcopy(table[name])


@functools.lru_cache(maxsize=1)
def _defaults_table() -> dict:
    import json

    return json.loads(_DEFAULTS_FILE.read_text())


def is_dit_family(name: str) -> bool:
    """Whether ``name``'s denoiser is a flow-matching DiT (sampled by the flow sampler, not DDIM)."""
    return family_defaults(name).get("denoiser") == "dit"


def check_node_runs(family: str, node: str) -> None:
    """``ValueError`` naming ``lean_model`` when ``node`` does not run ``family`` yet (its ``nodes_not_yet`` row in
    ``families.json``: node -> what to do instead); checked before the node opens any stage."""
    row = _defaults_table().get(family, {})  # a family without a row (a test stand-in) runs everywhere it did
    fix = row.get("nodes_not_yet", {}).get(node)
    if fix is not None:
        raise ValueError(f"lean_model is a {family} model ({row['display']}); the {node} does not run it yet: {fix}")

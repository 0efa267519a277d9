"""ComfyUI CONDITIONING <-> the engine's prompt embeddings.

ComfyUI's CONDITIONING is a list of ``[cond, extras]`` pairs: ``cond`` is ``[B, 77*k, C]`` (float32, CPU) and
``extras`` a dict; ``CLIPTextEncode`` gives one pair with ``{"pooled_output": [B, P]}``, ``CLIPTextEncodeSDXL``
adds ``width, height, crop_w, crop_h, target_width, target_height``.

How ComfyUI 0.3.64 uses a single pair for SD1/SD2/SDXL (``comfy/samplers.py encode_model_conds``,
``comfy/model_base.py SDXL.encode_adm``, ``comfy/conds.py``), and how we reproduce it:
- batch: the cond is repeated (tiled, then cut) to the sampling batch (``repeat_to_batch_size``);
- SDXL size conditioning: ``width``/``height`` default to the latent size * 8, ``crop_w``/``crop_h`` to 0,
  ``target_width``/``target_height`` to the (resolved) width/height; the time ids are
  ``[height, width, crop_h, crop_w, target_height, target_width]`` (diffusers' order: original size, crop
  top-left, target size); the pooled output feeds the added embedding;
- a cond and an uncond of different lengths are batched by repeating each along the sequence axis to the least
  common multiple of the lengths: cross-attention over a sequence repeated r times is exactly the attention over
  the original (every key's softmax weight is split evenly over its r copies), so this changes nothing;
- time ids are float32 at every weight dtype (``memory.engine.TIME_IDS_DTYPE``): ComfyUI embeds the sizes from
  float32 values, and bf16 would turn 3000 into 3008 (fp16: 2049 into 2048), another sinusoid, another picture.

Entries that need ComfyUI's own sampler machinery (several pairs = ConditioningCombine averaging, areas, masks,
ControlNet, GLIGEN, hooks, timestep ranges, non-unit strength, unCLIP, style-model attention masks) and keys an SDXL
base model has no input for (the refiner's ``aesthetic_score``) raise ``ValueError`` before any model runs, naming
the input, the keys and the ComfyUI node that wrote them (``KEY_SOURCES``), and the fix.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..memory.finite import refuse_non_finite_inputs
from ..memory.engine import TIME_IDS_DTYPE, LeanEngine, PromptEmbeds

logger = logging.getLogger(__name__)

SIZE_KEYS = ("width", "height", "crop_w", "crop_h", "target_width", "target_height")
# keys whose given values are what a plain pair means anyway
NEUTRAL_VALUES = {"strength": 1.0, "start_percent": 0.0, "end_percent": 1.0, "clip_start_percent": 0.0,
                  "clip_end_percent": 1.0}
# the ComfyUI 0.3.64 nodes that write each refused key (nodes.py, comfy_extras/, comfy/hooks.py), named in the refusal
_AREA, _MASK, _CONTROL = ("ConditioningSetArea / ConditioningSetAreaPercentage", "ConditioningSetMask",
                          "ControlNetApply / ControlNetApplyAdvanced")
_HOOKS, _STYLE = "SetClipHooks / ConditioningSetProperties (hooks)", "StyleModelApply (attn_bias strength)"
KEY_SOURCES = {
    "area": _AREA, "set_area_to_bounds": f"{_AREA} / {_MASK}", "strength": "ConditioningSetAreaStrength",
    "mask": _MASK, "mask_strength": _MASK, "start_percent": "ConditioningSetTimestepRange",
    "end_percent": "ConditioningSetTimestepRange", "control": _CONTROL, "control_apply_to_uncond": _CONTROL,
    "gligen": "GLIGENTextBoxApply", "unclip_conditioning": "unCLIPConditioning", "attention_mask": _STYLE,
    "attention_mask_img_shape": _STYLE, "hooks": _HOOKS, "clip_start_percent": _HOOKS, "clip_end_percent": _HOOKS,
    "default": "ConditioningSetDefaultCombine", "concat_latent_image": "InpaintModelConditioning",
    "concat_mask": "InpaintModelConditioning", "aesthetic_score": "CLIPTextEncodeSDXLRefiner",
}
# keys those nodes write only next to a main one (named alone only when the main key is absent)
_COMPANIONS = {"set_area_to_bounds", "mask_strength", "control_apply_to_uncond", "attention_mask_img_shape"}


@dataclass(frozen=True, eq=False)
class SamplerConditioning(PromptEmbeds):
    """Prompt embeddings for one side of CFG, batched: ``context`` [B, L, C], ``pooled`` [B, P] (SDXL) and SDXL's
    ``time_ids`` [B, 6] when they are known (from the CONDITIONING or from the image size), else ``None``."""

    time_ids: Optional[torch.Tensor] = None


def repeat_to_batch(tensor: torch.Tensor, batch: int) -> torch.Tensor:
    """Tile along dim 0 and cut to ``batch`` rows (ComfyUI's ``repeat_to_batch_size``); always a new tensor."""
    n = tensor.shape[0]
    if n == batch:
        return tensor.clone()
    if n > batch:
        return tensor[:batch].clone()
    reps = math.ceil(batch / n)
    return tensor.repeat((reps,) + (1,) * (tensor.dim() - 1))[:batch]


def match_lengths(a: PromptEmbeds, b: PromptEmbeds) -> tuple[torch.Tensor, torch.Tensor]:
    """Contexts of ``a`` and ``b`` repeated along the sequence axis to the lcm of their lengths (exact for attention)."""
    la, lb = a.context.shape[1], b.context.shape[1]
    if la == lb:
        return a.context, b.context
    lcm = math.lcm(la, lb)
    return a.context.repeat(1, lcm // la, 1), b.context.repeat(1, lcm // lb, 1)


def _expected_dims(engine: LeanEngine) -> tuple[Optional[int], Optional[int]]:
    cfg = getattr(engine.parts.unet, "config", None)
    cross = getattr(cfg, "cross_attention_dim", None) if cfg is not None else None
    if isinstance(cross, (list, tuple)):
        cross = cross[0]
    pooled = None
    if engine.parts.is_sdxl and cfg is not None:
        total = getattr(cfg, "projection_class_embeddings_input_dim", None)
        time_dim = getattr(cfg, "addition_time_embed_dim", None)
        if total is not None and time_dim is not None:
            pooled = int(total) - 6 * int(time_dim)
    return (None if cross is None else int(cross)), pooled


def time_ids_from_sizes(values: dict, width: Optional[int], height: Optional[int], batch: int,
                        engine: LeanEngine) -> Optional[torch.Tensor]:
    """SDXL time ids [batch, 6] as ComfyUI builds them from ``values`` with image-size defaults; float32 at every
    weight dtype (``TIME_IDS_DTYPE``), so every size is the number ComfyUI's SDXL model embeds."""
    w = values.get("width", width)
    h = values.get("height", height)
    if w is None or h is None:
        return None
    row = [h, w, values.get("crop_h", 0), values.get("crop_w", 0), values.get("target_height", h),
           values.get("target_width", w)]
    ids = torch.tensor([[float(v) for v in row]], dtype=TIME_IDS_DTYPE, device=engine.device)
    return ids.repeat(batch, 1)


def single_pair(conditioning: Any, input_name: str = "positive_cond") -> tuple[torch.Tensor, dict]:
    """The one ``[cond [B, L, C], extras]`` pair of a CONDITIONING; ``TypeError``/``ValueError`` naming
    ``input_name`` for anything else (not a list, several entries, a malformed entry, a cond that is not 3-D)."""
    if not isinstance(conditioning, (list, tuple)) or not conditioning:
        raise TypeError(f"{input_name}: expected a CONDITIONING (a list of [tensor, dict] pairs), "
                        f"got {type(conditioning).__name__}")
    if len(conditioning) != 1:
        raise ValueError(
            f"{input_name}: got a CONDITIONING with {len(conditioning)} entries (from ConditioningCombine, or a text "
            f"encode with scheduled CLIP hooks), whose predictions ComfyUI's KSampler averages; LeanDiffusion "
            f"samplers take a single entry. Connect one text encode (ConditioningConcat / ConditioningAverage make "
            f"one entry of two prompts, but not the same picture), or sample with ComfyUI's KSampler")
    entry = conditioning[0]
    if not isinstance(entry, (list, tuple)) or len(entry) != 2 or not torch.is_tensor(entry[0]) \
            or not isinstance(entry[1], dict):
        raise TypeError(f"{input_name}: each CONDITIONING entry must be [tensor, dict], got {entry!r:.80}")
    cond, extras = entry
    if cond.dim() != 3:
        raise ValueError(f"{input_name}: the conditioning tensor must be [batch, tokens, channels], "
                         f"got shape {tuple(cond.shape)}")
    if cond.shape[0] == 0:
        raise ValueError(f"{input_name}: the CONDITIONING has 0 rows (shape {tuple(cond.shape)}); connect a "
                         f"text-encode node's output")
    if cond.shape[1] == 0:
        raise ValueError(f"{input_name}: the CONDITIONING has 0 tokens (shape {tuple(cond.shape)}); connect a "
                         f"text-encode node's output (at least one chunk of 77 tokens)")
    fix = "find the node upstream that produced them (a text encode in fp16 that overflowed, a bad embedding)"
    checked = [(input_name, cond)]
    if torch.is_tensor(extras.get("pooled_output")):
        checked.append((f"{input_name} (pooled_output)", extras["pooled_output"]))
    refuse_non_finite_inputs(checked, fix)  # one host sync for both tensors
    return cond, extras


def _describe(value: Any) -> str:
    if torch.is_tensor(value):
        return f"a tensor of shape {tuple(value.shape)}"
    if value is None or isinstance(value, (bool, int, float, str)):
        return f"{value!r:.40}"
    if isinstance(value, (list, tuple)) and all(v is None or isinstance(v, (int, float, str)) for v in value):
        return f"{value!r:.60}"
    return f"a {type(value).__name__}"


def _check_keys(extras: dict, input_name: str) -> None:
    """Refuse every key the samplers cannot honour (module docstring), naming the nodes that wrote them."""
    refused = [k for k, v in extras.items() if k not in SIZE_KEYS and k != "pooled_output"
               and not (k in NEUTRAL_VALUES and v == NEUTRAL_VALUES[k])]
    if not refused:
        return
    if refused == ["aesthetic_score"]:
        raise ValueError(
            f"{input_name}: the CONDITIONING carries 'aesthetic_score'={_describe(extras['aesthetic_score'])} (from "
            f"CLIPTextEncodeSDXLRefiner), an input of the SDXL refiner; LeanDiffusion runs SDXL base models, which "
            f"have no aesthetic-score conditioning (ComfyUI's KSampler ignores it on them). Encode the prompt with "
            f"CLIPTextEncodeSDXL (its sizes are used) or CLIPTextEncode instead")
    named = [k for k in refused if k not in _COMPANIONS] or refused
    keys = ", ".join(f"{k!r}={_describe(extras[k])}" for k in named)
    nodes = "; ".join(dict.fromkeys(KEY_SOURCES.get(k, "a node unknown to LeanDiffusion") for k in named))
    raise ValueError(
        f"{input_name}: the CONDITIONING carries {keys} (written by {nodes}), which LeanDiffusion samplers do not "
        f"support: they sample one plain text conditioning per side. Remove that node before {input_name}, or "
        f"sample this CONDITIONING with ComfyUI's KSampler")


def _warn_unapplied_text_lora(engine: LeanEngine, input_name: str) -> None:
    """A CONDITIONING was encoded outside this engine (ComfyUI's CLIP), so a LoRA's text-encoder part on the engine
    never reaches it: say so in the log instead of dropping it silently (the UNet part still applies)."""
    for adapter in engine.adapters:
        text = {c: s for c, s in getattr(adapter, "strengths", ()) if c != "unet" and s != 0}
        if getattr(adapter, "affects_text", False) and text:
            logger.warning(
                "%s: LoRA %r has a text-encoder part (strength_text_encoder %s) that this CONDITIONING was not "
                "encoded with: ComfyUI's CLIP encoded it. Only the LoRA's UNet part applies. To apply the text part, "
                "leave %s unconnected and write the prompt in the sampler, or also load the LoRA onto the CLIP with "
                "ComfyUI's LoraLoader", input_name, getattr(adapter, "name", "?"),
                ", ".join(f"{c}={s:g}" for c, s in text.items()), input_name)


def from_conditioning(conditioning: Any, engine: LeanEngine, batch: int, *, width: Optional[int] = None,
                      height: Optional[int] = None, input_name: str = "positive_cond") -> SamplerConditioning:
    """One CONDITIONING -> :class:`SamplerConditioning` for ``engine`` with ``batch`` rows (the pair's rows tiled or
    cut to ``batch``, as ComfyUI's ``repeat_to_batch_size``)."""
    cond, extras = single_pair(conditioning, input_name)
    _check_keys(extras, input_name)
    _warn_unapplied_text_lora(engine, input_name)
    cross, pooled_dim = _expected_dims(engine)
    if cross is not None and cond.shape[-1] != cross:
        raise ValueError(
            f"{input_name}: the conditioning has {cond.shape[-1]} channels but the {engine.family} model expects "
            f"{cross}; encode the text with this model's CLIP (from the same checkpoint family)")
    pooled = extras.get("pooled_output")
    if engine.parts.is_sdxl:
        if not torch.is_tensor(pooled):
            raise ValueError(f"{input_name}: an SDXL model needs the CONDITIONING's 'pooled_output' (from "
                             f"CLIPTextEncode with an SDXL CLIP); it is missing")
        if pooled_dim is not None and pooled.shape[-1] != pooled_dim:
            raise ValueError(f"{input_name}: pooled_output has width {pooled.shape[-1]}, the SDXL model expects "
                             f"{pooled_dim}; encode the text with this model's CLIP")
        pooled = repeat_to_batch(pooled.reshape(-1, pooled.shape[-1]), batch).to(engine.device, engine.dtype)
        time_ids = time_ids_from_sizes(extras, width, height, batch, engine)
    else:
        pooled, time_ids = None, None
    context = repeat_to_batch(cond, batch).to(engine.device, engine.dtype)
    return SamplerConditioning(context, pooled, time_ids)


def to_conditioning(embeds: PromptEmbeds, extras: Optional[dict] = None) -> list:
    """Prompt embeddings -> a ComfyUI CONDITIONING (float32 on the CPU, as ComfyUI keeps them)."""
    info = dict(extras or {})
    info["pooled_output"] = None if embeds.pooled is None else embeds.pooled.detach().float().cpu()
    return [[embeds.context.detach().float().cpu(), info]]

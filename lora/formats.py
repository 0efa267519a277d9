"""LoRA file formats: read a file and parse it into per-module low-rank factors (no model needed).

Supported layouts: the spellings ComfyUI 0.3.64's LoRA loader reads for SD1.x / SD2.x / SDXL (checked against its
key maps on the full-size layouts in ``tests/lora/test_key_spellings.py``; the few exceptions are in docs/lora.md),
which also carry Z-Image LoRAs (its original and fused names resolve in ``keymap`` / ``zimage_names``)
- prefixed ("kohya") layout, ``PREFIXES``: kohya-ss / A1111 ``lora_unet_<module>``, ``lora_te_<module>`` (=
  ``lora_te1_``), ``lora_te2_<module>``, SimpleTuner's ``lycoris_<module>``, where ``<module>`` is the module's dotted
  name with ``.`` spelled ``_``, in diffusers naming (``down_blocks_0_attentions_0_...``, SD1.x trainers) or LDM
  naming (``input_blocks_4_1_...``, SDXL trainers); and ComfyUI's own files (its LoRA trainer, "Extract and Save
  Lora"): ``diffusion_model.<LDM name>``, ``text_encoders.clip_l|clip_h|clip_g.transformer.<CLIP name>``. Factors
  ``.lora_down.weight`` / ``.lora_up.weight`` (or any spelling of ``_FACTOR_SUFFIXES``), an optional scalar
  ``.alpha``. Resolving ``<module>`` is ``keymap``'s job. Linear layers and conv "LoCon" layers (``lora_down`` a kxk
  conv with the base conv's kernel, ``lora_up`` a 1x1 conv).
- diffusers / PEFT: ``<component>.<module>.lora_A.weight`` / ``.lora_B.weight`` (also the older
  ``.lora.down/.lora.up`` and ``.lora_linear_layer.down/.up`` spellings, and diffusers' attention-processor
  spelling ``<attn>.processor.to_q_lora.down.weight`` / ``<self_attn>.to_q_lora.down.weight``, where ``to_out_lora``
  is the UNet's ``to_out.0`` and the text encoders' ``to_q/k/v/out`` are ``q/k/v/out_proj``; ComfyUI's key-map
  spelling ``<attn>.processor.to_q`` with any factor suffix is the same module), ``<component>`` one
  of ``unet``, ``text_encoder``, ``text_encoder_2``, or ``transformer`` (a DiT's, e.g. Z-Image's: the engine's
  ``unet``; its metadata keys keep the file's ``transformer.`` prefix); a key with no component prefix names a
  denoiser module (the few-step Qwen-Image "Lightning" files: ``transformer_blocks.0.attn.to_q.lora_down.weight``
  with an ``.alpha``, every factor spelling read as here). Alphas come from ``<module>.alpha`` keys or from the
  ``lora_adapter_metadata`` JSON diffusers writes into the safetensors header (``<component>.lora_alpha``,
  ``.alpha_pattern``, ``.use_rslora``); with neither, alpha = rank (PEFT's and diffusers' convention).
- LyCORIS LoHa / LoKr in the prefixed layout (``hada_w1_a``..., ``lokr_w1``...), and DoRA (``dora_scale``) on any
  of the three: parsed by ``lycoris.py`` (formulas there).

Math (the invariant every consumer relies on): a plain LoRA layer contributes
``delta_W = scale * up @ down`` with ``scale = alpha / rank`` (``alpha / sqrt(rank)`` under rsLoRA) and
``rank = down.shape[0]``; for conv layers the product is taken over the rank axis with ``up`` a 1x1 kernel. Every
layer kind (``LoraLayer``, ``lycoris.LohaLayer``, ``lycoris.LokrLayer``) offers ``delta_flat()`` (that product,
``[out, in * kh * kw]``), ``placed()`` (on a device, scale folded in), ``in_dim``/``out_dim`` and ``magnitude``
(the DoRA ``dora_scale``, else None; ``dora.py``).

LoCon with Tucker factors (``lora_mid``) becomes a plain LoCon layer (``_tucker_down``). Anything else (LoHa Tucker
"hada_t1", bias-LoRA, full-diff, LyCORIS norm layers, OFT/GLoRA keys, a NaN or infinite tensor, PEFT DoRA
``lora_magnitude_vector``, LoHa/LoKr/DoRA keys outside the prefixed layout, a down without its up) is refused with a
``ValueError`` naming the keys, never skipped silently. Hand-written because diffusers' converters are private,
string-replacement heuristics that (by design) also rewrite names for their own PEFT injection.
"""
from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping, Optional

import torch

from ..torchfile import load_tensors, read_safetensors, refuse_non_finite
from .dora import check_magnitude, placed_magnitude
from .lycoris import LYCORIS_SUFFIXES, alpha_value, lycoris_kind, parse_lycoris

logger = logging.getLogger(__name__)

COMPONENTS = ("unet", "text_encoder", "text_encoder_2")
# diffusers/PEFT component names -> the engine's: a DiT's LoRA is saved as ``transformer`` (Z-Image), the engine
# runs the DiT in its ``unet`` slot
_FILE_COMPONENTS = {"transformer": "unet"}
# The prefixed ("kohya") layout: file key prefix -> (component, how the rest spells the module). Checked longest
# first. The dotted ones are what ComfyUI's own LoRA trainer and "Extract and Save Lora" node write (its model's
# state-dict names: LDM UNet names, ``text_encoders.clip_l.transformer.text_model...``); ``lycoris_`` is
# SimpleTuner's LyCORIS prefix (diffusers UNet names). CLIP-L is the text encoder of SD1.x and the first of SDXL,
# OpenCLIP-H that of SD2.x, OpenCLIP-G the second of SDXL (ComfyUI's ``model_lora_keys_clip``).
PREFIXES = {"lora_unet_": ("unet", "kohya"), "lycoris_": ("unet", "kohya"), "lora_te_": ("text_encoder", "kohya"),
            "lora_te1_": ("text_encoder", "kohya"), "lora_te2_": ("text_encoder_2", "kohya"),
            "diffusion_model.": ("unet", "dotted"),
            "text_encoders.clip_l.transformer.": ("text_encoder", "dotted"),
            "text_encoders.clip_h.transformer.": ("text_encoder", "dotted"),
            "text_encoders.clip_g.transformer.": ("text_encoder_2", "dotted")}
_PREFIX_ORDER = tuple(sorted(PREFIXES, key=len, reverse=True))
# Every spelling of a layer's two factors that ComfyUI reads (``comfy/weight_adapter/lora.py``), in either layout.
_FACTOR_SUFFIXES = {
    ".lora_down.weight": "down", ".lora_up.weight": "up",
    ".lora_A.weight": "down", ".lora_B.weight": "up",
    ".lora.down.weight": "down", ".lora.up.weight": "up",
    ".lora_linear_layer.down.weight": "down", ".lora_linear_layer.up.weight": "up",
    ".lora_A.default.weight": "down", ".lora_B.default.weight": "up",
    ".lora_A": "down", ".lora_B": "up",
}
_KOHYA_ROLE = {"down": ".lora_down.weight", "up": ".lora_up.weight"}
_PEFT_ROLES = (*_FACTOR_SUFFIXES.items(), (".alpha", "alpha"))  # a PEFT key's suffix -> its role
_UNSUPPORTED_MARKERS = {  # checked in this order (".diff_b" before ".diff", which it contains)
    "lora_magnitude_vector": "PEFT DoRA (lora_magnitude_vector)",
    "hada_t1": "LoHa with Tucker decomposition", "hada_t2": "LoHa with Tucker decomposition",
    ".diff_b": "bias difference (LyCORIS .diff_b; ComfyUI's Extract and Save Lora writes it with bias_diff on)",
    ".diff": "full weight difference (LyCORIS .diff; ComfyUI's Extract and Save Lora: full_diff, or bias_diff on)",
    "lora_B.bias": "LoRA with bias",
    ".w_norm": "norm-layer (LyCORIS train_norm: .w_norm/.b_norm)",
    ".b_norm": "norm-layer (LyCORIS train_norm: .w_norm/.b_norm)",
    "oft_": "OFT", ".a1.weight": "GLoRA", ".b1.weight": "GLoRA",
}
# Supported in the kohya layout only (``lycoris.py``); elsewhere refused.
_KOHYA_ONLY_MARKERS = {"hada_": "LoHa (LyCORIS Hadamard product)", "lokr_": "LoKr (LyCORIS Kronecker product)",
                       "dora_scale": "DoRA"}
METADATA_KEY = "lora_adapter_metadata"  # diffusers' LORA_ADAPTER_METADATA_KEY
# diffusers' attention-processor files (0.14-0.20; its ``UNET_TO_DIFFUSERS`` / ``DIFFUSERS_OLD_TO_PEFT`` tables).
_ATTN_PROCESSOR_KEY = re.compile(r"(?P<parent>.+?)(?:\.processor)?\.(?P<proj>to_q|to_k|to_v|to_out)_lora\."
                                 r"(?P<role>down|up)\.weight")
_ATTN_PROCESSOR_UNET = {"to_q": "to_q", "to_k": "to_k", "to_v": "to_v", "to_out": "to_out.0"}
_ATTN_PROCESSOR_TEXT = {"to_q": "q_proj", "to_k": "k_proj", "to_v": "v_proj", "to_out": "out_proj"}
# the same processor spelling with any factor suffix (``<attn>.processor.to_q.lora_A.weight``): ComfyUI's
# ``model_lora_keys_unet`` names diffusers UNet attention layers this way (``.processor.to_out`` = ``to_out.0``)
_PROCESSOR_NAME = re.compile(r"(?P<parent>.+)\.processor\.(?P<proj>to_q|to_k|to_v|to_out)")


@dataclass(frozen=True, eq=False)
class LoraLayer:
    """One module's factors as stored in the file (CPU tensors, file dtype)."""

    component: str  # "unet" | "text_encoder" | "text_encoder_2"
    name: str  # module name as spelled by the file (kohya: underscores, no prefix; PEFT: dotted)
    naming: str  # "kohya" | "dotted"
    down: torch.Tensor  # [r, in] or [r, in, kh, kw]
    up: torch.Tensor  # [out, r] or [out, r, 1, 1]
    scale: float  # alpha / rank (or alpha / sqrt(rank))
    source: str  # the file key prefix, for error messages
    magnitude: Optional[torch.Tensor] = None  # DoRA ``dora_scale`` ([1, in(,1,1)] or [out, 1(,1,1)]), else None

    kind = "LoRA"

    @property
    def in_dim(self) -> int:
        return int(self.down.shape[1])

    @property
    def out_dim(self) -> int:
        return int(self.up.shape[0])

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.down, self.up, self.magnitude) if t is not None)

    @property
    def dtype(self) -> torch.dtype:
        return self.down.dtype

    def delta_flat(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """``scale * up @ down`` as ``[out, in * kh * kw]``, computed in ``dtype`` (default: the factors')."""
        dt = dtype or self.dtype
        return (self.up.flatten(1).to(dt) @ self.down.flatten(1).to(dt)) * self.scale

    def placed(self, device: torch.device, dtype: torch.dtype) -> "LoraLayer":
        """On ``device``/``dtype`` with the scale folded into ``up`` (fp32 product, rounded once); the DoRA
        magnitude stays fp32."""
        up = (self.up.to(device=device, dtype=torch.float32) * self.scale).to(dtype)
        return replace(self, down=self.down.to(device=device, dtype=dtype), up=up, scale=1.0,
                       magnitude=placed_magnitude(self.magnitude, device))


@dataclass(frozen=True, eq=False)
class ParsedLora:
    format: str  # "kohya" | "peft"
    layers: tuple[LoraLayer, ...]
    source: str = ""

    def components(self) -> set[str]:
        return {layer.component for layer in self.layers}


# --------------------------------------------------------------------------------------------- reading
def read_state_dict(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors (CPU) and header metadata of a LoRA file. ``.safetensors`` or a torch file (``weights_only``)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"lora file {str(path)!r} does not exist; pick a file from the loras folder")
    if path.suffix.lower() in (".safetensors", ".sft"):
        return read_safetensors(path, "lora file")
    obj = load_tensors(path, "lora file")
    if isinstance(obj, Mapping) and "state_dict" in obj and isinstance(obj["state_dict"], Mapping):
        obj = obj["state_dict"]
    if not isinstance(obj, Mapping) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ValueError(f"lora file {path.name!r} does not hold a flat dict of tensors")
    return dict(obj), {}


# --------------------------------------------------------------------------------------------- parsing
def parse_lora(state_dict: Mapping[str, torch.Tensor], metadata: Optional[Mapping[str, str]] = None,
               source: str = "state dict") -> ParsedLora:
    """Detect the layout of ``state_dict`` and return its layers. Raises ``ValueError`` on anything unknown."""
    if not state_dict:
        raise ValueError(f"lora {source}: the file holds no tensors")
    keys = list(state_dict)
    kohya = [k.startswith(_PREFIX_ORDER) for k in keys]
    _refuse_unsupported(state_dict, source, kohya_layout=all(kohya))
    # a NaN or infinite factor, alpha or dora_scale would make every image of the model NaN (black) or noise
    refuse_non_finite(state_dict, f"lora {source}", "every image black or into noise",
                      "use another checkpoint of the LoRA or re-export it")
    if all(kohya):
        return ParsedLora("kohya", _parse_kohya(state_dict, source), source)
    if not any(kohya) and any(k.endswith(tuple(_FACTOR_SUFFIXES)) or _ATTN_PROCESSOR_KEY.fullmatch(k) for k in keys):
        return ParsedLora("peft", _parse_peft(state_dict, metadata or {}, source), source)
    if any(kohya):
        foreign = sorted(k for k, is_kohya in zip(keys, kohya) if not is_kohya)
        raise ValueError(f"lora {source}: a kohya LoRA file with {len(foreign)} keys that are not kohya LoRA keys "
                         f"(lora_unet_*/lora_te*_*): {', '.join(foreign[:20])}; the injector loads LoRA weights "
                         f"only (embedded textual inversions and other extras are not supported), and one file "
                         f"uses one layout (all keys prefixed with {', '.join(PREFIXES)}, or none): remove these "
                         f"keys from the file")
    sample = ", ".join(keys[:5])
    raise ValueError(f"lora {source}: unrecognised key layout (first keys: {sample}); expected kohya keys "
                     f"(lora_unet_*/lora_te*_* with lora_down/lora_up) or diffusers/PEFT keys (lora_A/lora_B)")


def _refuse_unsupported(state_dict: Mapping[str, torch.Tensor], source: str, kohya_layout: bool) -> None:
    for marker, kind in _UNSUPPORTED_MARKERS.items():
        hits = [k for k in state_dict if marker in k]
        if hits:
            raise ValueError(f"lora {source}: {kind} weights are not supported by the LoRA injector "
                             f"(keys such as {', '.join(hits[:3])}); use a plain LoRA/LoCon, LoHa or LoKr file "
                             f"without such layers")
    if kohya_layout:
        return
    for marker, kind in _KOHYA_ONLY_MARKERS.items():
        hits = [k for k in state_dict if marker in k]
        if hits:
            raise ValueError(f"lora {source}: {kind} weights are supported in the kohya/LyCORIS layout only "
                             f"(lora_unet_*/lora_te*_* keys), not in this file's layout (keys such as "
                             f"{', '.join(hits[:3])}); save the file with kohya-style key names")


_KOHYA_SUFFIXES = (".lora_down.weight", ".lora_up.weight", ".lora_mid.weight", ".alpha", ".dora_scale") + \
    LYCORIS_SUFFIXES


def _kohya_split(key: str) -> tuple[str, str]:
    """(layer base, suffix), with every factor spelling of ``_FACTOR_SUFFIXES`` as kohya's ``.lora_down/up.weight``."""
    for suffix in _KOHYA_SUFFIXES:
        if key.endswith(suffix):
            return key[: -len(suffix)], suffix
    for suffix, role in _FACTOR_SUFFIXES.items():
        if key.endswith(suffix):
            return key[: -len(suffix)], _KOHYA_ROLE[role]
    return key, ""


def _parse_kohya(state_dict: Mapping[str, torch.Tensor], source: str) -> tuple[LoraLayer, ...]:
    groups: dict[str, dict[str, torch.Tensor]] = {}
    unknown = []
    for key, tensor in state_dict.items():
        base, suffix = _kohya_split(key)
        if not suffix:
            unknown.append(key)
            continue
        group = groups.setdefault(base, {})
        if suffix in group:
            raise ValueError(f"lora {source}: layer {base} holds its {suffix.split('.')[1]} factor twice, in two "
                             f"spellings (e.g. lora_down and lora_A); the file is inconsistent: re-export it")
        group[suffix] = tensor
    if unknown:
        raise ValueError(f"lora {source}: keys with an unknown suffix (expected .lora_down.weight, "
                         f".lora_up.weight (or .lora_A/.lora_B.weight), .alpha, .dora_scale or LyCORIS "
                         f".hada_*/.lokr_* factors): {', '.join(sorted(unknown)[:20])}")
    layers = []
    plain = {b: g for b, g in groups.items() if not lycoris_kind(g)}
    incomplete = sorted(b for b, g in plain.items() if ".lora_down.weight" not in g or ".lora_up.weight" not in g)
    if incomplete:
        raise ValueError(f"lora {source}: these layers lack a lora_down or lora_up weight: "
                         f"{', '.join(incomplete[:20])}")
    for base in sorted(groups):
        g = groups[base]
        prefix = next(p for p in _PREFIX_ORDER if base.startswith(p))
        (component, naming), name = PREFIXES[prefix], base[len(prefix):]
        magnitude = check_magnitude(g.get(".dora_scale"), base, source)
        if base not in plain:
            layers.append(parse_lycoris(g, component, name, naming, base, source, magnitude))
            continue
        down, up = g[".lora_down.weight"], g[".lora_up.weight"]
        if ".lora_mid.weight" in g:
            down = _tucker_down(down, g[".lora_mid.weight"], base, source)
        rank = _check_pair(down, up, base, source)
        alpha = alpha_value(g[".alpha"], base, source) if ".alpha" in g else float(rank)
        layers.append(LoraLayer(component, name, naming, down, up, alpha / rank, base, magnitude))
    return tuple(layers)


def _tucker_down(down: torch.Tensor, mid: torch.Tensor, name: str, source: str) -> torch.Tensor:
    """LoCon with Tucker factors (``lora_down`` a 1x1 ``[r, in]``, ``lora_mid`` a ``[r, r, kh, kw]`` conv, ``lora_up``
    ``[out, r, 1, 1]``; the layer runs ``up(mid(down(x)))``, LyCORIS' ``use_tucker``) as one ``[r, in, kh, kw]``
    down factor: ``down'[a, c] = sum_b mid[a, b] * down[b, c]`` (fp32, once), the product ComfyUI forms; the rank
    (``alpha / rank``) stays ``r``. The combined kernel costs ``r in kh kw`` per pixel instead of ``r in + r r kh kw``,
    a few % of the base conv at SD's widths, and the layer then runs as any LoCon layer. The product stays fp32 whatever
    the file's dtype (as ComfyUI computes it)."""
    if not (down.is_floating_point() and mid.is_floating_point()) or mid.ndim != 4 or down.ndim not in (2, 4) or (
            down.ndim == 4 and tuple(down.shape[2:]) != (1, 1)) or not mid.shape[0] == mid.shape[1] == down.shape[0]:
        raise ValueError(f"lora {source}: layer {name} has lora_mid {tuple(mid.shape)} ({mid.dtype}) and lora_down "
                         f"{tuple(down.shape)} ({down.dtype}); expected float lora_mid [r, r, kh, kw] after a 1x1 "
                         f"lora_down [r, in(, 1, 1)]; the file is corrupt or not a LoCon")
    # kept fp32: rounding it to the file's dtype (bf16 in most files) would add a rounding ComfyUI does not make;
    # ``placed`` rounds it once, to the model's dtype
    return torch.einsum("abkl,bc->ackl", mid.float(), down.flatten(1).float())


def _peft_split(key: str) -> tuple[str, str]:
    """(layer base, role); a UNet attention layer's base in its module spelling (``.processor.to_q`` = ``.to_q``)."""
    m = _ATTN_PROCESSOR_KEY.fullmatch(key)
    if m:
        names = _ATTN_PROCESSOR_TEXT if key.startswith("text_encoder") else _ATTN_PROCESSOR_UNET
        return f"{m['parent']}.{names[m['proj']]}", m["role"]
    for suffix, role in _PEFT_ROLES:
        if key.endswith(suffix):
            base = key[: -len(suffix)]
            p = _PROCESSOR_NAME.fullmatch(base)
            return (f"{p['parent']}.{_ATTN_PROCESSOR_UNET[p['proj']]}" if p else base), role
    return key, ""


def _component_of(name: str) -> tuple[str, str, str]:
    """(component, module name, the file's own component name: the ``lora_adapter_metadata`` key prefix)."""
    for prefix in sorted((*COMPONENTS, *_FILE_COMPONENTS), key=len, reverse=True):
        if name.startswith(prefix + "."):
            return _FILE_COMPONENTS.get(prefix, prefix), name[len(prefix) + 1:], prefix
    if name.startswith("base_model.model."):
        return "unet", name[len("base_model.model."):], "unet"
    return "unet", name, "unet"


def _peft_metadata(metadata: Mapping[str, str], source: str) -> dict:
    raw = metadata.get(METADATA_KEY)
    if not raw:
        return {}
    try:
        parsed = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"lora {source}: the {METADATA_KEY} header is not valid JSON ({exc})") from exc
    if not isinstance(parsed, dict):
        raise ValueError(f"lora {source}: the {METADATA_KEY} header is not a JSON object")
    return parsed


def _pattern_value(patterns: Mapping[str, float], module: str) -> Optional[float]:
    """PEFT's pattern rule: a key matches a module whose name ends with ``.key`` or equals it (regex allowed)."""
    for key, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?(?:{key})", module):
            return float(value)
    return None


def _parse_peft(state_dict: Mapping[str, torch.Tensor], metadata: Mapping[str, str], source: str
                ) -> tuple[LoraLayer, ...]:
    meta = _peft_metadata(metadata, source)
    groups: dict[str, dict[str, torch.Tensor]] = {}
    unknown = []
    for key, tensor in state_dict.items():
        base, role = _peft_split(key)
        if not role:
            unknown.append(key)
            continue
        groups.setdefault(base, {})[role] = tensor
    if unknown:
        raise ValueError(f"lora {source}: keys that are neither lora_A/lora_B weights nor alphas: "
                         f"{', '.join(sorted(unknown)[:20])}")
    incomplete = sorted(b for b, g in groups.items() if "down" not in g or "up" not in g)
    if incomplete:
        raise ValueError(f"lora {source}: these layers lack a lora_A or lora_B weight: {', '.join(incomplete[:20])}")
    layers = []
    for base in sorted(groups):
        g = groups[base]
        comp, module, prefix = _component_of(base)
        rank = _check_pair(g["down"], g["up"], base, source)
        if "alpha" in g:
            alpha = alpha_value(g["alpha"], base, source)
        else:
            pattern = _pattern_value(meta.get(f"{prefix}.alpha_pattern") or {}, module)
            alpha = pattern if pattern is not None else float(meta.get(f"{prefix}.lora_alpha", rank))
        if not math.isfinite(alpha):  # the header's JSON may spell NaN / Infinity (tensors: refuse_non_finite)
            raise ValueError(f"lora {source}: layer {base} has alpha {alpha} (from the {METADATA_KEY} header); "
                             f"expected a finite number; the file is corrupt: re-export it")
        denom = math.sqrt(rank) if meta.get(f"{prefix}.use_rslora") else rank
        layers.append(LoraLayer(comp, module, "dotted", g["down"], g["up"], alpha / denom, base))
    return tuple(layers)


def _check_pair(down: torch.Tensor, up: torch.Tensor, name: str, source: str) -> int:
    if down.ndim not in (2, 4) or up.ndim not in (2, 4):
        raise ValueError(f"lora {source}: layer {name} has down {tuple(down.shape)} / up {tuple(up.shape)}; "
                         f"expected 2-D (linear) or 4-D (conv) factors")
    if not (down.is_floating_point() and up.is_floating_point()):
        raise ValueError(f"lora {source}: layer {name} has non-float factors ({down.dtype}, {up.dtype})")
    rank = int(down.shape[0])
    if rank == 0 or up.shape[1] != rank or (up.ndim == 4 and tuple(up.shape[2:]) != (1, 1)):
        raise ValueError(f"lora {source}: layer {name} has inconsistent factors down {tuple(down.shape)} / "
                         f"up {tuple(up.shape)}; expected down [r, in, ...] and up [out, r] or [out, r, 1, 1]")
    return rank

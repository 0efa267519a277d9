"""Test kit: the tiny Z-Image written as ComfyUI split files (diffusion model, text encoder, VAE), as users have them.

The diffusers state dicts are turned into the original layouts by hand-written inverse conversions (fused qkv, the
LDM VAE names with 1x1-conv attention, Hugging Face's ``model.`` prefix and ``lm_head``): the direction the loader
does not take, so a wrong rename on either side fails the round trip instead of cancelling out.

fp8 variants store every tensor of two or more dimensions as ``float8_e4m3fn`` (plain, or "scaled" with a
per-tensor power-of-two scale beside it, q/k/v sharing the fused qkv's scale); ``fp8_grid`` first puts a model's
weights on that grid, so the upcast of the stored values equals the diffusers folder's weights exactly.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
COMFY_PREFIX = "model.diffusion_model."
_QKV = re.compile(r"(.*\.attention)\.to_([qkv])\.weight$")


# ------------------------------------------------------------------------------------------------ precision
def pow2_scale(t: torch.Tensor) -> float:
    """The smallest power of two ``s`` with ``max|t| / s <= 448`` (e4m3's largest finite value)."""
    amax = float(t.abs().max())
    return 2.0 ** math.ceil(math.log2(amax / FP8_MAX)) if amax > 0 else 1.0


def _on_grid(t: torch.Tensor, scale: float) -> torch.Tensor:
    return ((t.float() / scale).to(FP8).float() * scale).to(t.dtype)


def _qkv_groups(sd: dict) -> dict:
    groups: dict = {}
    for key in sd:
        m = _QKV.match(key)
        if m:
            groups.setdefault(m.group(1), []).append(key)
    return {k: sorted(v, key=lambda n: "qkv".index(_QKV.match(n).group(2))) for k, v in groups.items()}


def fp8_grid(components: dict, scaled: bool) -> dict:
    """Round every weight of ``components`` in place: bf16 values, and tensors of 2+ dims onto the e4m3 grid
    (scale 1, or the power-of-two scale the scaled writer will store, shared by each q/k/v triple)."""
    for part in ("transformer", "text_encoder", "vae"):
        sd = components[part].state_dict()
        shared = {k: pow2_scale(torch.cat([sd[n] for n in names])) for names in _qkv_groups(sd).values()
                  for k in names}
        with torch.no_grad():
            for key, t in sd.items():
                t.copy_(t.to(torch.bfloat16).float())
                if t.ndim >= 2:
                    t.copy_(_on_grid(t, (shared.get(key) or pow2_scale(t)) if scaled else 1.0))
    return components


def bf16_grid(components: dict) -> dict:
    """Round every weight of ``components`` in place to bf16 values (a bf16 file then holds them exactly)."""
    for part in ("transformer", "text_encoder", "vae"):
        with torch.no_grad():
            for t in components[part].state_dict().values():
                t.copy_(t.to(torch.bfloat16).float())
    return components


def store(sd: dict, dtype: str, scale_suffix: str = ".scale_weight") -> dict:
    """``sd`` as a file stores it: ``bf16``; ``fp8`` (2+ dim tensors in e4m3, the rest bf16); ``fp8_scaled``
    (the same with a power-of-two fp32 scale per e4m3 tensor under ``<name><scale_suffix>`` and ComfyUI's
    ``scaled_fp8`` marker)."""
    out = {}
    for key, t in sd.items():
        if dtype == "bf16" or t.ndim < 2:
            out[key] = t.to(torch.bfloat16)
        elif dtype == "fp8":
            out[key] = t.float().to(FP8)
        else:
            scale = pow2_scale(t)
            out[key] = (t.float() / scale).to(FP8)
            stem = key[:-len(".weight")] if key.endswith(".weight") else key
            out[stem + scale_suffix] = torch.tensor(scale, dtype=torch.float32)
    if dtype == "fp8_scaled":
        out["scaled_fp8"] = torch.zeros(0, dtype=FP8)
    return out


# ------------------------------------------------------------------------------------------------ layouts
def transformer_original(sd: dict, comfy: bool = False) -> dict:
    """diffusers ``ZImageTransformer2DModel`` keys -> Tongyi's original layout (fused qkv, ``out``, ``q_norm``,
    ``x_embedder``, ``final_layer``); ``comfy``: under ``model.diffusion_model.`` with the unused ``norm_final``
    ComfyUI's NextDiT also saves."""
    out = {}
    for base, names in _qkv_groups(sd).items():
        out[f"{base}.qkv.weight"] = torch.cat([sd[n] for n in names], dim=0)
    renames = ((r"^all_x_embedder\.2-1\.", "x_embedder."), (r"^all_final_layer\.2-1\.", "final_layer."),
               (r"\.attention\.to_out\.0\.", ".attention.out."), (r"\.attention\.norm_q\.", ".attention.q_norm."),
               (r"\.attention\.norm_k\.", ".attention.k_norm."))
    for key, t in sd.items():
        if _QKV.match(key):
            continue
        for pattern, new in renames:
            key = re.sub(pattern, new, key)
        out[key] = t
    if comfy:
        dim = sd["cap_embedder.1.bias"].shape[0]
        out = {COMFY_PREFIX + k: v for k, v in out.items()}
        out[COMFY_PREFIX + "norm_final.weight"] = torch.ones(dim)
    return out


def text_encoder_hf(sd: dict, prefix: bool = True, lm_head: bool = True) -> dict:
    """``Qwen3Model`` keys -> Hugging Face's causal-LM file (``model.`` prefix, an ``lm_head`` beside it)."""
    out = {("model." + k if prefix else k): v for k, v in sd.items()}
    if lm_head:
        out["lm_head.weight"] = sd["embed_tokens.weight"].flip(0).clone()  # untied, and never read by the encoder
    return out


_VAE_RENAMES = (
    (r"^(encoder|decoder)\.mid_block\.attentions\.0\.group_norm\.", r"\1.mid.attn_1.norm."),
    (r"^(encoder|decoder)\.mid_block\.attentions\.0\.to_out\.0\.", r"\1.mid.attn_1.proj_out."),
    (r"^(encoder|decoder)\.mid_block\.attentions\.0\.to_([qkv])\.", r"\1.mid.attn_1.\2."),
    (r"^(encoder|decoder)\.mid_block\.resnets\.(\d+)\.", lambda m: f"{m[1]}.mid.block_{int(m[2]) + 1}."),
    (r"^encoder\.down_blocks\.(\d+)\.resnets\.", r"encoder.down.\1.block."),
    (r"^encoder\.down_blocks\.(\d+)\.downsamplers\.0\.", r"encoder.down.\1.downsample."),
    (r"\.conv_shortcut\.", ".nin_shortcut."), (r"^(encoder|decoder)\.conv_norm_out\.", r"\1.norm_out."),
)


def vae_original(sd: dict) -> dict:
    """diffusers ``AutoencoderKL`` keys -> the original (LDM / Flux ``ae.safetensors``) layout: ``down.N.block``,
    ``up`` levels counted from the bottom, ``mid.block_1``, attention as 1x1 convolutions."""
    levels = len({k.split(".")[2] for k in sd if k.startswith("decoder.up_blocks.")})
    out = {}
    for key, t in sd.items():
        up = re.match(r"^decoder\.up_blocks\.(\d+)\.(resnets|upsamplers\.0)\.", key)
        if up:
            kind = "block." if up[2] == "resnets" else "upsample."
            key = f"decoder.up.{levels - 1 - int(up[1])}.{kind}" + key[up.end():]
        for pattern, new in _VAE_RENAMES:
            key = re.sub(pattern, new, key)
        if ".mid.attn_1." in key and ".norm." not in key and key.endswith(".weight"):
            t = t.reshape(*t.shape, 1, 1)
        out[key] = t
    return out


# ------------------------------------------------------------------------------------------------ files
def write_split_files(components: dict, models: Path, tag: str, dtype: str = "bf16", comfy: bool = False,
                      layout: str = "original", scale_suffix: str = ".scale_weight",
                      folders=("diffusion_models", "text_encoders", "vae")) -> dict:
    """Write the three files under ``models/<folder>/`` and return the node's three input values."""
    dit = components["transformer"].state_dict()
    vae = components["vae"].state_dict()
    parts = {"diffusion_model": transformer_original(dit, comfy) if layout == "original" else dict(dit),
             "text_encoder": text_encoder_hf(components["text_encoder"].state_dict(), prefix=comfy, lm_head=comfy),
             "vae": vae_original(vae) if layout == "original" else dict(vae)}
    names = {}
    for (arg, sd), folder in zip(parts.items(), folders):
        path = Path(models) / folder / f"{tag}_{arg}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in store(sd, dtype, scale_suffix).items()}, str(path))
        names[arg] = path.name
    return names


def write_single(sd: dict, path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    return path.name


def write_comfy_style_tokenizer(tokenizer, folder: Path) -> Path:
    """``tokenizer``'s vocabulary as ComfyUI ships Qwen's (``vocab.json``, ``merges.txt``, a ``tokenizer_config.json``
    naming ``Qwen2Tokenizer`` with the special tokens in ``added_tokens_decoder``), no ``tokenizer.json``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    (folder / "vocab.json").write_text(json.dumps(model["vocab"]))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in model["merges"]))
    added = {str(i): {"content": tok.content, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for i, tok in tokenizer.added_tokens_decoder.items()}
    config = {"tokenizer_class": "Qwen2Tokenizer", "added_tokens_decoder": added, "bos_token": None,
              "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None, "errors": "replace",
              "add_prefix_space": False, "model_max_length": 131072, "split_special_tokens": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder

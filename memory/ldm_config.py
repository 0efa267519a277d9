"""diffusers / transformers configs inferred from an LDM single-file checkpoint's tensor shapes.

Invariant: every size comes from a shape in the file; only what shapes cannot tell comes from the family's
convention (the same conventions ``memory/tiny.py`` obeys): SD1 UNet attention has 8 heads, SD2/SDXL UNet heads
have 64 channels, CLIP heads have 64 channels, CLIP-L uses quick-GELU and OpenCLIP uses GELU, the two last
vocabulary entries are CLIP's start/end tokens, SD2's text encoder drops OpenCLIP's last layer (SD2 conditions on
the penultimate layer, so diffusers' SD2 text encoder has one layer fewer than the file), and the VAE scaling
factor is 0.18215 (SD1/SD2) or 0.13025 (SDXL).

The UNet and VAE configs go through diffusers' own ``create_unet_diffusers_config_from_ldm`` /
``create_vae_diffusers_config_from_ldm`` with an LDM-style ``original_config`` rebuilt from shapes (what the
original YAML would have said), so the conversion follows diffusers exactly; SDXL's added-conditioning sizes are
then set from shapes (diffusers hard-codes the full-size 256-channel time embedding).
"""
from __future__ import annotations

import re
from typing import Mapping, Sequence

from .families import UNET

Shapes = Mapping[str, Sequence[int]]

SCALING = {"sd1": 0.18215, "sd2": 0.18215, "sdxl": 0.13025}  # = configs/families.json
SD1_UNET_HEADS = 8
HEAD_CHANNELS = 64


class _ShapeOnly:
    def __init__(self, shape):
        self.shape = tuple(shape)


def shape_proxy(shapes: Shapes) -> dict:
    """A dict of objects with ``.shape`` (what diffusers' model-type guess reads) without loading tensors."""
    return {k: _ShapeOnly(v) for k, v in shapes.items()}


def _indices(shapes: Shapes, pattern: str) -> list[int]:
    rx = re.compile(pattern)
    return sorted({int(m.group(1)) for k in shapes for m in [rx.match(k)] if m})


def _need(shapes: Shapes, key: str) -> Sequence[int]:
    if key not in shapes:
        raise ValueError(f"checkpoint is missing tensor '{key}', which its family's layout requires; the file is "
                         f"incomplete or not a standard LDM checkpoint")
    return shapes[key]


# --------------------------------------------------------------------------------------------- UNet
def ldm_unet_params(shapes: Shapes, family: str) -> dict:
    """The ``unet_config.params`` an LDM YAML would hold for this checkpoint (rebuilt from shapes)."""
    p = UNET
    mc = _need(shapes, p + "input_blocks.0.0.weight")[0]
    blocks = _indices(shapes, re.escape(p) + r"input_blocks\.(\d+)\.")
    downs = [n for n in blocks if p + f"input_blocks.{n}.0.op.weight" in shapes]
    levels = len(downs) + 1
    if (len(blocks) - 1 - len(downs)) % levels:
        raise ValueError("checkpoint UNet has an irregular number of input blocks; not an SD-style UNet")
    per_level = (len(blocks) - 1 - len(downs)) // levels
    mult, attn_res, depth = [], [], []
    for i in range(levels):
        first = 1 + i * (per_level + 1)
        out_ch = _need(shapes, p + f"input_blocks.{first}.0.out_layers.3.weight")[0]
        mult.append(out_ch // mc)
        tb = _indices(shapes, re.escape(p + f"input_blocks.{first}.1.transformer_blocks.") + r"(\d+)\.")
        if tb:
            attn_res.append(2 ** i)
        depth.append(len(tb))
    to_k = next((k for k in shapes if k.startswith(p) and k.endswith("attn2.to_k.weight")), None)
    if to_k is None:
        raise ValueError("checkpoint UNet has no cross-attention (attn2.to_k) weights; not a text-to-image UNet")
    proj_in = next(k for k in shapes if k.startswith(p) and k.endswith(".proj_in.weight"))
    linear = len(shapes[proj_in]) == 2
    params = dict(in_channels=_need(shapes, p + "input_blocks.0.0.weight")[1],
                  out_channels=_need(shapes, p + "out.2.weight")[0], model_channels=mc, channel_mult=mult,
                  num_res_blocks=per_level, attention_resolutions=attn_res, context_dim=shapes[to_k][1],
                  use_linear_in_transformer=linear,
                  transformer_depth=depth if family == "sdxl" else max(depth))
    if family == "sd1":
        params["num_heads"] = SD1_UNET_HEADS
    else:
        params["num_head_channels"] = HEAD_CHANNELS
    if family == "sdxl":
        params["num_classes"] = "sequential"
        params["adm_in_channels"] = _need(shapes, p + "label_emb.0.0.weight")[1]
    return params


def ldm_vae_ddconfig(shapes: Shapes) -> dict:
    """The VAE ``ddconfig`` an LDM YAML would hold (rebuilt from shapes)."""
    p = "first_stage_model."
    ch = _need(shapes, p + "encoder.conv_in.weight")[0]
    levels = _indices(shapes, re.escape(p) + r"encoder\.down\.(\d+)\.")
    res = _indices(shapes, re.escape(p) + r"encoder\.down\.0\.block\.(\d+)\.")
    mult = [_need(shapes, p + f"encoder.down.{i}.block.0.conv2.weight")[0] // ch for i in levels]
    return dict(ch=ch, ch_mult=mult, num_res_blocks=len(res),
                in_channels=_need(shapes, p + "encoder.conv_in.weight")[1],
                out_ch=_need(shapes, p + "decoder.conv_out.weight")[0],
                z_channels=_need(shapes, p + "decoder.conv_in.weight")[1])


def original_config(shapes: Shapes, family: str) -> dict:
    return {"model": {"params": {"scale_factor": SCALING[family],
                                 "unet_config": {"params": ldm_unet_params(shapes, family)},
                                 "first_stage_config": {"params": {"ddconfig": ldm_vae_ddconfig(shapes)}}}}}


def unet_config(shapes: Shapes, family: str) -> dict:
    """diffusers ``UNet2DConditionModel`` config for the checkpoint (via diffusers' LDM config function)."""
    from diffusers.loaders.single_file_utils import create_unet_diffusers_config_from_ldm

    orig = original_config(shapes, family)
    config = create_unet_diffusers_config_from_ldm(orig, shape_proxy(shapes))
    if family == "sdxl":
        pooled = _need(shapes, "conditioner.embedders.1.model.text_projection")[1]
        adm = orig["model"]["params"]["unet_config"]["params"]["adm_in_channels"]
        if (adm - pooled) % 6:
            raise ValueError(f"SDXL label_emb input {adm} minus pooled width {pooled} is not 6 time-id embeddings")
        config.update(class_embed_type=None, addition_embed_type="text_time",
                      addition_time_embed_dim=(adm - pooled) // 6, projection_class_embeddings_input_dim=adm)
    return config


def vae_config(shapes: Shapes, family: str) -> dict:
    from diffusers.loaders.single_file_utils import create_vae_diffusers_config_from_ldm

    return create_vae_diffusers_config_from_ldm(original_config(shapes, family), shape_proxy(shapes),
                                                scaling_factor=SCALING[family])


# --------------------------------------------------------------------------------------------- text encoders
def clip_l_config(shapes: Shapes, prefix: str) -> dict:
    """``CLIPTextConfig`` kwargs for an HF-layout CLIP-L text model under ``prefix`` (``...transformer.``)."""
    t = prefix + "text_model."
    vocab, hidden = _need(shapes, t + "embeddings.token_embedding.weight")
    layers = _indices(shapes, re.escape(t + "encoder.layers.") + r"(\d+)\.")
    return dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=len(layers),
                intermediate_size=_need(shapes, t + "encoder.layers.0.mlp.fc1.weight")[0],
                num_attention_heads=max(1, hidden // HEAD_CHANNELS),
                max_position_embeddings=_need(shapes, t + "embeddings.position_embedding.weight")[0],
                hidden_act="quick_gelu", projection_dim=hidden, bos_token_id=vocab - 2, eos_token_id=vocab - 1,
                pad_token_id=vocab - 1)


def open_clip_config(shapes: Shapes, prefix: str, drop_last: bool) -> dict:
    """``CLIPTextConfig`` kwargs for an OpenCLIP text tower under ``prefix`` (``...model.``).

    ``drop_last``: SD2 conditions on the penultimate layer, so its diffusers text encoder omits the last block.
    """
    vocab, hidden = _need(shapes, prefix + "token_embedding.weight")
    layers = _indices(shapes, re.escape(prefix + "transformer.resblocks.") + r"(\d+)\.")
    n = len(layers) - (1 if drop_last else 0)
    if n < 1:
        raise ValueError(f"OpenCLIP text tower under '{prefix}' has {len(layers)} blocks; too few")
    proj = shapes.get(prefix + "text_projection")
    return dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=n,
                intermediate_size=_need(shapes, prefix + "transformer.resblocks.0.mlp.c_fc.weight")[0],
                num_attention_heads=max(1, hidden // HEAD_CHANNELS),
                max_position_embeddings=_need(shapes, prefix + "positional_embedding")[0], hidden_act="gelu",
                projection_dim=proj[1] if proj is not None else hidden, bos_token_id=vocab - 2,
                eos_token_id=vocab - 1, pad_token_id=vocab - 1)

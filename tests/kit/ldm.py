"""Test kit: write a tiny model as an original-LDM single-file ``.safetensors`` checkpoint.

The diffusers -> LDM key mapping here is written independently of diffusers' converters (which go the other
way), from the LDM layouts as the original repositories name them, so a loader test that round-trips through it
checks the loader's conversion against an independent description of the format:

- UNet ``model.diffusion_model.*``: ``input_blocks.N.{0 resnet | 1 transformer | 0.op downsample}``,
  ``middle_block.{0,1,2}``, ``output_blocks.N.{0 resnet | 1 transformer | 1 or 2 .conv upsample}``, resnets as
  ``in_layers.{0,2}``, ``emb_layers.1``, ``out_layers.{0,3}``, ``skip_connection``; ``time_embed.{0,2}``,
  ``label_emb.0.{0,2}`` (SDXL), ``out.{0,2}``.
- VAE ``first_stage_model.*``: ``encoder.down.i.block.j`` / ``decoder.up.(n-1-i).block.j`` (the decoder's LDM
  levels count from the bottom), ``mid.block_{1,2}``, ``mid.attn_1.{norm,q,k,v,proj_out}`` as 1x1 convolutions,
  ``nin_shortcut``, ``norm_out``.
- CLIP-L (HF layout): ``cond_stage_model.transformer.text_model.*`` (SD1), ``conditioner.embedders.0.transformer
  .text_model.*`` (SDXL).
- OpenCLIP: ``token_embedding``, ``positional_embedding``, ``transformer.resblocks.k.{ln_1, attn.in_proj_weight
  (q;k;v stacked), attn.out_proj, ln_2, mlp.c_fc, mlp.c_proj}``, ``ln_final``, ``text_projection`` ([width, dim],
  applied as ``x @ P``) under ``cond_stage_model.model.`` (SD2) or ``conditioner.embedders.1.model.`` (SDXL).
  SD2 files, like the real ones, hold one block more than the text encoder uses (SD2 conditions on the penultimate
  layer): the kit appends a random extra block.
- ``v_pred``: an empty tensor marking a v-prediction model (ComfyUI's convention).
"""
from __future__ import annotations

from pathlib import Path

import torch

from ...memory.tiny import write_tiny_clip_tokenizer

_RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "time_emb_proj": "emb_layers.1", "norm2": "out_layers.0",
           "conv2": "out_layers.3", "conv_shortcut": "skip_connection"}


def _sub(sd: dict, prefix: str) -> dict:
    return {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}


def unet_to_ldm(unet: torch.nn.Module) -> dict:
    sd = unet.state_dict()
    cfg = unet.config
    L = cfg.layers_per_block
    out: dict[str, torch.Tensor] = {}

    def put(ldm: str, tensor):
        out["model.diffusion_model." + ldm] = tensor

    def resnet(src: str, dst: str):
        for k, v in _sub(sd, src + ".").items():
            name, leaf = k.rsplit(".", 1)
            put(f"{dst}.{_RESNET[name]}.{leaf}", v)

    def attention(src: str, dst: str):
        for k, v in _sub(sd, src + ".").items():
            put(f"{dst}.{k}", v)  # transformer internals share their names in both layouts

    for src, dst in (("time_embedding.linear_1", "time_embed.0"), ("time_embedding.linear_2", "time_embed.2"),
                     ("add_embedding.linear_1", "label_emb.0.0"), ("add_embedding.linear_2", "label_emb.0.2"),
                     ("conv_in", "input_blocks.0.0"), ("conv_norm_out", "out.0"), ("conv_out", "out.2")):
        for leaf in ("weight", "bias"):
            if f"{src}.{leaf}" in sd:
                put(f"{dst}.{leaf}", sd[f"{src}.{leaf}"])
    for i, block in enumerate(unet.down_blocks):
        for j in range(len(block.resnets)):
            n = 1 + i * (L + 1) + j
            resnet(f"down_blocks.{i}.resnets.{j}", f"input_blocks.{n}.0")
            if getattr(block, "attentions", None) is not None and j < len(block.attentions):
                attention(f"down_blocks.{i}.attentions.{j}", f"input_blocks.{n}.1")
        if block.downsamplers is not None:
            n = 1 + i * (L + 1) + L
            for leaf in ("weight", "bias"):
                put(f"input_blocks.{n}.0.op.{leaf}", sd[f"down_blocks.{i}.downsamplers.0.conv.{leaf}"])
    resnet("mid_block.resnets.0", "middle_block.0")
    attention("mid_block.attentions.0", "middle_block.1")
    resnet("mid_block.resnets.1", "middle_block.2")
    for i, block in enumerate(unet.up_blocks):
        has_attn = getattr(block, "attentions", None) is not None
        for j in range(len(block.resnets)):
            n = i * (L + 1) + j
            resnet(f"up_blocks.{i}.resnets.{j}", f"output_blocks.{n}.0")
            if has_attn:
                attention(f"up_blocks.{i}.attentions.{j}", f"output_blocks.{n}.1")
        if block.upsamplers is not None:
            n = i * (L + 1) + L
            pos = 2 if has_attn else 1
            for leaf in ("weight", "bias"):
                put(f"output_blocks.{n}.{pos}.conv.{leaf}", sd[f"up_blocks.{i}.upsamplers.0.conv.{leaf}"])
    return out


def vae_to_ldm(vae: torch.nn.Module) -> dict:
    sd = vae.state_dict()
    n_levels = len(vae.config.block_out_channels)
    out: dict[str, torch.Tensor] = {}

    def put(ldm: str, tensor):
        out["first_stage_model." + ldm] = tensor

    def resnet(src: str, dst: str):
        for k, v in _sub(sd, src + ".").items():
            put(f"{dst}.{k.replace('conv_shortcut', 'nin_shortcut')}", v)

    def mid(part: str):
        resnet(f"{part}.mid_block.resnets.0", f"{part}.mid.block_1")
        resnet(f"{part}.mid_block.resnets.1", f"{part}.mid.block_2")
        names = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}
        for src, dst in names.items():
            for leaf in ("weight", "bias"):
                v = sd[f"{part}.mid_block.attentions.0.{src}.{leaf}"]
                if leaf == "weight" and dst != "norm":
                    v = v[:, :, None, None]  # LDM's attention projections are 1x1 convolutions
                put(f"{part}.mid.attn_1.{dst}.{leaf}", v)

    for part in ("encoder", "decoder"):
        for src, dst in (("conv_in", "conv_in"), ("conv_out", "conv_out"), ("conv_norm_out", "norm_out")):
            for leaf in ("weight", "bias"):
                put(f"{part}.{dst}.{leaf}", sd[f"{part}.{src}.{leaf}"])
        mid(part)
    for leaf in ("weight", "bias"):
        put(f"quant_conv.{leaf}", sd[f"quant_conv.{leaf}"])
        put(f"post_quant_conv.{leaf}", sd[f"post_quant_conv.{leaf}"])
    for i, block in enumerate(vae.encoder.down_blocks):
        for j in range(len(block.resnets)):
            resnet(f"encoder.down_blocks.{i}.resnets.{j}", f"encoder.down.{i}.block.{j}")
        if block.downsamplers is not None:
            for leaf in ("weight", "bias"):
                put(f"encoder.down.{i}.downsample.conv.{leaf}", sd[f"encoder.down_blocks.{i}.downsamplers.0.conv.{leaf}"])
    for i, block in enumerate(vae.decoder.up_blocks):
        level = n_levels - 1 - i
        for j in range(len(block.resnets)):
            resnet(f"decoder.up_blocks.{i}.resnets.{j}", f"decoder.up.{level}.block.{j}")
        if block.upsamplers is not None:
            for leaf in ("weight", "bias"):
                put(f"decoder.up.{level}.upsample.conv.{leaf}", sd[f"decoder.up_blocks.{i}.upsamplers.0.conv.{leaf}"])
    return out


def _hf_text_state(model: torch.nn.Module) -> dict:
    """The text model's state dict with the ``text_model.`` prefix real checkpoints carry (whatever transformers)."""
    sd = model.state_dict()
    out = {}
    for k, v in sd.items():
        if k.startswith("text_projection"):
            continue
        out[k if k.startswith("text_model.") else "text_model." + k] = v
    return out


def clip_l_to_ldm(model: torch.nn.Module, prefix: str) -> dict:
    return {prefix + k: v for k, v in _hf_text_state(model).items()}


def open_clip_to_ldm(model: torch.nn.Module, prefix: str, extra_block: bool = False, seed: int = 1) -> dict:
    sd = _hf_text_state(model)
    t = "text_model."
    hidden = sd[t + "embeddings.token_embedding.weight"].shape[1]
    layers = sorted({int(k.split(".")[3]) for k in sd if k.startswith(t + "encoder.layers.")})
    out = {prefix + "token_embedding.weight": sd[t + "embeddings.token_embedding.weight"],
           prefix + "positional_embedding": sd[t + "embeddings.position_embedding.weight"],
           prefix + "ln_final.weight": sd[t + "final_layer_norm.weight"],
           prefix + "ln_final.bias": sd[t + "final_layer_norm.bias"]}
    for k in layers:
        src, dst = f"{t}encoder.layers.{k}.", f"{prefix}transformer.resblocks.{k}."
        for leaf in ("weight", "bias"):
            out[dst + f"attn.in_proj_{leaf}"] = torch.cat([sd[src + f"self_attn.{p}_proj.{leaf}"] for p in "qkv"])
            out[dst + f"attn.out_proj.{leaf}"] = sd[src + f"self_attn.out_proj.{leaf}"]
            out[dst + f"ln_1.{leaf}"] = sd[src + f"layer_norm1.{leaf}"]
            out[dst + f"ln_2.{leaf}"] = sd[src + f"layer_norm2.{leaf}"]
            out[dst + f"mlp.c_fc.{leaf}"] = sd[src + f"mlp.fc1.{leaf}"]
            out[dst + f"mlp.c_proj.{leaf}"] = sd[src + f"mlp.fc2.{leaf}"]
    g = torch.Generator().manual_seed(seed)
    if extra_block:  # the unused last block of SD2's OpenCLIP tower
        k = len(layers)
        last = {n[len(f"{prefix}transformer.resblocks.{k - 1}."):]: v for n, v in out.items()
                if n.startswith(f"{prefix}transformer.resblocks.{k - 1}.")}
        for name, v in last.items():
            out[f"{prefix}transformer.resblocks.{k}.{name}"] = torch.randn(v.shape, generator=g, dtype=v.dtype)
    proj = getattr(model, "text_projection", None)
    if proj is not None:
        out[prefix + "text_projection"] = proj.weight.detach().T.contiguous()
    else:  # SD2's tower has a projection the SD2 pipeline never uses
        out[prefix + "text_projection"] = torch.randn(hidden, hidden, generator=g) / hidden ** 0.5
    return out


def ldm_state_dict(components: dict, v_pred: bool = False) -> dict:
    """The LDM single-file state dict of a tiny model's components (see the module docstring for the layout)."""
    family = components["family"]
    sd = {**unet_to_ldm(components["unet"]), **vae_to_ldm(components["vae"])}
    if family == "sd1":
        sd.update(clip_l_to_ldm(components["text_encoder"], "cond_stage_model.transformer."))
    elif family in ("sd2", "sd2-v"):
        sd.update(open_clip_to_ldm(components["text_encoder"], "cond_stage_model.model.", extra_block=True))
    elif family == "sdxl":
        sd.update(clip_l_to_ldm(components["text_encoder"], "conditioner.embedders.0.transformer."))
        sd.update(open_clip_to_ldm(components["text_encoder_2"], "conditioner.embedders.1.model."))
    else:
        raise ValueError(f"family={family!r}: the kit writes sd1, sd2, sd2-v and sdxl checkpoints")
    if v_pred or family == "sd2-v":
        sd["v_pred"] = torch.tensor([])
    return sd


def save_ldm_checkpoint(components: dict, path: str | Path, v_pred: bool = False, tokenizer: bool = True,
                        dtype: torch.dtype | None = None) -> Path:
    """Write ``components`` as an LDM single-file ``.safetensors`` at ``path``.

    ``tokenizer``: also write the tiny CLIP tokenizer files to ``<path's folder>/tokenizer/`` (where the loader
    looks for a single file's tokenizer). ``dtype``: cast floating tensors (e.g. fp16 like real checkpoints).
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sd = ldm_state_dict(components, v_pred=v_pred)
    sd = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().contiguous().clone()
          for k, v in sd.items()}
    save_file(sd, str(path))
    if tokenizer:
        write_tiny_clip_tokenizer(path.parent / "tokenizer")
    return path

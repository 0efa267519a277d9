"""Build a ``Program`` from a VAE's module tree: diffusers ``AutoencoderKL``, ComfyUI's (LDM) ``AutoencoderKL``, or a
Wan-style causal 3D VAE (diffusers ``AutoencoderKLQwenImage``, built by ``causal3d.py``).

Invariant: the stages list the same modules in the same order as the autoencoder's own ``forward`` (see
``program.py``), so the tiled executor computes exactly the module's function. Architectures are recognised by
their module attributes (``decoder.up_blocks`` for diffusers, ``decoder.up`` + ``decoder.mid.block_1`` for LDM),
never by class names; anything outside the supported shape (temb, 3x3 shortcuts, SpatialNorm, transposed
upsampling, tanh output...) raises ``TypeError`` naming what is unsupported, so no silent approximation happens.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import causal3d
from .attention import NEEDS_COMFYUI, spec_from_diffusers, spec_from_ldm
from .program import Op, Program, Stage


def _unsupported(what: str) -> TypeError:
    return TypeError(f"unsupported {what}; {NEEDS_COMFYUI}")


def _conv(module, what: str) -> Op:
    ks = tuple(module.kernel_size)
    stride, dil = tuple(module.stride), tuple(module.dilation)
    pad = tuple(module.padding) if not isinstance(module.padding, str) else module.padding
    if stride == (1, 1) and dil == (1, 1) and module.groups == 1:
        if ks == (1, 1) and pad in ((0, 0), "valid"):
            return Op("conv1", module)
        if ks == (3, 3) and pad == (1, 1) and getattr(module, "padding_mode", "zeros") == "zeros":
            return Op("conv3", module)
    mode = getattr(module, "padding_mode", "zeros")
    extra = "".join(text for bad, text in ((mode != "zeros", f", padding_mode {mode!r}"),
                                           (module.groups != 1, f", groups {module.groups}"),
                                           (dil != (1, 1), f", dilation {dil}")) if bad)
    raise _unsupported(f"convolution at {what}: kernel {ks}, stride {stride}, padding {pad}{extra}")


def _gn(module, what: str) -> Op:
    if not isinstance(module, torch.nn.GroupNorm):
        raise _unsupported(f"normalisation at {what}: {type(module).__name__} (expected a GroupNorm)")
    return Op("gn", module)


def _silu_check(act, what: str) -> None:
    if act is not None and not isinstance(act, torch.nn.SiLU):
        raise _unsupported(f"activation at {what}: {type(act).__name__} (expected SiLU)")


def _resnet(block, name: str, diffusers: bool) -> Stage:
    if diffusers:
        if block.upsample is not None or block.downsample is not None:
            raise _unsupported(f"ResNet block with resampling at {name}")
        _silu_check(block.nonlinearity, name)
        shortcut = block.conv_shortcut
        scale = float(block.output_scale_factor)
    else:
        if getattr(block, "use_conv_shortcut", False) and block.in_channels != block.out_channels:
            raise _unsupported(f"3x3 shortcut at {name}")
        shortcut = getattr(block, "nin_shortcut", None) if block.in_channels != block.out_channels else None
        scale = 1.0
    if shortcut is not None and _conv(shortcut, f"{name}.shortcut").kind != "conv1":
        raise _unsupported(f"3x3 shortcut at {name}")
    ops = [_gn(block.norm1, f"{name}.norm1"), Op("silu"), _conv(block.conv1, f"{name}.conv1"),
           _gn(block.norm2, f"{name}.norm2"), Op("silu"), _conv(block.conv2, f"{name}.conv2")]
    return Stage("chain", ops, residual_src=0, shortcut=shortcut, output_scale=scale, name=name)


def _upsample_diffusers(up, name: str) -> Stage:
    if getattr(up, "use_conv_transpose", False) or not getattr(up, "interpolate", True) or up.norm is not None \
            or not up.use_conv:
        raise _unsupported(f"upsampler at {name}")
    conv = up.conv if up.name == "conv" else up.Conv2d_0
    return Stage("chain", [Op("up2"), _conv(conv, f"{name}.conv")], name=name)


def _downsample(conv, name: str, padding: int) -> Stage:
    ks, stride = tuple(conv.kernel_size), tuple(conv.stride)
    pad = tuple(conv.padding) if not isinstance(conv.padding, str) else conv.padding
    if padding != 0 or ks != (3, 3) or stride != (2, 2) or pad not in ((0, 0), "valid"):
        raise _unsupported(f"downsampler at {name}")
    return Stage("chain", [Op("down2", conv)], name=name)


def _tail(norm, act, conv, name: str) -> Stage:
    _silu_check(act, name)
    return Stage("chain", [_gn(norm, f"{name}.norm"), Op("silu"), _conv(conv, f"{name}.conv_out")], name=name)


def _attention(block, name: str, diffusers: bool) -> Stage:
    spec = spec_from_diffusers(block, name) if diffusers else spec_from_ldm(block)
    return Stage("attention", attention=spec, name=name)


def is_diffusers(ae) -> bool:
    return hasattr(getattr(ae, "decoder", None), "up_blocks")


def is_ldm(ae) -> bool:
    dec = getattr(ae, "decoder", None)
    return hasattr(dec, "up") and hasattr(getattr(dec, "mid", None), "block_1")


def _check(ae) -> bool:
    if is_diffusers(ae):
        return True
    if is_ldm(ae):
        return False
    raise TypeError(f"vae: {type(ae).__name__} is neither a diffusers AutoencoderKL nor a ComfyUI/LDM AutoencoderKL "
                    f"(no decoder.up_blocks or decoder.up); exact tiling supports those two and diffusers' "
                    f"AutoencoderKLQwenImage (ComfyUI's own Wan / Qwen-Image VAE module is not supported yet: load "
                    f"the VAE with the Memory Pool Loader and connect lean_model instead); {NEEDS_COMFYUI}")


def _resampling_factor(stages: list, kind: str) -> int:
    """2 ** (number of 2x resamplers): 8 for SD / SDXL / 16-channel VAEs (3 of 4 levels resample), 4 or 16 for
    3- or 5-level autoencoders, which the row algebra handles the same way."""
    return 2 ** sum(1 for st in stages for op in st.ops if op.kind == kind)


def _mid_stages(mid, diffusers: bool) -> list[Stage]:
    """The middle block (ResNet, attention, ResNet), the same in the encoder and the decoder."""
    if not diffusers:
        return [_resnet(mid.block_1, "mid.block_1", False), _attention(mid.attn_1, "mid.attn_1", False),
                _resnet(mid.block_2, "mid.block_2", False)]
    stages = [_resnet(mid.resnets[0], "mid.resnets.0", True)]
    for i, (attn, res) in enumerate(zip(mid.attentions, mid.resnets[1:])):
        if attn is not None:
            stages.append(_attention(attn, f"mid.attentions.{i}", True))
        stages.append(_resnet(res, f"mid.resnets.{i + 1}", True))
    return stages


def decoder_program(ae) -> Program:
    """Stages of ``post_quant_conv`` + decoder of ``ae`` (diffusers or LDM ``AutoencoderKL``, causal 3D VAE)."""
    if causal3d.is_causal3d(ae):
        return causal3d.decoder_program(ae)
    diff = _check(ae)
    dec = ae.decoder
    head: list[Op] = []
    pqc: Optional[torch.nn.Module] = getattr(ae, "post_quant_conv", None)
    if pqc is not None:
        head.append(_conv(pqc, "post_quant_conv"))
    stages = []
    if diff:
        if getattr(dec, "up_blocks", None) is None or type(dec.conv_norm_out).__name__ == "SpatialNorm":
            raise _unsupported("diffusers decoder (SpatialNorm)")
        stages.append(Stage("chain", head + [_conv(dec.conv_in, "decoder.conv_in")], name="conv_in"))
        stages += _mid_stages(dec.mid_block, True)
        for bi, block in enumerate(dec.up_blocks):
            if getattr(block, "attentions", None):
                raise _unsupported(f"attention in decoder up block {bi}")
            for ri, res in enumerate(block.resnets):
                stages.append(_resnet(res, f"up_blocks.{bi}.resnets.{ri}", True))
            for ui, up in enumerate(block.upsamplers or []):
                stages.append(_upsample_diffusers(up, f"up_blocks.{bi}.upsamplers.{ui}"))
        stages.append(_tail(dec.conv_norm_out, dec.conv_act, dec.conv_out, "decoder.out"))
        out_ch = int(dec.conv_out.out_channels)
    else:
        if getattr(dec, "give_pre_end", False) or getattr(dec, "tanh_out", False):
            raise _unsupported("LDM decoder (give_pre_end/tanh_out)")
        stages.append(Stage("chain", head + [_conv(dec.conv_in, "decoder.conv_in")], name="conv_in"))
        stages += _mid_stages(dec.mid, False)
        for i_level in reversed(range(dec.num_resolutions)):
            up = dec.up[i_level]
            for i_block, block in enumerate(up.block):
                stages.append(_resnet(block, f"up.{i_level}.block.{i_block}", False))
                if len(up.attn) > 0:
                    stages.append(_attention(up.attn[i_block], f"up.{i_level}.attn.{i_block}", False))
            if i_level != 0:
                if not getattr(up.upsample, "with_conv", False) or up.upsample.scale_factor not in (2, 2.0):
                    raise _unsupported(f"upsampler at up.{i_level}")
                stages.append(Stage("chain", [Op("up2"), _conv(up.upsample.conv, f"up.{i_level}.upsample.conv")],
                                    name=f"up.{i_level}.upsample"))
        stages.append(_tail(dec.norm_out, None, dec.conv_out, "decoder.out"))
        out_ch = int(dec.conv_out.out_channels)
    in_ch = int((pqc if pqc is not None else dec.conv_in).in_channels)
    return Program(stages, in_ch, out_ch, _resampling_factor(stages, "up2"), "decoder", latent_channels=in_ch)


def encoder_program(ae) -> Program:
    """Stages of encoder + ``quant_conv`` of ``ae``; the output holds the moments (mean first)."""
    if causal3d.is_causal3d(ae):
        return causal3d.encoder_program(ae)
    diff = _check(ae)
    enc = ae.encoder
    stages = [Stage("chain", [_conv(enc.conv_in, "encoder.conv_in")], name="conv_in")]
    if diff:
        for bi, block in enumerate(enc.down_blocks):
            if getattr(block, "attentions", None):
                raise _unsupported(f"attention in encoder down block {bi}")
            for ri, res in enumerate(block.resnets):
                stages.append(_resnet(res, f"down_blocks.{bi}.resnets.{ri}", True))
            for di, down in enumerate(block.downsamplers or []):
                if not down.use_conv or down.norm is not None:
                    raise _unsupported(f"downsampler at down_blocks.{bi}")
                stages.append(_downsample(down.conv, f"down_blocks.{bi}.downsamplers.{di}", down.padding))
        stages += _mid_stages(enc.mid_block, True)
        tail = _tail(enc.conv_norm_out, enc.conv_act, enc.conv_out, "encoder.out")
    else:
        for i_level in range(enc.num_resolutions):
            down = enc.down[i_level]
            for i_block, block in enumerate(down.block):
                stages.append(_resnet(block, f"down.{i_level}.block.{i_block}", False))
                if len(down.attn) > 0:
                    stages.append(_attention(down.attn[i_block], f"down.{i_level}.attn.{i_block}", False))
            if i_level != enc.num_resolutions - 1:
                if not getattr(down.downsample, "with_conv", False):
                    raise _unsupported(f"average-pool downsampler at down.{i_level}")
                stages.append(_downsample(down.downsample.conv, f"down.{i_level}.downsample", 0))
        stages += _mid_stages(enc.mid, False)
        tail = _tail(enc.norm_out, None, enc.conv_out, "encoder.out")
    qc = getattr(ae, "quant_conv", None)
    if qc is not None:
        tail.ops.append(_conv(qc, "quant_conv"))
    stages.append(tail)
    out_ch = int((qc if qc is not None else enc.conv_out).out_channels)
    return Program(stages, int(enc.conv_in.in_channels), out_ch, -_resampling_factor(stages, "down2"), "encoder",
                   latent_channels=out_ch // 2)

"""``Program``s for Wan 2.1-style causal 3D VAEs on one frame (diffusers ``AutoencoderKLQwenImage``, Qwen-Image's VAE).

Invariant: for an image (one frame, ``T = 1``) the stages compute exactly what the autoencoder's own ``_encode`` /
``_decode`` compute for that frame, in the same module order, so the tiled executor (``exact.py``) equals the
untiled module up to floating-point error. Why it holds, op by op:

- A causal ``Conv3d`` pads the time axis with ``k_t - 1`` zero frames in front and none behind, so on a single frame
  only its last time tap meets real data: it is the 2D convolution with ``weight[:, :, -1]`` and the module's bias
  and spatial padding (``FrameConv``). The first frame of the feature cache is that same zero padding.
- The temporal halves of the resamplers (``time_conv`` of ``upsample3d`` / ``downsample3d``) do not run on the first
  frame ("Rep" / cache-only in ``QwenImageResample.forward``), so every resampler is its spatial part: nearest 2x
  upsampling (``nearest-exact`` equals ``nearest`` at scale 2) + 3x3 convolution, or zero pad right / bottom + 3x3
  stride-2 convolution (``program.py``'s ``up2`` / ``down2``).
- The norms are RMS norms over the channels of each pixel (``F.normalize(x, dim=1) * sqrt(C) * gamma + bias``): row-
  local, so they need no whole-image statistics (``ChannelRMSNorm``, op kind ``rms``). ``blend`` therefore has nothing
  to estimate and computes what ``exact`` does.
- The mid-block attention (one head, RMS norm, one 1x1 ``to_qkv`` convolution split into queries, keys and values in
  that order, 1x1 ``proj``, residual) is an ``AttentionSpec`` with a per-pixel norm, run in bands by
  ``attention_bands`` like any VAE attention.

Anything outside this shape (a time stride, a non-causal padding, another activation) raises ``TypeError`` naming it.
Architectures are recognised by module attributes (``is_causal3d``), never by class names.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .attention import NEEDS_COMFYUI, AttentionSpec
from .program import Op, Program, Stage


def _unsupported(what: str) -> TypeError:
    return TypeError(f"unsupported causal 3D VAE {what}; {NEEDS_COMFYUI}")


def is_causal3d(ae) -> bool:
    """A diffusers Wan-style VAE: a decoder with ``up_blocks`` whose ``conv_in`` is a 3D convolution."""
    dec = getattr(ae, "decoder", None)
    return hasattr(dec, "up_blocks") and isinstance(getattr(dec, "conv_in", None), torch.nn.Conv3d)


class FrameConv:
    """A causal ``Conv3d`` as the 2D convolution it computes on a single frame (module docstring); it reads the
    module's weight and bias at each call, so it follows the module wherever a VRAM policy places it. Exposes the
    attributes ``program.Op`` and ``estimated_stats`` read from a ``Conv2d``."""

    stride = (1, 1)
    dilation = (1, 1)
    groups = 1
    padding_mode = "zeros"

    def __init__(self, conv: torch.nn.Conv3d, what: str):
        kt, kh, kw = (int(k) for k in conv.kernel_size)
        pad = tuple(int(p) for p in getattr(conv, "_padding", ()))  # (w, w, h, h, t front, t back) for F.pad
        if len(pad) != 6 or tuple(conv.padding) != (0, 0, 0) or pad[4] != kt - 1 or pad[5] != 0:
            raise _unsupported(f"convolution at {what}: not causal in time (padding {pad or tuple(conv.padding)})")
        if tuple(conv.stride) != (1, 1, 1) or tuple(conv.dilation) != (1, 1, 1) or conv.groups != 1 \
                or conv.padding_mode != "zeros" or pad[0] != pad[1] or pad[2] != pad[3]:
            raise _unsupported(f"convolution at {what}: stride {tuple(conv.stride)}, dilation {tuple(conv.dilation)}, "
                               f"groups {conv.groups}, padding {pad}")
        self.conv = conv
        self.in_channels, self.out_channels = int(conv.in_channels), int(conv.out_channels)
        self.kernel_size = (kh, kw)
        self.padding = (pad[2], pad[0])

    @property
    def weight(self) -> torch.Tensor:
        return self.conv.weight[:, :, -1]

    @property
    def bias(self) -> Optional[torch.Tensor]:
        return self.conv.bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.weight, self.bias, padding=self.padding)


class ChannelRMSNorm:
    """A Wan RMS norm (``gamma``, ``scale``, optional ``bias``, channels first) on ``[B, C, H, W]``: the module's own
    arithmetic (normalised in fp32 for fp16 / bf16 inputs, cast back, then ``* scale * gamma + bias``)."""

    def __init__(self, norm, what: str):
        if not (hasattr(norm, "gamma") and hasattr(norm, "scale") and getattr(norm, "channel_first", False)):
            raise _unsupported(f"normalisation at {what}: {type(norm).__name__} (expected a channel-first RMS norm)")
        self.norm = norm

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = self.norm
        half = x.dtype in (torch.float16, torch.bfloat16)
        y = F.normalize(x.float() if half else x, dim=1).to(x.dtype) * m.scale * m.gamma.reshape(1, -1, 1, 1)
        bias = m.bias
        return y + bias.reshape(1, -1, 1, 1) if isinstance(bias, torch.Tensor) else y + bias


def _frame_conv(conv, what: str) -> Op:
    """A causal 3D convolution (or a plain 2D one) as a ``conv1`` / ``conv3`` op."""
    module = FrameConv(conv, what) if isinstance(conv, torch.nn.Conv3d) else conv
    if not isinstance(module, FrameConv):
        if not isinstance(conv, torch.nn.Conv2d) or tuple(conv.stride) != (1, 1) or tuple(conv.dilation) != (1, 1) \
                or conv.groups != 1 or conv.padding_mode != "zeros":
            raise _unsupported(f"convolution at {what}: {conv!r}")
    kernel, pad = tuple(module.kernel_size), tuple(module.padding)
    if kernel == (1, 1) and pad == (0, 0):
        return Op("conv1", module)
    if kernel == (3, 3) and pad == (1, 1):
        return Op("conv3", module)
    raise _unsupported(f"convolution at {what}: kernel {kernel}, padding {pad}")


def _silu_check(act, what: str) -> None:
    if not isinstance(act, torch.nn.SiLU):
        raise _unsupported(f"activation at {what}: {type(act).__name__} (expected SiLU)")


def _resnet(block, name: str) -> Stage:
    _silu_check(block.nonlinearity, name)
    shortcut = None
    if not isinstance(block.conv_shortcut, torch.nn.Identity):
        op = _frame_conv(block.conv_shortcut, f"{name}.conv_shortcut")
        if op.kind != "conv1":
            raise _unsupported(f"3x3 shortcut at {name}")
        shortcut = op.module
    ops = [Op("rms", ChannelRMSNorm(block.norm1, f"{name}.norm1")), Op("silu"),
           _frame_conv(block.conv1, f"{name}.conv1"),
           Op("rms", ChannelRMSNorm(block.norm2, f"{name}.norm2")), Op("silu"),
           _frame_conv(block.conv2, f"{name}.conv2")]
    return Stage("chain", ops, residual_src=0, shortcut=shortcut, name=name)


def _qkv_part(conv: torch.nn.Conv2d, part: int, channels: int):
    """Tokens ``[B, N, C]`` -> the ``part``-th block of ``channels`` output channels of the 1x1 convolution ``conv``."""
    rows = slice(part * channels, (part + 1) * channels)

    def apply(t: torch.Tensor) -> torch.Tensor:
        bias = None if conv.bias is None else conv.bias[rows]
        return F.linear(t, conv.weight[rows, :, 0, 0], bias)

    return apply


def _attention(block, name: str) -> Stage:
    c = int(block.dim)
    qkv, proj = block.to_qkv, block.proj
    for conv, out in ((qkv, 3 * c), (proj, c)):
        if not isinstance(conv, torch.nn.Conv2d) or tuple(conv.kernel_size) != (1, 1) or conv.out_channels != out:
            raise _unsupported(f"attention projection at {name}: {conv!r}")
    spec = AttentionSpec(ChannelRMSNorm(block.norm, f"{name}.norm"), _qkv_part(qkv, 0, c), _qkv_part(qkv, 1, c),
                         _qkv_part(qkv, 2, c), _qkv_part(proj, 0, c), heads=1, pointwise_norm=True)
    return Stage("attention", attention=spec, name=name)


def _mid_stages(mid) -> list[Stage]:
    stages = [_resnet(mid.resnets[0], "mid_block.resnets.0")]
    for i, (attn, res) in enumerate(zip(mid.attentions, mid.resnets[1:])):
        if attn is not None:
            stages.append(_attention(attn, f"mid_block.attentions.{i}"))
        stages.append(_resnet(res, f"mid_block.resnets.{i + 1}"))
    return stages


def _upsample(resample, name: str) -> Stage:
    if resample.mode not in ("upsample2d", "upsample3d"):
        raise _unsupported(f"upsampler at {name}: mode {resample.mode!r}")
    up, conv = resample.resample[0], resample.resample[1]
    scale = tuple(float(s) for s in up.scale_factor) if isinstance(up.scale_factor, tuple) else (up.scale_factor,) * 2
    if up.mode not in ("nearest", "nearest-exact") or scale != (2.0, 2.0):
        raise _unsupported(f"upsampler at {name}: {up.mode} x{scale}")
    return Stage("chain", [Op("up2"), _frame_conv(conv, f"{name}.resample.1")], name=name)


def _downsample(resample, name: str) -> Stage:
    if resample.mode not in ("downsample2d", "downsample3d"):
        raise _unsupported(f"downsampler at {name}: mode {resample.mode!r}")
    pad, conv = resample.resample[0], resample.resample[1]
    if not isinstance(pad, torch.nn.ZeroPad2d) or tuple(pad.padding) != (0, 1, 0, 1) \
            or tuple(conv.kernel_size) != (3, 3) or tuple(conv.stride) != (2, 2) or tuple(conv.padding) != (0, 0):
        raise _unsupported(f"downsampler at {name}")
    return Stage("chain", [Op("down2", conv)], name=name)


def _tail(norm, act, conv, name: str, extra: Optional[Op] = None) -> Stage:
    _silu_check(act, name)
    ops = [Op("rms", ChannelRMSNorm(norm, f"{name}.norm_out")), Op("silu"), _frame_conv(conv, f"{name}.conv_out")]
    return Stage("chain", ops + ([extra] if extra is not None else []), name=name)


def _factor(stages: list, kind: str) -> int:
    return 2 ** sum(1 for st in stages for op in st.ops if op.kind == kind)


def decoder_program(ae) -> Program:
    """Stages of ``post_quant_conv`` + decoder of a causal 3D VAE, for one frame."""
    dec = ae.decoder
    stages = [Stage("chain", [_frame_conv(ae.post_quant_conv, "post_quant_conv"),
                              _frame_conv(dec.conv_in, "decoder.conv_in")], name="conv_in")]
    stages += _mid_stages(dec.mid_block)
    for bi, block in enumerate(dec.up_blocks):
        for ri, res in enumerate(block.resnets):
            stages.append(_resnet(res, f"up_blocks.{bi}.resnets.{ri}"))
        for ui, up in enumerate(block.upsamplers or []):
            stages.append(_upsample(up, f"up_blocks.{bi}.upsamplers.{ui}"))
    stages.append(_tail(dec.norm_out, dec.nonlinearity, dec.conv_out, "decoder.out"))
    in_ch = int(ae.post_quant_conv.in_channels)
    return Program(stages, in_ch, int(dec.conv_out.out_channels), _factor(stages, "up2"), "decoder",
                   latent_channels=in_ch)


def encoder_program(ae) -> Program:
    """Stages of encoder + ``quant_conv`` of a causal 3D VAE, for one frame; the output holds the moments (mean
    first, as ``DiagonalGaussianDistribution`` splits them)."""
    enc = ae.encoder
    stages = [Stage("chain", [_frame_conv(enc.conv_in, "encoder.conv_in")], name="conv_in")]
    for i, layer in enumerate(enc.down_blocks):
        name = f"down_blocks.{i}"
        if hasattr(layer, "to_qkv"):  # ``attn_scales``: diffusers' own encoder cannot run these blocks either
            raise _unsupported(f"attention block in the encoder's down blocks at {name}")
        if hasattr(layer, "resample"):
            stages.append(_downsample(layer, name))
        else:
            stages.append(_resnet(layer, name))
    stages += _mid_stages(enc.mid_block)
    stages.append(_tail(enc.norm_out, enc.nonlinearity, enc.conv_out, "encoder.out",
                        _frame_conv(ae.quant_conv, "quant_conv")))
    out_ch = int(ae.quant_conv.out_channels)
    return Program(stages, int(enc.conv_in.in_channels), out_ch, -_factor(stages, "down2"), "encoder",
                   latent_channels=out_ch // 2)

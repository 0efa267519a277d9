"""A stand-in for ComfyUI's native VAE, built without importing ComfyUI.

ComfyUI's ``VAE`` wraps ``first_stage_model``, an LDM ``AutoencoderKL`` whose ``encoder``/``decoder`` use the module
names of ``comfy/ldm/modules/diffusionmodules/model.py`` (``conv_in``, ``down[i].block/attn/downsample``,
``mid.block_1/attn_1/block_2``, ``up[i].block/attn/upsample``, ``norm_out``, ``conv_out``; ResNet blocks with
``norm1/conv1/norm2/conv2/nin_shortcut``; attention with 1x1 ``q/k/v/proj_out``). This file rebuilds that tree from
the architecture's description with plain torch modules and LDM's forward semantics (written here, not copied),
and fills it from a diffusers ``AutoencoderKL`` so both trees compute the same function.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def _norm(c):
    return nn.GroupNorm(32, c, eps=1e-6, affine=True)


class ResnetBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.in_channels, self.out_channels, self.use_conv_shortcut = cin, cout, False
        self.norm1, self.conv1 = _norm(cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2, self.conv2 = _norm(cout), nn.Conv2d(cout, cout, 3, padding=1)
        if cin != cout:
            self.nin_shortcut = nn.Conv2d(cin, cout, 1)

    def forward(self, x, temb=None):
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return (self.nin_shortcut(x) if self.in_channels != self.out_channels else x) + h


class AttnBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.norm = _norm(c)
        self.q, self.k, self.v, self.proj_out = (nn.Conv2d(c, c, 1) for _ in range(4))

    def forward(self, x):
        h = self.norm(x)
        b, c, hh, ww = h.shape
        q = self.q(h).reshape(b, c, -1).transpose(1, 2)
        k = self.k(h).reshape(b, c, -1)
        v = self.v(h).reshape(b, c, -1)
        w = torch.softmax(torch.bmm(q, k) * c ** -0.5, dim=2)
        o = torch.bmm(v, w.transpose(1, 2)).reshape(b, c, hh, ww)
        return x + self.proj_out(o)


class Upsample(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.with_conv, self.scale_factor = True, 2.0
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class Downsample(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.with_conv = True
        self.conv = nn.Conv2d(c, c, 3, stride=2, padding=0)

    def forward(self, x):
        return self.conv(F.pad(x, (0, 1, 0, 1)))


class Encoder(nn.Module):
    def __init__(self, ch, ch_mult, num_res_blocks, in_channels, z_channels):
        super().__init__()
        self.num_resolutions = len(ch_mult)
        self.conv_in = nn.Conv2d(in_channels, ch, 3, padding=1)
        in_mult = (1,) + tuple(ch_mult)
        self.down = nn.ModuleList()
        for i in range(self.num_resolutions):
            level = nn.Module()
            bin_, bout = ch * in_mult[i], ch * ch_mult[i]
            level.block = nn.ModuleList([ResnetBlock(bin_ if j == 0 else bout, bout) for j in range(num_res_blocks)])
            level.attn = nn.ModuleList()
            if i != self.num_resolutions - 1:
                level.downsample = Downsample(bout)
            self.down.append(level)
        c = ch * ch_mult[-1]
        self.mid = nn.Module()
        self.mid.block_1, self.mid.attn_1, self.mid.block_2 = ResnetBlock(c, c), AttnBlock(c), ResnetBlock(c, c)
        self.norm_out, self.conv_out = _norm(c), nn.Conv2d(c, 2 * z_channels, 3, padding=1)

    def forward(self, x):
        h = self.conv_in(x)
        for i, level in enumerate(self.down):
            for block in level.block:
                h = block(h)
            if i != self.num_resolutions - 1:
                h = level.downsample(h)
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h)))
        return self.conv_out(F.silu(self.norm_out(h)))


class Decoder(nn.Module):
    def __init__(self, ch, ch_mult, num_res_blocks, out_ch, z_channels):
        super().__init__()
        self.num_resolutions = len(ch_mult)
        self.give_pre_end = self.tanh_out = False
        c = ch * ch_mult[-1]
        self.conv_in = nn.Conv2d(z_channels, c, 3, padding=1)
        self.mid = nn.Module()
        self.mid.block_1, self.mid.attn_1, self.mid.block_2 = ResnetBlock(c, c), AttnBlock(c), ResnetBlock(c, c)
        self.up = nn.ModuleList()
        for i in reversed(range(self.num_resolutions)):
            level = nn.Module()
            bout = ch * ch_mult[i]
            blocks = []
            for _ in range(num_res_blocks + 1):
                blocks.append(ResnetBlock(c, bout))
                c = bout
            level.block, level.attn = nn.ModuleList(blocks), nn.ModuleList()
            if i != 0:
                level.upsample = Upsample(c)
            self.up.insert(0, level)
        self.norm_out, self.conv_out = _norm(c), nn.Conv2d(c, out_ch, 3, padding=1)

    def forward(self, z):
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(self.conv_in(z))))
        for i in reversed(range(self.num_resolutions)):
            for block in self.up[i].block:
                h = block(h)
            if i != 0:
                h = self.up[i].upsample(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class LdmAutoencoderKL(nn.Module):
    def __init__(self, ch=32, ch_mult=(1, 1, 2, 2), num_res_blocks=1, z_channels=4):
        super().__init__()
        self.encoder = Encoder(ch, ch_mult, num_res_blocks, 3, z_channels)
        self.decoder = Decoder(ch, ch_mult, num_res_blocks, 3, z_channels)
        self.quant_conv = nn.Conv2d(2 * z_channels, 2 * z_channels, 1)
        self.post_quant_conv = nn.Conv2d(z_channels, z_channels, 1)

    def decode(self, z):
        return self.decoder(self.post_quant_conv(z))

    def encode(self, x):
        return self.quant_conv(self.encoder(x)).chunk(2, dim=1)[0]


class FakeComfyVAE:
    """The attributes of ComfyUI's ``comfy.sd.VAE`` that the pack reads."""

    def __init__(self, ae, device="cpu", dtype=torch.float32):
        self.first_stage_model = ae.to(device, dtype)
        self.device, self.vae_dtype, self.latent_channels = torch.device(device), dtype, 4
        self.patcher = None


def _copy(dst: nn.Module, src: nn.Module) -> None:
    dst.weight.data.copy_(src.weight.data.reshape(dst.weight.shape))
    if getattr(src, "bias", None) is not None:
        dst.bias.data.copy_(src.bias.data)


def _copy_resnet(dst: ResnetBlock, src) -> None:
    for name in ("norm1", "conv1", "norm2", "conv2"):
        _copy(getattr(dst, name), getattr(src, name))
    if src.conv_shortcut is not None:
        _copy(dst.nin_shortcut, src.conv_shortcut)


def _copy_mid(dst, src) -> None:
    _copy_resnet(dst.block_1, src.resnets[0])
    _copy_resnet(dst.block_2, src.resnets[1])
    attn = src.attentions[0]
    _copy(dst.attn_1.norm, attn.group_norm)
    for d, s in (("q", attn.to_q), ("k", attn.to_k), ("v", attn.to_v), ("proj_out", attn.to_out[0])):
        _copy(getattr(dst.attn_1, d), s)


@torch.no_grad()
def ldm_from_diffusers(vae) -> LdmAutoencoderKL:
    """The LDM tree holding a diffusers ``AutoencoderKL``'s weights (tiny-kit configuration)."""
    cfg = vae.config
    chs = list(cfg.block_out_channels)
    ldm = LdmAutoencoderKL(ch=chs[0], ch_mult=tuple(c // chs[0] for c in chs), num_res_blocks=cfg.layers_per_block,
                           z_channels=cfg.latent_channels)
    enc, denc = ldm.encoder, vae.encoder
    _copy(enc.conv_in, denc.conv_in)
    for i, block in enumerate(denc.down_blocks):
        for j, res in enumerate(block.resnets):
            _copy_resnet(enc.down[i].block[j], res)
        if block.downsamplers:
            _copy(enc.down[i].downsample.conv, block.downsamplers[0].conv)
    _copy_mid(enc.mid, denc.mid_block)
    _copy(enc.norm_out, denc.conv_norm_out)
    _copy(enc.conv_out, denc.conv_out)
    dec, ddec = ldm.decoder, vae.decoder
    n = len(ddec.up_blocks)
    _copy(dec.conv_in, ddec.conv_in)
    _copy_mid(dec.mid, ddec.mid_block)
    for i, block in enumerate(ddec.up_blocks):
        for j, res in enumerate(block.resnets):
            _copy_resnet(dec.up[n - 1 - i].block[j], res)
        if block.upsamplers:
            _copy(dec.up[n - 1 - i].upsample.conv, block.upsamplers[0].conv)
    _copy(dec.norm_out, ddec.conv_norm_out)
    _copy(dec.conv_out, ddec.conv_out)
    _copy(ldm.quant_conv, vae.quant_conv)
    _copy(ldm.post_quant_conv, vae.post_quant_conv)
    return ldm.eval().requires_grad_(False)

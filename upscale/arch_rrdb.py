"""RRDBNet (ESRGAN, Wang et al. 2018; Real-ESRGAN, Wang et al. 2021) in Real-ESRGAN's key naming.

Network (all convolutions 3x3, stride 1, zero padding 1, LeakyReLU slope 0.2 written ``lrelu``)::

    x  -> [pixel_unshuffle(u) when u > 1]            u = 2 for Real-ESRGAN x2, 4 for x1, else 1
    f0 = conv_first(x)
    f  = f0 + conv_body(RRDB_{B-1}( ... RRDB_0(f0)))  RRDB(z) = z + 0.2 * RDB3(RDB2(RDB1(z)))
    RDB(z): x_k = lrelu(conv_k([z, x_1, ..., x_{k-1}])) for k = 1..4;  RDB(z) = z + 0.2 * conv5([z, x_1..x_4])
    for i in 1..n_up: f = lrelu(conv_up{i}(nearest_upsample_2x(f)))
    y  = conv_last(lrelu(conv_hr(f)))                 net scale = 2**n_up / u

Memory invariant (why this module is hand-written rather than imported from spandrel): a dense block keeps one
preallocated ``[N, F + 4G, H, W]`` buffer and writes each new growth slice into it, so the concatenations of the
reference code (which copy 96+128+160+192 channels per block) never exist; the convolutions read channel prefixes
of the buffer, which for N == 1 in NCHW are contiguous views (batches and channels_last inputs concatenate as the
reference does, dropping x1..x4 before conv5). The arithmetic is the reference's, operation for operation.
Peak live activations per body pixel, in channels (F features, G growth): concatenation path ``4F + 8G`` (feat0,
the RRDB input, the RDB input, x1..x4 and their F + 4G concatenation at the last concat); buffer path
``5F + 5G``. RealESRGAN_x4plus (F 64, G 32): 512 channels, 1 KiB per pixel in fp16.

The upsampling tail runs at up to 16x the pixel count of the body, so :meth:`RRDBNet.forward` can run it in row
strips (``tail_rows``). Every tail layer is a 3x3 convolution at 2x/4x resolution or a nearest upsample, so an
output row depends on at most ``sum_i 2**-i + 2 * 2**-n_up <= 2`` input rows either side: strips computed with
a 2-row halo (clipped at the image border, where the zero padding is the same as in one piece) reproduce the
one-piece result exactly.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

TAIL_HALO = 2  # input rows of context each tail strip needs (see module docstring)


def _conv(cin: int, cout: int) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, 1, 1)


class ResidualDenseBlock(nn.Module):
    """Five-convolution dense block; output = input + 0.2 * conv5(concat(input, x1..x4))."""

    def __init__(self, num_feat: int = 64, num_grow_ch: int = 32):
        super().__init__()
        self.num_feat = num_feat
        self.num_grow_ch = num_grow_ch
        self.conv1 = _conv(num_feat, num_grow_ch)
        self.conv2 = _conv(num_feat + num_grow_ch, num_grow_ch)
        self.conv3 = _conv(num_feat + 2 * num_grow_ch, num_grow_ch)
        self.conv4 = _conv(num_feat + 3 * num_grow_ch, num_grow_ch)
        self.conv5 = _conv(num_feat + 4 * num_grow_ch, num_feat)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        g = self.num_grow_ch
        if n > 1 or (x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()):
            # channel prefixes of a buffer are not dense here (batch > 1 or NHWC): concatenate instead
            feats = [x]
            for conv in (self.conv1, self.conv2, self.conv3, self.conv4):
                feats.append(F.leaky_relu_(conv(torch.cat(feats, 1)), 0.2))
            cat = torch.cat(feats, 1)
            del feats  # x1..x4 live on only inside ``cat`` while conv5 runs
            return self.conv5(cat).mul_(0.2).add_(x)
        buf = torch.empty((n, c + 4 * g, h, w), dtype=x.dtype, device=x.device)
        buf[:, :c].copy_(x)
        for k, conv in enumerate((self.conv1, self.conv2, self.conv3, self.conv4)):
            width = c + k * g
            buf[:, width:width + g].copy_(F.leaky_relu_(conv(buf[:, :width]), 0.2))
        return self.conv5(buf).mul_(0.2).add_(x)


class RRDB(nn.Module):
    """Residual-in-residual dense block: input + 0.2 * RDB3(RDB2(RDB1(input)))."""

    def __init__(self, num_feat: int = 64, num_grow_ch: int = 32):
        super().__init__()
        self.rdb1 = ResidualDenseBlock(num_feat, num_grow_ch)
        self.rdb2 = ResidualDenseBlock(num_feat, num_grow_ch)
        self.rdb3 = ResidualDenseBlock(num_feat, num_grow_ch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rdb3(self.rdb2(self.rdb1(x))).mul_(0.2).add_(x)


class RRDBNet(nn.Module):
    """ESRGAN / Real-ESRGAN generator; see the module docstring for the math and the key names."""

    def __init__(self, num_in_ch: int = 3, num_out_ch: int = 3, num_feat: int = 64, num_block: int = 23,
                 num_grow_ch: int = 32, num_upsample: int = 2, unshuffle: int = 1):
        super().__init__()
        if unshuffle not in (1, 2, 4) or 2 ** num_upsample % unshuffle:
            raise ValueError(f"unshuffle={unshuffle} with num_upsample={num_upsample}: the net scale "
                             f"2**num_upsample / unshuffle must be a whole number and unshuffle 1, 2 or 4")
        self.num_in_ch = num_in_ch
        self.num_out_ch = num_out_ch
        self.num_upsample = num_upsample
        self.unshuffle = unshuffle
        self.scale = 2 ** num_upsample // unshuffle
        self.conv_first = _conv(num_in_ch * unshuffle ** 2, num_feat)
        self.body = nn.Sequential(*[RRDB(num_feat, num_grow_ch) for _ in range(num_block)])
        self.conv_body = _conv(num_feat, num_feat)
        for i in range(1, num_upsample + 1):
            self.add_module(f"conv_up{i}", _conv(num_feat, num_feat))
        self.conv_hr = _conv(num_feat, num_feat)
        self.conv_last = _conv(num_feat, num_out_ch)

    def _tail(self, feat: torch.Tensor) -> torch.Tensor:
        for i in range(1, self.num_upsample + 1):
            feat = F.interpolate(feat, scale_factor=2, mode="nearest")
            feat = F.leaky_relu_(getattr(self, f"conv_up{i}")(feat), 0.2)
        return self.conv_last(F.leaky_relu_(self.conv_hr(feat), 0.2))

    def forward(self, x: torch.Tensor, tail_rows: int = 0) -> torch.Tensor:
        """Upscale ``x`` [N, C, H, W]; ``tail_rows > 0`` runs the upsampling tail in strips of that many rows."""
        h, w = x.shape[-2:]
        u = self.unshuffle
        if u > 1:
            pad_h, pad_w = (-h) % u, (-w) % u
            if pad_h or pad_w:
                x = F.pad(x, (0, pad_w, 0, pad_h), mode="reflect")
            x = F.pixel_unshuffle(x, u)
        feat = self.conv_first(x)
        feat = self.conv_body(self.body(feat)).add_(feat)
        rows = feat.shape[-2]
        if tail_rows <= 0 or tail_rows >= rows:
            out = self._tail(feat)
        else:
            up = 2 ** self.num_upsample
            out = feat.new_empty((feat.shape[0], self.num_out_ch, rows * up, feat.shape[-1] * up))
            for r0 in range(0, rows, tail_rows):
                r1 = min(rows, r0 + tail_rows)
                s0, s1 = max(0, r0 - TAIL_HALO), min(rows, r1 + TAIL_HALO)
                strip = self._tail(feat[:, :, s0:s1])
                out[:, :, r0 * up:r1 * up].copy_(strip[:, :, (r0 - s0) * up:(r1 - s0) * up])
                del strip
        if u > 1:
            out = out[:, :, : h * self.scale, : w * self.scale]
        return out

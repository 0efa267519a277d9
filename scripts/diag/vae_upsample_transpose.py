"""Is a VAE decoder's "nearest 2x upsample, then 3x3 conv (padding 1)" faster as one stride-2 transposed conv?

The identity (exact in real arithmetic): along each axis, output row ``2i + a`` of conv3x3(upsample(x)) reads input
rows ``i-1, i, i`` (a = 0) or ``i, i, i+1`` (a = 1), so it equals ``conv_transpose2d(x, W4, stride=2, padding=1)``
whose 4x4 kernel is ``W4[c, o] = M @ w[o, c] @ M.T`` with ``M = [[0,0,1], [0,1,1], [1,1,0], [1,0,0]]`` (rows: taps
``ky = 0..3``). Each output pixel then takes 4 taps instead of 9 and the 4x larger upsampled map is never written.

Parts (SDXL VAE at 1024 px, random weights, one image):
- ``identity``: max abs difference of the two forms in fp64 on the CPU (a small map), must be ~1e-15;
- ``micro``: ms per call of the decoder's three upsamplers' shapes, both forms, fp32 (TF32 convolutions, PyTorch's
  default) and fp16, channels-last; and the fp32 forms' max abs error against fp64;
- ``decode``: the pack's untiled decode (``vae.untiled``) as is and with every ``Upsample2D`` run as the transposed
  conv: ms (min of 3 rounds of 3, alternating) and max / mean abs error against an fp64 decode.
Usage: cd scripts/diag && python vae_upsample_transpose.py; writes $OUT/vae_upsample_transpose.json. ~60 s.
"""
import contextlib

import torch
import torch.nn.functional as F

from diag_timing import Recorder, timed
from leandiffusion.bench.models import full_vae
from leandiffusion.vae import untiled

dev = torch.device("cuda")
rec = Recorder("vae_upsample_transpose.json")
M = torch.tensor([[0, 0, 1], [0, 1, 1], [1, 1, 0], [1, 0, 0]], dtype=torch.float64)


def transposed_kernel(w: torch.Tensor) -> torch.Tensor:
    """``[out, in, 3, 3]`` -> the ``[in, out, 4, 4]`` kernel of the equivalent stride-2 transposed conv."""
    m = M.to(w.device)
    return torch.einsum("ky,oiyx,lx->iokl", m, w.double(), m).to(w.dtype).contiguous()


def plain(x, w, b):
    return F.conv2d(F.interpolate(x, scale_factor=2.0, mode="nearest"), w, b, padding=1)


def transposed(x, w4, b):
    return F.conv_transpose2d(x, w4, b, stride=2, padding=1)


g = torch.Generator().manual_seed(0)
x = torch.randn(2, 5, 7, 6, generator=g, dtype=torch.float64)
w = torch.randn(3, 5, 3, 3, generator=g, dtype=torch.float64)
b = torch.randn(3, generator=g, dtype=torch.float64)
rec("identity", {"max_abs_diff_fp64": (plain(x, w, b) - transposed(x, transposed_kernel(w), b)).abs().max().item()})

micro = {}
with torch.no_grad():
    for c, hw in ((512, 128), (512, 256), (256, 512)):
        for dt in (torch.float32, torch.float16):
            x = torch.randn(1, c, hw, hw, device=dev, dtype=dt).contiguous(memory_format=torch.channels_last)
            w = (torch.randn(c, c, 3, 3, device=dev) / (3 * c ** 0.5)).to(dt)
            b = torch.randn(c, device=dev).to(dt) * 0.1
            w4 = transposed_kernel(w)
            row = {"plain_ms": round(min(timed(lambda: plain(x, w, b), 5) for _ in range(3)), 3),
                   "transposed_ms": round(min(timed(lambda: transposed(x, w4, b), 5) for _ in range(3)), 3)}
            if dt == torch.float32:
                ref = plain(x.double(), w.double(), b.double())
                row["plain_err"] = (plain(x, w, b).double() - ref).abs().max().item()
                row["transposed_err"] = (transposed(x, w4, b).double() - ref).abs().max().item()
                row["ref_max"] = ref.abs().max().item()
            micro[f"{c}x{hw}_{str(dt)[6:]}"] = row
            ref = None
            torch.cuda.empty_cache()
rec("micro", micro)


@contextlib.contextmanager
def transposed_upsamplers(vae):
    from diffusers.models.upsampling import Upsample2D
    patched = []
    for m in vae.modules():
        if type(m) is Upsample2D and m.use_conv and not m.use_conv_transpose and m.interpolate and m.norm is None:
            conv = m.conv
            w4 = transposed_kernel(conv.weight.detach())

            def forward(hidden_states, output_size=None, *args, _w4=w4, _b=conv.bias, **kwargs):
                assert output_size is None
                return F.conv_transpose2d(hidden_states, _w4, _b, stride=2, padding=1)
            m.forward = forward
            patched.append(m)
    try:
        yield len(patched)
    finally:
        for m in patched:
            del m.forward


vae = full_vae(device=dev, dtype=torch.float32)
z = torch.randn(1, 4, 128, 128, device=dev, generator=torch.Generator(dev).manual_seed(0))
vae64 = full_vae(device=dev, dtype=torch.float64)
with torch.no_grad():
    ref = vae64.decode(z.double(), return_dict=False)[0]
del vae64
torch.cuda.empty_cache()


def fast():
    with untiled.fast_vae(vae):
        return untiled.decode(vae, z)


def fast_transposed():
    with transposed_upsamplers(vae), untiled.fast_vae(vae):
        return untiled.decode(vae, z)


with torch.no_grad():
    with transposed_upsamplers(vae) as n:
        rec("patched_upsamplers", n)
    out = {}
    for name, fn in (("fast", fast), ("fast_transposed", fast_transposed)):
        d = (fn().double() - ref).abs()
        out[name] = {"max_abs_vs_fp64": d.max().item(), "mean_abs_vs_fp64": d.mean().item()}
    times = {"fast": [], "fast_transposed": []}
    for _ in range(3):
        for name, fn in (("fast", fast), ("fast_transposed", fast_transposed)):
            times[name].append(round(timed(fn, 3), 2))
    for name in out:
        out[name]["ms"] = min(times[name])
        out[name]["rounds"] = times[name]
    out["peak_gb"] = {}
    for name, fn in (("fast", fast), ("fast_transposed", fast_transposed)):
        torch.cuda.reset_peak_memory_stats()
        fn()
        out["peak_gb"][name] = round(torch.cuda.max_memory_allocated() / 2 ** 30, 3)
rec("decode", out)

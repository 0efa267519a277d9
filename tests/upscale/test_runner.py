"""The tiled runner on tiny random models (CPU, fp32).

Guards: with at least the receptive field as context a tiled run equals the untiled one (compact and
pixel-unshuffle RRDB); OOM halves the tile then fails clearly, and later images keep the smaller tile under a
re-planned progress bar; batches run image by image within one image's window size; output_scale resizes with
antialiased bicubic; interruption stops the run; the input batch is never modified; an error pins no tensor of
the run; cuDNN autotuning changes no other setting.
"""
import contextlib

import pytest
import torch
import torch.nn.functional as F

from leandiffusion import bridge
from leandiffusion.tests.kit import process_state
from leandiffusion.tests.kit.progress import ComfyLikeBar
from leandiffusion.tests.upscale import helpers as H
from leandiffusion.upscale import options, runner
from leandiffusion.upscale.descriptor import Upscaler
from leandiffusion.upscale.loader import build_upscaler
from leandiffusion.upscale.runner import upscale_images


def test_compact_tiled_equals_untiled():
    up = build_upscaler(H.random_compact(num_conv=3))  # receptive field 5 px; overlap 8 leaves >= 6 of context
    img = H.random_image(1, 70, 45)
    whole = upscale_images(up, img, device="cpu", quiet=True)
    ref = H.ref_compact(H.random_compact(num_conv=3), img.permute(0, 3, 1, 2)).clamp(0, 1).permute(0, 2, 3, 1)
    torch.testing.assert_close(whole, ref, atol=1e-5, rtol=0)
    tiled = upscale_images(up, img, device="cpu", tile_size=32, tile_overlap=8, quiet=True)
    torch.testing.assert_close(tiled, whole, atol=1e-5, rtol=0)


def test_unshuffle_rrdb_tiled_equals_untiled():
    up = build_upscaler(H.random_rrdb(num_block=1, unshuffle=2))  # x2 net: windows must align to 2 px
    img = H.random_image(1, 45, 66)  # odd height: padded by reflection, cropped after
    whole = upscale_images(up, img, device="cpu", quiet=True)
    assert whole.shape == (1, 90, 132, 3)
    ref = H.ref_rrdb(H.random_rrdb(num_block=1, unshuffle=2), img.permute(0, 3, 1, 2), 2).clamp(0, 1)
    torch.testing.assert_close(whole, ref.permute(0, 2, 3, 1), atol=1e-5, rtol=0)
    tiled = upscale_images(up, img, device="cpu", tile_size=32, tile_overlap=56, quiet=True)
    torch.testing.assert_close(tiled, whole, atol=1e-5, rtol=0)


class _Spy(torch.nn.Module):
    """Wraps a module; records window sizes and raises OOM above ``limit`` pixels."""

    def __init__(self, inner, limit=None, error=None):
        super().__init__()
        self.inner, self.limit, self.sizes = inner, limit, []
        self.error = error or (lambda: torch.OutOfMemoryError("injected: CUDA out of memory"))

    def forward(self, x):
        self.sizes.append(tuple(x.shape[-2:]))
        if self.limit is not None and x.shape[-1] * x.shape[-2] > self.limit:
            raise self.error()
        return self.inner(x)


def _spied(limit=None, error=None):
    base = build_upscaler(H.random_compact(num_conv=3))
    spy = _Spy(base.module, limit, error)
    from dataclasses import replace

    return replace(base, module=spy), spy, base


def test_oom_halves_the_tile_and_recovers(caplog):
    up, spy, base = _spied(limit=70 * 70)
    img = H.random_image(1, 100, 100)
    with caplog.at_level("WARNING"):
        out = upscale_images(up, img, device="cpu", tile_size=256, tile_overlap=8, quiet=True)
    assert spy.sizes[0] == (100, 100) and max(h * w for h, w in spy.sizes[1:]) <= 70 * 70
    assert "retrying with tile 50" in caplog.text
    torch.testing.assert_close(out, upscale_images(base, img, device="cpu", quiet=True), atol=1e-5, rtol=0)


def test_a_cpu_allocation_failure_halves_the_tile_too_and_other_errors_do_not():
    """torch's CPU allocator raises a RuntimeError, not OutOfMemoryError: the tile must shrink all the same."""
    up, spy, base = _spied(70 * 70, lambda: RuntimeError("DefaultCPUAllocator: not enough memory: you tried to "
                                                          "allocate 9000000000 bytes"))
    img = H.random_image(1, 100, 100)
    out = upscale_images(up, img, device="cpu", tile_size=256, tile_overlap=8, quiet=True)
    assert spy.sizes[0] == (100, 100) and max(h * w for h, w in spy.sizes[1:]) <= 70 * 70
    torch.testing.assert_close(out, upscale_images(base, img, device="cpu", quiet=True), atol=1e-5, rtol=0)
    up, spy, _ = _spied(70 * 70, lambda: RuntimeError("a real bug"))
    with pytest.raises(RuntimeError, match="a real bug"):
        upscale_images(up, img, device="cpu", tile_size=256, tile_overlap=8, quiet=True)
    assert spy.sizes == [(100, 100)]


class _OomOnCall(torch.nn.Module):
    """Runs ``inner``, except that forward call number ``n`` (1-based) raises out-of-memory."""

    def __init__(self, inner, n):
        super().__init__()
        self.inner, self.n, self.calls = inner, n, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.n:
            raise torch.OutOfMemoryError("injected: CUDA out of memory")
        return self.inner(x)


@pytest.mark.parametrize("case", ["first window", "third window"])
def test_oom_retry_keeps_the_progress_bar_within_its_total_and_the_smaller_tile(monkeypatch, caplog, case):
    """After an out-of-memory retry the bar counted the retried image's tiles on top of the first plan (a batch of
    3 one-tile images that retried with 4 tiles each reached 12 of 3: 100% after the first image), and every later
    image tried the failed tile again (one more out-of-memory error and warning per image). Now the bar is re-planned
    (back to the finished images' tiles, out of the new total) and ends exactly at its total, and later images
    start from the tile that worked."""
    bars = []
    monkeypatch.setattr(runner, "ProgressBar", lambda *a, **k: bars.append(ComfyLikeBar(*a, **k)) or bars[-1])
    imgs = H.random_image(3, 100, 100, seed=4)
    base = build_upscaler(H.random_compact(num_conv=3))
    from dataclasses import replace

    if case == "first window":  # 1 tile of 100 px fails; 4 tiles of 50 px per image follow
        spy = _Spy(base.module, limit=70 * 70)
        tile, want, failed = 256, (12, 12), lambda: [s for s in spy.sizes if s[0] * s[1] > 70 * 70] == [(100, 100)]
    else:  # tiles of 64 px (4 per image): the third fails; 16 tiles of 32 px per image follow
        spy = _OomOnCall(base.module, 3)
        tile, want, failed = 64, (48, 48), lambda: spy.calls == 1 + 2 + 3 * 16
    with caplog.at_level("WARNING"):
        out = upscale_images(replace(base, module=spy), imgs, device="cpu", tile_size=tile, tile_overlap=8,
                             quiet=True)
    (bar,) = bars
    assert all(value <= total for value, total in bar.seen), bar.seen
    assert (bar.value, bar.total) == want
    assert failed(), "a later image tried the tile that had run out of memory again"
    assert caplog.text.count("retrying with tile") == 1
    torch.testing.assert_close(out, upscale_images(base, imgs, device="cpu", quiet=True), atol=1e-5, rtol=0)


def test_oom_everywhere_is_a_clear_error():
    up, spy, _ = _spied(limit=1)
    with pytest.raises(RuntimeError, match=r"out of memory .* tile sizes \[100, 50\]"):
        upscale_images(up, H.random_image(1, 100, 100), device="cpu", tile_size=256, tile_overlap=8, quiet=True)


def test_batch_is_image_by_image():
    up, spy, base = _spied()
    imgs = H.random_image(3, 48, 40, seed=3)
    out = upscale_images(up, imgs, device="cpu", tile_size=32, tile_overlap=8, quiet=True)
    batch_sizes = list(spy.sizes)
    spy.sizes.clear()
    singles = torch.cat([upscale_images(up, imgs[i:i + 1], device="cpu", tile_size=32, tile_overlap=8, quiet=True)
                         for i in range(3)])
    torch.testing.assert_close(out, singles, atol=0, rtol=0)
    assert max(h * w for h, w in batch_sizes) == max(h * w for h, w in spy.sizes)  # same bound as one image
    assert len(batch_sizes) == len(spy.sizes)


@pytest.mark.parametrize("output_scale", [2.5, 0.5, 1.7])  # 21 * 1.7 = 35.7: rounded to 36, not cut to 35
def test_output_scale(output_scale):
    up = build_upscaler(H.random_compact(num_conv=1))
    img = H.random_image(1, 21, 30)
    native = upscale_images(up, img, device="cpu", quiet=True)
    out = upscale_images(up, img, output_scale=output_scale, device="cpu", quiet=True)
    size = (round(21 * output_scale), round(30 * output_scale))
    ref = F.interpolate(native.permute(0, 3, 1, 2), size=size, mode="bicubic", antialias=True).clamp(0, 1)
    assert out.shape == (1, *size, 3)
    torch.testing.assert_close(out, ref.permute(0, 2, 3, 1), atol=1e-6, rtol=0)


def test_output_scale_zero_means_the_files_own_output_scale():
    """A file whose metadata sets its output scale (an ncnn graph ending in a fixed resize, e.g. animevideov3 x2 =
    the x4 net, then a bicubic downscale) gives that size for output_scale=0, resized from the net's x4 output."""
    from dataclasses import replace

    net = build_upscaler(H.random_compact(num_conv=1))  # x4
    up = replace(net, default_output_scale=2.0)
    img = H.random_image(1, 21, 30)
    out = upscale_images(up, img, device="cpu", quiet=True)
    native = H.ref_compact(H.random_compact(num_conv=1), img.permute(0, 3, 1, 2)).clamp(0, 1)
    ref = F.interpolate(native, size=(42, 60), mode="bicubic", antialias=True).clamp(0, 1)
    assert out.shape == (1, 42, 60, 3)
    torch.testing.assert_close(out, ref.permute(0, 2, 3, 1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("h,w", [(24, 90), (90, 24)])
def test_one_row_or_column_of_tiles_is_still_feathered(h, w):
    """Tiles in a single row have no band across rows, only across columns (and a single column the other way):
    the seams must still be cross-faded, not summed; with the receptive field inside the context the tiled result
    equals the untiled one."""
    up = build_upscaler(H.random_compact(num_conv=3))
    img = H.random_image(1, h, w, seed=5)
    tiled = upscale_images(up, img, device="cpu", tile_size=32, tile_overlap=8, quiet=True)
    ref = H.ref_compact(H.random_compact(num_conv=3), img.permute(0, 3, 1, 2)).clamp(0, 1).permute(0, 2, 3, 1)
    torch.testing.assert_close(tiled, ref, atol=1e-5, rtol=0)


def test_oom_retry_halves_the_work_budget_with_the_tile():
    """The work budget the model's call gets (RRDB tail strips size from it) is halved with the tile after an
    out-of-memory error, as ``_upscale_with_retry`` documents; only the tile used to be checked."""
    from dataclasses import replace

    base = build_upscaler(H.random_compact(num_conv=3))
    seen = []

    def call(module, x, work_bytes):
        seen.append(work_bytes)
        if x.shape[-1] * x.shape[-2] > 70 * 70:
            raise torch.OutOfMemoryError("injected: CUDA out of memory")
        return module(x)

    out = upscale_images(replace(base, call=call), H.random_image(1, 100, 100), device="cpu", tile_size=256,
                         tile_overlap=8, quiet=True)
    first = base.work_bytes(100, 100, torch.float32)  # the whole 100 px image is the first (failing) window
    assert seen[0] == first and len(seen) > 1 and set(seen[1:]) == {first // 2}
    assert out.shape == (1, 400, 400, 3)


def test_work_cap_tiles_and_still_matches():
    up = build_upscaler(H.random_compact(num_conv=3))
    img = H.random_image(1, 90, 90)
    capped = upscale_images(up, img, device="cpu", tile_overlap=8, work_cap=up.work_bytes(50, 50, torch.float32),
                            quiet=True)
    torch.testing.assert_close(capped, upscale_images(up, img, device="cpu", quiet=True), atol=1e-5, rtol=0)


def test_interruption_stops_between_tiles():
    up = build_upscaler(H.random_compact(num_conv=1))
    calls = []

    def hook():
        calls.append(1)
        if len(calls) == 3:
            raise bridge.Interrupted("stop")

    bridge.set_interrupt_hook(hook)
    try:
        with pytest.raises(bridge.Interrupted):
            upscale_images(up, H.random_image(1, 100, 100), device="cpu", tile_size=32, quiet=True)
    finally:
        bridge.set_interrupt_hook(None)
    assert len(calls) == 3


def test_inputs_are_not_modified():
    up = build_upscaler(H.random_rrdb(num_feat=4, num_block=1, grow=4, unshuffle=2))
    before = {k: v.clone() for k, v in up.module.state_dict().items()}
    img = H.random_image(2, 34, 21)
    copy = img.clone()
    upscale_images(up, img, device="cpu", tile_size=32, tile_overlap=8, precision="bf16", quiet=True)
    assert torch.equal(img, copy)
    assert all(torch.equal(v, before[k]) and v.dtype == torch.float32 for k, v in up.module.state_dict().items())


def test_spandrel_style_upscaler_without_helpers():
    """A generic module (the spandrel path) runs through the plain call; with 8 px of context around 32 px tiles and a
    receptive-field radius of 3 px, the tiled result equals the net on the whole image (independent reference)."""
    inner = build_upscaler(H.random_compact(num_conv=1)).module
    up = Upscaler(inner, "generic", 4, context=None)
    img = H.random_image(1, 40, 36)
    out = upscale_images(up, img, device="cpu", tile_size=32, tile_overlap=8, quiet=True)
    assert out.shape == (1, 160, 144, 3)
    ref = H.ref_compact(H.random_compact(num_conv=1), img.permute(0, 3, 1, 2)).clamp(0, 1).permute(0, 2, 3, 1)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("sd", [H.random_rrdb(num_block=1), H.random_rrdb(num_block=1, unshuffle=2),
                                H.random_compact(num_conv=2)], ids=["rrdb", "rrdb_unshuffle", "compact"])
def test_nhwc_layout_matches(sd):
    """channels_last (the default for built-in nets) runs the dense blocks through concatenation; same numbers as
    NCHW (buffer path) and as the plain reference implementations."""
    up = build_upscaler(sd)
    assert options.resolve_layout("auto", up) == "nhwc"
    img = H.random_image(1, 40, 34)
    a = upscale_images(up, img, device="cpu", tile_size=32, tile_overlap=8, quiet=True, layout="nchw")
    b = upscale_images(up, img, device="cpu", tile_size=32, tile_overlap=8, quiet=True, layout="nhwc")
    c = upscale_images(up, img, device="cpu", tile_size=32, tile_overlap=8, quiet=True)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    torch.testing.assert_close(c, b, atol=0, rtol=0)
    whole = upscale_images(up, img, device="cpu", quiet=True)
    x = img.permute(0, 3, 1, 2)
    if "body.1.weight" in sd:
        ref = H.ref_compact(sd, x)
    else:
        ref = H.ref_rrdb(sd, x, 2 if sd["conv_first.weight"].shape[1] == 12 else 1)
    torch.testing.assert_close(whole, ref.clamp(0, 1).permute(0, 2, 3, 1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("tile_size", [0, 32])  # 0: one window = the whole image, a view of the input
@pytest.mark.parametrize("kind", ["rrdb", "compact"])
def test_auto_layout_really_runs_channels_last(kind, tile_size):
    """Every convolution of a built-in net gets and returns NHWC tensors under layout="auto" (a view that merely
    passes the contiguity check would make the convolutions fall back to NCHW, silently and slower)."""
    up = build_upscaler(H.random_rrdb(num_block=1) if kind == "rrdb" else H.random_compact(num_conv=2))
    seen = []
    hooks = [m.register_forward_hook(lambda mod, inp, out: seen.append(out.is_contiguous(
        memory_format=torch.channels_last) and not out.is_contiguous() and inp[0].stride(1) == 1))
        for m in up.module.modules() if isinstance(m, torch.nn.Conv2d)]
    try:
        upscale_images(up, H.random_image(1, 36, 40), device="cpu", tile_size=tile_size, tile_overlap=8, quiet=True)
    finally:
        for h in hooks:
            h.remove()
    assert seen and all(seen)


def test_error_releases_frame_locals():
    """After a failed run, the exception no longer pins the runner's tensors (GPU memory on a GPU)."""
    up, spy, _ = _spied(limit=1)
    with pytest.raises(RuntimeError) as info:
        upscale_images(up, H.random_image(1, 100, 100), device="cpu", tile_size=64, tile_overlap=8, quiet=True)
    tb = info.value.__cause__.__traceback__
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    inner = [f for f in frames if f.f_code.co_name == "_upscale_one"]
    assert inner and all(not f.f_locals for f in inner)


def test_interruption_releases_the_half_done_batch_output():
    """An interrupted batch gives no output, and the exception it raises no longer holds the batch's output tensor
    (host memory of B x H' x W' x C floats: 3.2 GB for 16 4096 px images) through the runner's frame (it did,
    for as long as the caller kept the exception)."""
    up = build_upscaler(H.random_compact(num_conv=1))
    calls = []

    def hook():
        calls.append(1)
        if len(calls) == 7:  # inside the second image
            raise bridge.Interrupted("stop")

    bridge.set_interrupt_hook(hook)
    try:
        with pytest.raises(bridge.Interrupted) as info:
            upscale_images(up, H.random_image(3, 100, 100), device="cpu", tile_size=32, quiet=True)
    finally:
        bridge.set_interrupt_hook(None)
    tb, held = info.value.__traceback__, []
    while tb is not None:
        held += [v for v in tb.tb_frame.f_locals.values() if isinstance(v, torch.Tensor) and v.numel() >= 3 * 400 * 400]
        tb = tb.tb_next
    assert held == []


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_placed_copy_leaves_the_upscaler_alone(layout):
    """Moving to another dtype (a device on a GPU) makes a cast copy; the upscaler's module is unchanged."""
    sd = H.random_rrdb(num_block=1)
    up = build_upscaler(sd)
    before = {k: v.clone() for k, v in up.module.state_dict().items()}
    placed = runner._placed_module(up, torch.device("cpu"), torch.float64, layout)
    assert placed is not up.module
    assert all(p.dtype == torch.float64 and not p.requires_grad for p in placed.parameters())
    conv = placed.conv_first.weight
    assert conv.is_contiguous(memory_format=torch.channels_last) == (layout == "nhwc")
    for k, v in up.module.state_dict().items():
        assert v.dtype == torch.float32 and torch.equal(v, before[k])
        torch.testing.assert_close(placed.state_dict()[k], v.double(), atol=0, rtol=0)
    x = torch.rand(1, 3, 11, 9)
    with torch.inference_mode():
        torch.testing.assert_close(placed(x.double()).float(), H.ref_rrdb(sd, x), atol=1e-5, rtol=0)


# TF32 and cuDNN choices a user (or ComfyUI's start-up) may have made before the node runs, through each of
# PyTorch's APIs: the legacy flags, the per-operator ``fp32_precision`` API, the global one
USER_CUDNN_SETTINGS = {
    "defaults": lambda: None,
    "legacy cudnn.allow_tf32=False": lambda: setattr(torch.backends.cudnn, "allow_tf32", False),
    "cudnn.conv.fp32_precision=ieee": lambda: setattr(torch.backends.cudnn.conv, "fp32_precision", "ieee"),
    "cudnn.rnn.fp32_precision=ieee": lambda: setattr(torch.backends.cudnn.rnn, "fp32_precision", "ieee"),
    "backends.fp32_precision=tf32": lambda: setattr(torch.backends, "fp32_precision", "tf32"),
    "cudnn.deterministic=True": lambda: setattr(torch.backends.cudnn, "deterministic", True),
    "cudnn.benchmark=True": lambda: setattr(torch.backends.cudnn, "benchmark", True),
}


@pytest.mark.parametrize("error", [False, True], ids=["returns", "raises"])
@pytest.mark.parametrize("user_setting", list(USER_CUDNN_SETTINGS))
def test_cudnn_benchmark_scope_changes_only_benchmark(user_setting, error):
    """``cudnn_benchmark=True`` on CUDA turns cuDNN autotuning on for the call and leaves every other process-wide
    setting as the user had it, after a normal return and after an error. Runs on the CPU: the flags are process
    state that torch reads and writes without a GPU. Before, the scope was ``torch.backends.cudnn.flags`` fed with
    every current cuDNN setting: it raised on entry (PyTorch refuses to read the legacy ``allow_tf32`` once
    convolutions and RNNs have different TF32 settings) and wrote TF32 through both APIs."""
    if "fp32_precision" in user_setting and not hasattr(torch.backends.cudnn, "conv"):
        pytest.skip("PyTorch < 2.9 has no per-operator fp32_precision API")
    with process_state.preserved():
        USER_CUDNN_SETTINGS[user_setting]()
        before = process_state.snapshot()
        with pytest.raises(KeyError) if error else contextlib.nullcontext():
            with runner._cudnn_benchmark(True, torch.device("cuda")):
                inside = process_state.changes(before, process_state.snapshot())
                assert torch.backends.cudnn.benchmark is True
                if error:
                    raise KeyError("inside the upscale")
        assert set(inside) <= {"cudnn.benchmark"}
        assert process_state.changes(before, process_state.snapshot()) == {}


@pytest.mark.parametrize("precision,dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_half_precision_seams_blend_in_fp32(precision, dtype):
    """Seam weights applied in the model's dtype (``y.mul_(weight.to(y.dtype))``) round the weights and products of
    neighbouring tiles so that they no longer sum to one: with a pointwise model on a bright image the seams are
    about one 8-bit level off in bf16. Weighted in fp32, the blend gives back the model's output up to fp32
    rounding. Reference: the nearest upsampling of the image rounded to the model's dtype, as one piece
    (independent of the runner). The GPU path's twin:
    ``tests/upscale/test_gpu.py::test_half_precision_seams_blend_in_fp32_on_the_gpu``."""
    up = Upscaler(H.NearestX4(), "generic", 4, context=None)
    img = 0.75 + 0.25 * H.random_image(1, 96, 80)
    out = upscale_images(up, img, device="cpu", tile_size=32, tile_overlap=16, precision=precision, quiet=True)
    torch.testing.assert_close(out, H.nearest_x4_reference(img, dtype), atol=3e-7, rtol=0)

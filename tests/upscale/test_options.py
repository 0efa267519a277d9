"""The upscale's options (``upscale.options``): bad inputs raise ValueError/TypeError naming the argument,
automatic tiles fit the budget, device='cpu' never calls CUDA and 'auto' follows ComfyUI's CPU mode.
"""
import pytest
import torch

from leandiffusion.tests.upscale import helpers as H
from leandiffusion.upscale import options
from leandiffusion.upscale.descriptor import Upscaler
from leandiffusion.upscale.loader import build_upscaler
from leandiffusion.upscale.runner import upscale_images


@pytest.mark.parametrize("name,value,inside", [
    ("output_scale", 0.25, True), ("output_scale", 16, True), ("output_scale", 0.24, False),
    ("output_scale", 16.5, False), ("tile_size", 32, True), ("tile_size", 2048, True), ("tile_size", 31, False),
    ("tile_size", 2049, False), ("tile_overlap", 0, True), ("tile_overlap", 256, True), ("tile_overlap", -1, False),
    ("tile_overlap", 257, False)])
def test_option_ranges_include_their_documented_ends(name, value, inside):
    """The node's inputs offer output_scale 0.25..16, tile_size 32..2048 and tile_overlap 0..256: both ends are
    accepted, the values just outside are refused naming the input."""
    given = {"output_scale": 0, "tile_size": 0, "tile_overlap": 32, name: value}
    args = (H.random_image(1, 8, 8), given["output_scale"], "cpu", given["tile_size"], given["tile_overlap"], "auto")
    if inside:
        options.check_options(*args)
    else:
        with pytest.raises(ValueError, match=name):
            options.check_options(*args)


def test_auto_tile_tiles_only_when_over_budget():
    up = build_upscaler(H.random_rrdb())
    assert options.auto_tile(up, 100, 80, 32, torch.float32, budget=10 ** 12) == 100
    budget = up.work_bytes(200, 200, torch.float32)
    tile = options.auto_tile(up, 1000, 1000, 32, torch.float32, budget)
    assert 32 <= tile <= 200 - 64 and up.work_bytes(tile + 64, tile + 64, torch.float32) <= budget


@pytest.mark.parametrize("kwargs,match", [
    (dict(output_scale=0.1), "output_scale"), (dict(tile_size=16), "tile_size"),
    (dict(tile_overlap=300), "tile_overlap"), (dict(device="tpu"), "device"), (dict(precision="fp8"), "precision"),
])
def test_bad_arguments(kwargs, match):
    up = build_upscaler(H.random_compact(num_conv=1))
    with pytest.raises(ValueError, match=match):
        upscale_images(up, H.random_image(1, 8, 8), **{"device": "cpu", **kwargs})


@pytest.mark.parametrize("kwargs,match", [
    (dict(output_scale="2"), "output_scale='2'"), (dict(output_scale=None), "output_scale=None"),
    (dict(tile_size=None), "tile_size=None"), (dict(tile_size=40.5), "tile_size=40.5"),
    (dict(tile_overlap="8"), "tile_overlap='8'"),
])
def test_wrong_argument_types_are_named(kwargs, match):
    up = build_upscaler(H.random_compact(num_conv=1))  # was a bare "'<=' not supported between ..." TypeError
    with pytest.raises(TypeError, match=match):
        upscale_images(up, H.random_image(1, 8, 8), **{"device": "cpu", **kwargs})


def test_bad_images():
    up = build_upscaler(H.random_rrdb(unshuffle=4))
    for channels in (1, 2, 5):
        with pytest.raises(ValueError, match=rf"image has {channels} channels, ESRGAN takes 3 \(or 4: RGB plus "
                                             rf"alpha\); convert the image first"):
            upscale_images(up, torch.rand(1, 8, 8, channels), device="cpu")
    with pytest.raises(TypeError, match="image"):
        upscale_images(up, torch.rand(8, 8, 3), device="cpu")
    with pytest.raises(TypeError, match="upscaler"):
        upscale_images(up.module, H.random_image(1, 8, 8), device="cpu")


def test_cpu_never_touches_cuda(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("CUDA was called for device='cpu'")

    for name in ("is_available", "mem_get_info", "current_device", "synchronize", "Event", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, boom)
    up = build_upscaler(H.random_compact(num_conv=1))
    out = upscale_images(up, H.random_image(1, 40, 40), device="cpu", tile_size=32, quiet=True)
    assert out.shape == (1, 160, 160, 3)


def test_gpu_requested_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    up = build_upscaler(H.random_compact(num_conv=1))
    with pytest.raises(ValueError, match="no CUDA device"):
        upscale_images(up, H.random_image(1, 8, 8), device="gpu")
    assert options.choose_device("auto", up).type == "cpu"


def test_auto_follows_comfyuis_cpu_mode_without_asking_cuda(monkeypatch):
    """ComfyUI started with --cpu: device='auto' runs on the CPU and never calls into CUDA, even where torch sees a
    GPU (the module docstring's promise)."""
    def boom(*a, **k):
        raise AssertionError("CUDA was called for device='auto' under ComfyUI's --cpu")

    for name in ("is_available", "mem_get_info", "current_device", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, boom)
    monkeypatch.setattr(options, "default_device", lambda: torch.device("cpu"))
    up = build_upscaler(H.random_compact(num_conv=1))
    assert options.choose_device("auto", up).type == "cpu"


def test_free_vram_counts_cached_blocks_like_the_rest_of_the_pack(monkeypatch):
    """``choose_device`` and ``work_budget`` read free VRAM through ``memory.free_vram.free_bytes``: the driver's free
    memory plus this process's cached-but-unused blocks, the number the loader, the Stream Scheduler and the tiled
    VAE use. They read ``torch.cuda.mem_get_info`` alone before, so blocks the caching allocator would hand out
    first did not count: ``device='auto'`` ran on the CPU, and the window budget was smaller, with a warm cache."""
    GiB = 2 ** 30
    up = build_upscaler(H.random_rrdb())
    need = up.weight_bytes(torch.float16) + up.work_bytes(options.MIN_TILE + 64, options.MIN_TILE + 64, torch.float16)
    driver_free, reserved, allocated = need // 2, 3 * GiB, 3 * GiB - need  # cached: ``need`` bytes
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (driver_free, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated)
    monkeypatch.setattr(options, "default_device", lambda: torch.device("cuda", 0))
    monkeypatch.setattr(options, "free_comfy_memory", lambda *args: None)

    assert options.choose_device("auto", up) == torch.device("cuda", 0)
    budget = options.work_budget(torch.device("cuda", 0), up, torch.float16)
    counted = driver_free + need - up.weight_bytes(torch.float16)
    assert budget == int(min(options.WORK_CAP_GPU, 0.7 * counted))


def test_layout_argument():
    up = build_upscaler(H.random_compact(num_conv=1))
    generic = Upscaler(up.module, "generic", 4)
    assert options.resolve_layout("auto", generic) == "nchw" and options.resolve_layout("nhwc", generic) == "nhwc"
    with pytest.raises(ValueError, match="layout"):
        upscale_images(up, H.random_image(1, 40, 33), device="cpu", layout="nwhc")

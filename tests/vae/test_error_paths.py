"""Tiled VAE Decode / Encode error paths.

Guards: an out-of-memory attempt's tensors are released *before* the retry with smaller tiles (the retry loop kept
the exception, whose traceback held the failed frames and every device tensor they allocated, so the retry ran
with the failed attempt's activations still allocated and the cache could not be emptied); the node names what it
got when ``samples`` is not a LATENT; non-floating ``samples`` and ``pixels`` far outside 0..1 are refused by name.
"""

import pytest
import torch

import leandiffusion.vae.tiled as tiled
from leandiffusion.nodes.vae import LeanTiledVAEDecode
from leandiffusion.tests.kit import tiny_components, tiny_engine
from leandiffusion.tests.kit.faults import OutOfMemoryOnce
from leandiffusion.vae.targets import from_module


@pytest.fixture(scope="module")
def vae():
    return tiny_components("sd1")["vae"]


@pytest.mark.parametrize("seam_mode,runner", [("exact", "run_exact"), ("blend", "run_exact")])
@pytest.mark.parametrize("direction", ["decode", "encode"])
def test_out_of_memory_attempt_is_released_before_the_retry(vae, monkeypatch, seam_mode, runner, direction):
    target = from_module(vae)
    if direction == "decode":
        run = lambda: tiled.tiled_decode(target, torch.randn(1, 4, 32, 32), 256, 16, seam_mode, quiet=True)  # noqa
    else:
        run = lambda: tiled.tiled_encode(target, torch.rand(1, 256, 256, 3), 256, 16, seam_mode, quiet=True)  # noqa
    reference = run()
    fault = OutOfMemoryOnce(getattr(tiled, runner))
    monkeypatch.setattr(tiled, runner, fault)
    out = run()
    assert fault.alive_at_retry and not any(fault.alive_at_retry), \
        "the failed attempt's tensors were alive during the retry"
    assert out.shape == reference.shape


def test_last_out_of_memory_names_what_was_tried(vae, monkeypatch):
    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("injected: CUDA out of memory")

    monkeypatch.setattr(tiled, "run_exact", oom)
    with pytest.raises(torch.OutOfMemoryError, match=r"tiled VAE encode: out of memory even with 128 px tiles "
                                                     r"\(tried \[256, 128\] px.*or run it on a larger GPU\. "
                                                     r"Last error: injected"):
        tiled.tiled_encode(from_module(vae), torch.rand(1, 256, 256, 3), 256, 16, "exact", quiet=True)


def test_samples_that_are_not_a_latent_are_named():
    with pytest.raises(ValueError, match=r"samples: expected a LATENT .*got Tensor; connect"):
        LeanTiledVAEDecode().decode(torch.zeros(1, 4, 8, 8), 0, 64, "exact", lean_model=tiny_engine("sd1"))


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64])
def test_non_floating_latents_are_refused_by_name(vae, dtype):
    """int64, bool and complex LATENT samples were decoded silently (cast to the VAE's dtype) into a wrong picture."""
    with pytest.raises(TypeError, match=rf"samples: expected a floating-point LATENT, got a {dtype} tensor"):
        tiled.tiled_decode(from_module(vae), torch.zeros(1, 4, 8, 8, dtype=dtype), 0, 64, "exact", quiet=True)


@pytest.mark.parametrize("scale,shift,match", [(255.0, 0.0, r"0\.\.255"), (1.0, -1.0, r"-1\.\.0")])
def test_pixels_outside_zero_one_are_refused_by_name(vae, scale, shift, match):
    """0..255 float pixels were encoded silently; IMAGE is 0..1 (a small resampler overshoot is still accepted)."""
    pixels = torch.linspace(0, 1, 64 * 64 * 3).reshape(1, 64, 64, 3) * scale + shift
    with pytest.raises(ValueError, match=rf"pixels: values range over {match}, but a ComfyUI IMAGE holds 0\.\.1; "
                                         r"divide 8-bit"):
        tiled.tiled_encode(from_module(vae), pixels, 0, 64, "exact", quiet=True)
    overshoot = (torch.rand(1, 64, 64, 3) * 1.2 - 0.1)  # bicubic-like overshoot
    assert tiled.tiled_encode(from_module(vae), overshoot, 0, 64, "exact", quiet=True).shape == (1, 4, 8, 8)

"""Inputs too large for the machine are refused before anything is allocated, with an error naming the input.

Guards: a 12500x12500 latent_image, a batch_index of 10**10, an IMAGE whose decode / encode / upscale output cannot
fit the host, and a Stream Scheduler run whose images cannot fit used to allocate first and die after a minute
with a raw allocator error naming no input. Host memory is pinned to a small figure here (``available_host_bytes``)
so each case is decided by its own size, on any machine.
"""
import pytest
import torch

from leandiffusion.memory import host_memory
from leandiffusion.nodes.vae import LeanTiledVAEDecode, LeanTiledVAEEncode
from leandiffusion.sampling.loop import sample
from leandiffusion.sampling.settings import SamplerSettings
from leandiffusion.sampling.stream.scheduler import run_stream
from leandiffusion.sampling.stream.settings import StreamSettings
from leandiffusion.tests.kit import tiny_engine
from leandiffusion.tests.upscale import helpers as upscale_helpers
from leandiffusion.upscale.loader import build_upscaler
from leandiffusion.upscale.runner import upscale_images

MiB = 2 ** 20


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("sd1")


@pytest.fixture
def host_has(monkeypatch):
    def pin(nbytes):
        monkeypatch.setattr(host_memory, "available_host_bytes", lambda: nbytes)
    return pin


def _settings(**kw):
    base = dict(positive="a boat", negative="", seed=1, steps=2, cfg=5.0, width=64, height=64, acceleration="none")
    base.update(kw)
    return SamplerSettings(**base)


def test_the_helper_refuses_only_what_exceeds_the_available_memory(host_has):
    host_has(100 * MiB)
    host_memory.check_host_bytes(80 * MiB, "x", "a thing", "make it smaller")
    with pytest.raises(ValueError, match=r"x: a thing needs 0\.1 GiB of host memory, more than the 0\.1 GiB "
                                         r"available; make it smaller"):
        host_memory.check_host_bytes(95 * MiB, "x", "a thing", "make it smaller")
    host_has(None)
    host_memory.check_host_bytes(10 ** 15, "x", "a thing", "unknown memory refuses nothing")


def test_the_available_memory_is_read_from_the_os():
    available = host_memory.available_host_bytes()
    assert available is None or available > 0


def test_a_latent_larger_than_the_sampler_takes_is_refused_by_name(engine):
    huge = torch.zeros(1, 4, 1, 1).expand(1, 4, 12500, 12500)  # no memory behind it: the check must come first
    with pytest.raises(ValueError, match=r"latent_image is 12500x12500 \(100000x100000 px\); the sampler takes at "
                                         r"most 8192 px"):
        sample(engine, _settings(), latent_image={"samples": huge}, quiet=True)


def test_a_batch_index_whose_noise_cannot_fit_is_refused_by_name(engine, host_has):
    host_has(64 * MiB)
    latent = {"samples": torch.zeros(1, 4, 8, 8), "batch_index": [10 ** 10]}
    with pytest.raises(ValueError, match=r"latent_image\['batch_index'\]: the noise draws up to batch index "
                                         r"10000000000 need"):
        sample(engine, _settings(), latent_image=latent, quiet=True)


def test_a_decode_whose_image_cannot_fit_is_refused_by_name(engine, host_has):
    host_has(MiB)
    with pytest.raises(ValueError, match=r"samples: the decoded IMAGE \(4 x 256x256 px, float32\) needs"):
        LeanTiledVAEDecode().decode({"samples": torch.zeros(4, 4, 32, 32)}, 0, 64, "exact", lean_model=engine)


def test_an_encode_whose_working_copies_cannot_fit_is_refused_by_name(engine, host_has):
    host_has(MiB)
    with pytest.raises(ValueError, match=r"pixels: encoding a 512x512 px image \(float32 copies\) needs"):
        LeanTiledVAEEncode().encode(torch.rand(1, 512, 512, 3), 0, 64, "exact", lean_model=engine)


def test_an_upscale_whose_output_cannot_fit_is_refused_by_name(host_has):
    host_has(MiB)
    with pytest.raises(ValueError, match=r"image: the upscaled batch \(2 x 256x256 px, float32\) needs"):
        upscale_images(build_upscaler(upscale_helpers.random_compact()), torch.rand(2, 64, 64, 3), device="cpu", quiet=True)


def test_a_stream_run_whose_images_cannot_fit_is_refused_by_name(engine, host_has):
    host_has(MiB)
    s = StreamSettings.from_text("a\nb\nc\nd", negative="", seed=1, steps=2, cfg=5.0, width=256, height=256,
                                 acceleration="none", images_per_prompt=2)
    with pytest.raises(ValueError, match=r"prompts: 8 images of 256x256 px and their latents \(float32\) need"):
        run_stream(engine, s, quiet=True)


def test_what_fits_still_runs(engine, host_has):
    host_has(4 * 2 ** 30)
    out = sample(engine, _settings(), latent_image={"samples": torch.zeros(1, 4, 8, 8), "batch_index": [3]},
                 quiet=True)
    assert out["samples"].shape == (1, 4, 8, 8)

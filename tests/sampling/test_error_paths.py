"""Sampler error paths.

Guards: a connected CONDITIONING that does not fit the model is refused before the Fused DDIM Sampler opens a text
session (the string side was encoded first: under ``balanced`` that moves the text encoders onto the GPU and runs
them, for nothing); the Stream Scheduler's tiled decode releases an out-of-memory attempt's tensors before it
returns cached blocks and retries with smaller tiles (the retry loop kept the exception, whose traceback held
them, until the next attempt began); a garbled .safetensors embedding is one error naming the file; a failed
torch.compile names acceleration, the reason and the fix.
"""

import inspect

import pytest
import torch

import leandiffusion.sampling.stream.decode as stream_decode
from leandiffusion.nodes.sampler import LeanFusedDDIMSampler
from leandiffusion.sampling.prompt_encoder import PROMPT_CACHE
from leandiffusion.sampling.stream.scheduler import run_stream
from leandiffusion.sampling.stream.settings import StreamSettings
from leandiffusion.sampling.stream.streams import StageStreams
from leandiffusion.tests.kit import tiny_engine
from leandiffusion.tests.kit.faults import OutOfMemoryOnce
from leandiffusion.tests.kit.graph_backend import StandInBackend


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("sd1")


WRONG_WIDTH = [[torch.zeros(1, 77, 192), {"pooled_output": torch.zeros(1, 128)}]]  # an SDXL CLIP's output


@pytest.mark.parametrize("side", ["positive_cond", "negative_cond"])
def test_wrong_conditioning_is_refused_before_any_text_session(engine, opened_sessions, side):
    PROMPT_CACHE.clear()  # a cached prompt would hide the encoding
    args = dict(lean_model=engine, positive="a boat", negative="fog", seed=1, steps=2, cfg=5.0, eta=0.0, width=64,
                height=64, batch_size=1, timestep_spacing="leading", cfg_mode="batched", acceleration="none")
    with pytest.raises(ValueError, match=f"{side}: the conditioning has 192 channels but the sd1 model expects 64"):
        LeanFusedDDIMSampler().run(**args, **{side: WRONG_WIDTH})
    assert opened_sessions == [], f"sessions opened before the error: {opened_sessions}"


def test_stream_tiled_decode_releases_the_failed_attempt_before_retrying(engine, monkeypatch):
    """The failed attempt's tensors are gone when the retry loop returns cached blocks to the driver (before the
    fix they were freed one step later, so that release found them still allocated) and when the retry runs."""
    run_exact, alive_at_release = OutOfMemoryOnce(stream_decode.run_exact), []
    real_release = StageStreams.release_cached

    def release_cached(self):
        if run_exact.failed is not None:
            alive_at_release.append(run_exact.failed_attempt_alive())
        return real_release(self)

    s = StreamSettings.from_text("a boat", seed=2, steps=1, cfg=5.0, width=64, height=64, acceleration="none",
                                 decode_tile_size=256)
    reference = run_stream(engine, s, quiet=True)
    monkeypatch.setattr(stream_decode, "run_exact", run_exact)
    monkeypatch.setattr(StageStreams, "release_cached", release_cached)
    result = run_stream(engine, s, quiet=True)
    assert alive_at_release and not any(alive_at_release), "the failed attempt's tensors were alive at the release"
    assert run_exact.alive_at_retry == [False], "the failed attempt's tensors were alive during the retry"
    assert torch.allclose(result.images, reference.images, atol=1e-5)


def test_corrupt_safetensors_embedding_is_one_named_error(engine, tmp_path, monkeypatch):
    """A garbled ``.safetensors`` textual inversion gave a bare ``SafetensorError: ... header too large`` (no file,
    no fix); the ``.pt`` path already went through ``torchfile``."""
    (tmp_path / "embeddings").mkdir()
    (tmp_path / "embeddings" / "garbled.safetensors").write_bytes(b"not a safetensors file" * 4)
    monkeypatch.setenv("LEANDIFFUSION_MODELS", str(tmp_path))
    PROMPT_CACHE.clear()
    args = dict(lean_model=engine, positive="a boat, embedding:garbled", negative="", seed=1, steps=1, cfg=5.0,
                eta=0.0, width=64, height=64, batch_size=1, timestep_spacing="leading", cfg_mode="batched",
                acceleration="none")
    with pytest.raises(ValueError, match=r"embedding file 'garbled.safetensors' could not be read as a safetensors "
                                         r"file \(.*header.*\); re-download it"):
        LeanFusedDDIMSampler().run(**args)


def test_failed_torch_compile_names_the_acceleration_and_the_fix(engine, monkeypatch):
    """A compile that fails (no working Triton, no C++ compiler: common on desktop installs) surfaced as dynamo's
    BackendCompilerFailed, paragraphs ending in advice to set ``suppress_errors``; now one line naming the input,
    the backend's reason and the fix. Nothing is cached, and the next run gives the plain result."""
    import leandiffusion.sampling.loop as loop
    from torch._dynamo.exc import BackendCompilerFailed

    from leandiffusion.sampling.graph_runner import GraphRunner
    from leandiffusion.sampling.settings import SamplerSettings

    def compiled_unet_fn(engine):
        def call(*args, **kwargs):
            inner = RuntimeError("Cannot find a working triton installation. Either the package is not installed "
                                 "or it is too old.\nMore information on installing Triton can be found at ...")
            extra = (None,) if len(inspect.signature(BackendCompilerFailed.__init__).parameters) > 3 else ()
            raise BackendCompilerFailed(lambda *a: None, inner, *extra)  # 2.4-2.6 take no first frame
        return call

    monkeypatch.setattr(loop, "compiled_unet_fn", compiled_unet_fn)
    runner = GraphRunner(StandInBackend())
    settings = dict(positive="a boat", negative="", seed=4, steps=2, cfg=5.0, width=64, height=64)
    with pytest.raises(RuntimeError) as info:
        loop.sample(engine, SamplerSettings(acceleration="compile+cuda_graph", **settings), runner=runner, quiet=True)
    message = str(info.value)
    assert message.startswith("acceleration='compile+cuda_graph': torch.compile could not compile the UNet "
                              "(RuntimeError: Cannot find a working triton installation.")
    assert "use acceleration='cuda_graph'" in message and "\n" not in message and "suppress_errors" not in message
    assert runner.cached_keys(engine) == []
    again = loop.sample(engine, SamplerSettings(acceleration="cuda_graph", **settings), runner=runner, quiet=True)
    plain = loop.sample(engine, SamplerSettings(acceleration="none", **settings), quiet=True)
    assert torch.equal(again["samples"], plain["samples"])


@pytest.mark.parametrize("samples,match", [
    (torch.zeros(1, 4, 2, 8, 8), r"latent_image\['samples'\]: expected a float tensor \[B, C, h, w\], got "
                                 r"torch.Size\(\[1, 4, 2, 8, 8\]\)"),  # a video LATENT [B, C, T, h, w]
    (torch.zeros(1, 4, 8, 8, dtype=torch.int64), r"expected a float tensor \[B, C, h, w\]"),
    ([[0.0]], r"expected a float tensor \[B, C, h, w\], got list"),
    (torch.zeros(1, 4, 0, 8), r"latent_image\['samples'\] is empty: shape \(1, 4, 0, 8\)"),
    (torch.zeros(0, 4, 8, 8), r"latent_image\['samples'\] is empty: shape \(0, 4, 8, 8\)"),
])
def test_latents_the_sampler_cannot_take_are_refused_by_name(engine, samples, match):
    """Each latent the sampler cannot take is refused with a ``ValueError`` that says what it got."""
    args = dict(lean_model=engine, positive="a boat", negative="", seed=1, steps=2, cfg=5.0, eta=0.0, width=64,
                height=64, batch_size=1, timestep_spacing="leading", cfg_mode="batched", acceleration="none")
    with pytest.raises(ValueError, match=match):
        LeanFusedDDIMSampler().run(**args, latent_image={"samples": samples})


def test_stream_tiled_decode_out_of_memory_at_the_smallest_tile_says_what_it_tried(engine, monkeypatch):
    """Guide 9 (degrade, then re-raise with what was tried): the tiled decode halves its tile down to 128 px, then
    raises naming every size it tried and the fix; the run returns nothing, and the next run of the same engine
    works."""
    attempts = []

    def always_oom(program, z, cfg, *args, **kwargs):
        attempts.append(cfg.tile_px)
        raise torch.OutOfMemoryError("injected: CUDA out of memory")

    s = StreamSettings.from_text("a boat", seed=2, steps=1, cfg=5.0, width=64, height=64, acceleration="none",
                                 decode_tile_size=512)
    reference = run_stream(engine, s, quiet=True)
    monkeypatch.setattr(stream_decode, "run_exact", always_oom)
    with pytest.raises(torch.OutOfMemoryError, match=r"Stream Scheduler Sampler: tiled VAE decode ran out of memory "
                                                     r"even with 128 px tiles \(tried \[512, 256, 128\] px\); free "
                                                     r"VRAM or lower the resolution. Last error: injected") as info:
        run_stream(engine, s, quiet=True)
    assert attempts == [512, 256, 128]
    # the note named "images 1.." (past the last image) as in progress: the decode fails after the UNet loop
    assert "0 of 1 images were finished (unfinished: images 0); nothing was returned" in \
        "".join(getattr(info.value, "__notes__", []))
    monkeypatch.undo()
    assert torch.equal(run_stream(engine, s, quiet=True).images, reference.images)

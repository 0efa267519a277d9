"""Stream Scheduler Sampler on a GPU: real CUDA streams, events, page-locked copies and CUDA graphs.

Guards what the CPU cannot exercise: a missing event or ``record_stream`` (a stage reading a tensor before it is
written, or memory recycled under a pending copy) shows up as rows that differ from the one-prompt run; a batch
of one must replay the Fused DDIM Sampler's own cached graph (bit-identical); under the ``balanced`` policy the
text encoders and the VAE move to the device on their side streams while the UNet runs; the timeline shows the
three stages on three streams.
"""
import pytest
import torch

from leandiffusion.memory.load import build_engine
from leandiffusion.sampling.loop import sample
from leandiffusion.sampling.stream.scheduler import run_stream
from leandiffusion.sampling.stream.settings import StreamSettings
from leandiffusion.sampling.stream.streams import Timeline
from leandiffusion.tests.kit import tiny_engine, tiny_parts
from leandiffusion.vae.untiled import vae_decode

pytestmark = pytest.mark.gpu

PROMPTS = "a red boat\na lighthouse\nsnowy forest\na cat\na dog"


def _settings(**kw):
    base = dict(negative="blurry", seed=21, steps=4, cfg=6.0, width=128, height=128, acceleration="cuda_graph")
    base.update(kw)
    return StreamSettings.from_text(base.pop("prompts", PROMPTS), **base)


def _refs(engine, s):
    s = s.validated()
    return torch.cat([sample(engine, s.sampler_settings(s.prompts[j.prompt_index], j.seed), quiet=True)["samples"]
                      for j in s.jobs()])


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("sd1", device="cuda", dtype=torch.float16)


def test_batch_of_one_replays_the_fused_samplers_graph_bit_identically(engine):
    s = _settings(max_batch=1)
    result = run_stream(engine, s, quiet=True)
    assert torch.equal(result.latents, _refs(engine, s))


@pytest.mark.parametrize("acceleration", ["none", "cuda_graph"])
def test_batched_rows_match_within_fp16(engine, acceleration):
    s = _settings(max_batch=2, images_per_prompt=2, acceleration=acceleration)
    result = run_stream(engine, s, quiet=True)
    ref = _refs(engine, _settings(max_batch=1, images_per_prompt=2, acceleration=acceleration))
    for n in range(ref.shape[0]):
        rel = ((result.latents[n] - ref[n]).abs().max() / ref[n].abs().max()).item()
        assert rel <= 5e-3, f"image {n}: relative diff {rel:.3g}"
    with engine.session("vae"):
        want = vae_decode(engine, result.latents)
    assert (result.images - want).abs().max().item() <= 2e-3


def test_balanced_policy_moves_stages_on_side_streams():
    eng = build_engine(tiny_parts("sd1"), "balanced", device="cuda", weight_dtype="fp16", vae_dtype="fp32")
    s = _settings(max_batch=2)
    timeline = Timeline()
    result = run_stream(eng, s, timeline=timeline, quiet=True)
    ref = _refs(eng, _settings(max_batch=1))
    for n in range(ref.shape[0]):
        rel = ((result.latents[n] - ref[n]).abs().max() / ref[n].abs().max()).item()
        assert rel <= 5e-3, f"image {n}: relative diff {rel:.3g}"
    spans = timeline.to_list()
    assert {sp["stage"] for sp in spans} == {"text", "unet", "vae"}
    assert torch.cuda.memory_allocated() < 2 ** 30


def test_decode_tiles_on_gpu(engine):
    """The stream's tiled decode (exact tiles, 128 px) equals the engine's untiled decode of the same latents.

    The fixture's VAE runs in fp16, so tiles and the whole image round differently (about four fp16 ulps near 0.5).
    The bound is the acceptance line for exact fp16 tiles, 2/255; a misplaced tile or a
    wrong GroupNorm statistic shows up at 1e-1 and above.
    """
    s = _settings(prompts="a red boat", images_per_prompt=2, max_batch=2, decode_tile_size=128, width=256,
                  height=256, steps=2)
    result = run_stream(engine, s, quiet=True)
    with engine.session("vae"):
        want = vae_decode(engine, result.latents)
    assert (result.images - want).abs().max().item() <= 2 / 255

"""GPU: the Stream Edit Sampler's pipeline on real CUDA streams (tiny random Qwen-Image-Edit, bf16, ``full``, so the
encode of batch k+1 and the decode of batch k-1 run beside batch k's CUDA-graph steps) gives each edit its one-image
Fused Edit Sampler run with seed + n.

Guards: a hand-over without its event (the ``unet`` stream reading text rows the ``text`` stream has not written, or
the ``vae`` stream decoding a latent before its last step), a buffer recycled while another stream still reads it,
a decode written into the wrong row. At ``max_batch`` 1 every DiT call has the one-image run's shapes, so the
kernels are the same and the edits must be equal bit for bit; batched, cuBLAS may pick other kernels for the
larger matrix products, so the rows are compared within bf16 rounding. IMAGE rows are checked against the untiled
decode of their own LATENT.
"""
import pytest
import torch

from leandiffusion.sampling.graph_runner import GraphRunner
from leandiffusion.sampling.qwen.edit import sample_qwen_edit
from leandiffusion.sampling.qwen.edit_stream import EditStreamSettings, overlaps, run_edit_stream
from leandiffusion.tests.kit.qwen_edit import image_batch
from leandiffusion.vae.untiled import vae_decode

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BATCHED_REL = 2e-2  # bf16 rounding of other GEMM kernels, compounded over the steps; a wrong row is O(1) away


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module")
def engine(edit_folder):
    from leandiffusion.memory.load import load_engine

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LEANDIFFUSION_MODELS", str(edit_folder.parent.parent))
        return load_engine(edit_folder.name, "full", weight_dtype="bf16", device="cuda")


@pytest.fixture(scope="module")
def four():
    return image_batch(3, 4, 72, 104)


@pytest.fixture(scope="module")
def singles(engine, four):
    s = _settings(0)
    runner = GraphRunner()
    return [sample_qwen_edit(engine, s.one_image(n), four[n:n + 1], quiet=True, runner=runner)["samples"]
            for n in range(4)]


def _settings(max_batch):
    return EditStreamSettings("make it red", "blurry, dark", seed=5, steps=4, true_cfg=4.0, megapixels=0.0625,
                              acceleration="cuda_graph", max_batch=max_batch)


def test_the_pipeline_overlaps_on_this_engine(engine):
    assert overlaps(engine)


def test_one_image_batches_equal_the_one_image_runs_bit_for_bit(engine, four, singles):
    result = run_edit_stream(engine, _settings(1), images=four, runner=GraphRunner(), quiet=True)
    latents, images = result.latents[0], result.images[0]
    assert result.batch_sizes == (1, 1, 1, 1)
    for n in range(4):
        assert torch.equal(latents[n:n + 1], singles[n]), (n, (latents[n:n + 1] - singles[n]).abs().max().item())
        decoded = vae_decode(engine, latents[n:n + 1])
        assert (images[n:n + 1] - decoded).abs().max().item() < 1e-2
    assert singles[0].abs().max().item() > 0.5 and not torch.equal(singles[0], singles[1])


@pytest.mark.parametrize("max_batch", [2, 0])
def test_batched_edits_equal_the_one_image_runs(engine, four, singles, max_batch):
    result = run_edit_stream(engine, _settings(max_batch), images=four, runner=GraphRunner(), quiet=True)
    latents = result.latents[0]
    assert sum(result.batch_sizes) == 4 and max(result.batch_sizes) > 1
    for n in range(4):
        assert _rel(latents[n:n + 1], singles[n]) < BATCHED_REL, n

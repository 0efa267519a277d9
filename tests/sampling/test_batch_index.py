"""A LATENT's ``batch_index`` picks each row's noise the way ComfyUI's KSampler does.

Guards: the Fused DDIM Sampler ignored ``batch_index`` (what ComfyUI's Latent From Batch / Repeat Latent Batch write),
so "regenerate image 3 of this batch" gave image 1's noise; the output LATENT dropped the key, which core nodes
downstream read. The reference is ComfyUI 0.3.64's ``comfy.sample.prepare_noise`` rule, transcribed below in plain
torch (one ``[1, C, h, w]`` draw per index up to the largest; row i takes draw ``batch_index[i]``).
"""
import pytest
import torch

from leandiffusion.sampling.loop import sample
from leandiffusion.sampling.settings import SamplerSettings
from leandiffusion.tests.kit import tiny_engine


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("sd1")


def _settings(**kw):
    base = dict(positive="a lighthouse", negative="", seed=11, steps=3, cfg=6.0, width=64, height=64,
                acceleration="none", denoise=0.8)
    base.update(kw)
    return SamplerSettings(**base)


def _comfyui_noise(shape, seed, batch_index):
    g = torch.Generator().manual_seed(seed)
    draws = []
    for i in range(max(batch_index) + 1):
        draws.append(torch.randn([1] + list(shape[1:]), generator=g))
    return torch.cat([draws[i] for i in batch_index])


def test_initial_noise_follows_comfyuis_rule():
    from leandiffusion.sampling.latent_input import initial_noise

    shape = (3, 4, 5, 3)  # 60 values a row: a whole-batch draw differs from row-by-row draws at this size
    for index in ([2, 0, 2], [4, 5, 6], [0, 1, 2]):
        got = initial_noise(shape, torch.Generator().manual_seed(3), index)
        assert torch.equal(got, _comfyui_noise(shape, 3, index))
    whole = initial_noise(shape, torch.Generator().manual_seed(3), None)
    assert torch.equal(whole, torch.randn(shape, generator=torch.Generator().manual_seed(3)))
    assert not torch.equal(whole, _comfyui_noise(shape, 3, [0, 1, 2]))


def test_one_row_with_batch_index_regenerates_that_row_of_the_batch(engine):
    torch.manual_seed(1)
    batch = torch.randn(3, 4, 8, 8)
    full = sample(engine, _settings(), latent_image={"samples": batch, "batch_index": [0, 1, 2]}, quiet=True)
    one = sample(engine, _settings(), latent_image={"samples": batch[2:3].clone(), "batch_index": [2]}, quiet=True)
    assert one["batch_index"] == [2] and full["batch_index"] == [0, 1, 2]
    # fp32 UNet on the CPU: a batch of 3 and a batch of 1 round differently (measured 3.5e-5 relative, 1.3e-4
    # absolute on values up to ~4); another row's noise differs by O(1)
    torch.testing.assert_close(one["samples"][0], full["samples"][2], atol=1e-4, rtol=1e-4)
    assert (one["samples"][0] - full["samples"][0]).abs().max() > 0.1


def test_batch_index_drives_noise_end_to_end(engine):
    """From a zero latent only the noise tells rows apart: swapping the indices swaps the output rows."""
    lat = torch.zeros(2, 4, 8, 8)
    picked = sample(engine, _settings(), latent_image={"samples": lat, "batch_index": [1, 0]}, quiet=True)
    plain = sample(engine, _settings(), latent_image={"samples": lat, "batch_index": [0, 1]}, quiet=True)
    torch.testing.assert_close(picked["samples"][0], plain["samples"][1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(picked["samples"][1], plain["samples"][0], atol=1e-4, rtol=1e-4)


def test_repeated_latent_extends_batch_index_like_repeat_latent_batch(engine):
    lat = torch.zeros(1, 4, 8, 8)
    out = sample(engine, _settings(batch_size=3), latent_image={"samples": lat, "batch_index": [4]}, quiet=True)
    assert out["batch_index"] == [4, 5, 6]
    ref = sample(engine, _settings(), latent_image={"samples": lat, "batch_index": [6]}, quiet=True)
    torch.testing.assert_close(out["samples"][2], ref["samples"][0], atol=1e-4, rtol=1e-4)


def test_no_batch_index_keeps_the_whole_batch_draw(engine):
    lat = torch.zeros(2, 4, 8, 8)
    out = sample(engine, _settings(), latent_image={"samples": lat}, quiet=True)
    assert "batch_index" not in out


@pytest.mark.parametrize("bad", [[0], [0, -1], [0, 1.5], "01", [True, 1]])
def test_bad_batch_index_is_named(engine, bad):
    with pytest.raises(ValueError, match=r"latent_image\['batch_index'\]"):
        sample(engine, _settings(), latent_image={"samples": torch.zeros(2, 4, 8, 8), "batch_index": bad}, quiet=True)


@pytest.mark.comfyui
def test_initial_noise_equals_comfyuis_prepare_noise():
    """Against ComfyUI's own function (needs COMFYUI_PATH), not only the transcription above. Only that function
    is taken from ``comfy/sample.py`` (importing the module needs scipy and ComfyUI's model stack)."""
    import ast
    import os

    import numpy as np

    from leandiffusion.sampling.latent_input import initial_noise

    source = open(os.path.join(os.environ["COMFYUI_PATH"], "comfy", "sample.py")).read()
    func = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "prepare_noise")
    namespace = {"torch": torch, "np": np}
    exec(compile(ast.Module(body=[func], type_ignores=[]), "comfy/sample.py", "exec"), namespace)
    prepare_noise = namespace["prepare_noise"]
    for shape, index in (((3, 4, 5, 3), [2, 0, 2]), ((2, 4, 8, 8), [7, 3]), ((2, 16, 6, 10), None)):
        want = prepare_noise(torch.zeros(shape), 123, index)
        assert torch.equal(initial_noise(shape, torch.Generator().manual_seed(123), index), want)


def test_batch_index_given_as_a_tensor_counts_like_the_list(engine):
    """A tensor ``batch_index`` (another pack's latent node) picks the same noise."""
    lat = torch.zeros(2, 4, 8, 8)
    listed = sample(engine, _settings(), latent_image={"samples": lat, "batch_index": [1, 0]}, quiet=True)
    tensor = sample(engine, _settings(), latent_image={"samples": lat, "batch_index": torch.tensor([1, 0])},
                    quiet=True)
    assert tensor["batch_index"] == [1, 0]
    assert torch.equal(tensor["samples"], listed["samples"])

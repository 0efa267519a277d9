"""ComfyUI's starting noise (``sampling.ksampler.latent_noise``): one seeded CPU draw of the latent's shape, the
``batch_index`` rule (draws ``0..max`` of ``[1, C, h, w]`` in turn, row ``i`` takes draw ``batch_index[i]``), no
global random state touched, and the empty-latent channel fix. The reference is plain torch with the rule written
out here; bit equality with ``comfy.sample`` is ``tests/integration/test_comfyui_ksampler_sigmas.py``'s."""
import pytest
import torch

from leandiffusion.sampling.ksampler.latent_noise import fix_empty_latent_channels, prepare_noise


def test_the_whole_batch_is_one_seeded_draw():
    latent = torch.zeros(2, 4, 5, 3)
    want = torch.randn((2, 4, 5, 3), generator=torch.Generator().manual_seed(42))
    got = prepare_noise(latent, 42)
    assert got.dtype == torch.float32 and got.device.type == "cpu" and torch.equal(got, want)
    assert torch.equal(prepare_noise(latent, 42), got) and not torch.equal(prepare_noise(latent, 43), got)
    big = 0xFFFFFFFFFFFFFFFF  # ComfyUI's largest seed
    assert torch.equal(prepare_noise(latent, big), torch.randn((2, 4, 5, 3), generator=torch.Generator().manual_seed(big)))


@pytest.mark.parametrize("index", [[0, 1], [1, 0], [3, 1], [2, 2, 0]])
def test_batch_index_rows_take_their_draw_of_the_sequence(index):
    shape = (len(index), 4, 3, 3)
    gen = torch.Generator().manual_seed(7)
    draws = [torch.randn((1, 4, 3, 3), generator=gen) for _ in range(max(index) + 1)]
    got = prepare_noise(torch.zeros(shape), 7, index)
    assert got.shape == shape
    for row, i in enumerate(index):
        assert torch.equal(got[row], draws[i][0])
    assert torch.equal(prepare_noise(torch.zeros(shape), 7, torch.tensor(index)), got)


def test_the_global_generator_is_left_alone():
    state = torch.random.get_rng_state()
    prepare_noise(torch.zeros(1, 4, 2, 2), 5)
    prepare_noise(torch.zeros(2, 4, 2, 2), 5, [1, 0])
    assert torch.equal(torch.random.get_rng_state(), state)


def test_an_empty_latent_of_other_channels_becomes_the_models_zeros():
    sd_empty = torch.zeros(2, 4, 8, 6)
    fixed = fix_empty_latent_channels(sd_empty, 16)
    assert fixed.shape == (2, 16, 8, 6) and fixed.dtype == sd_empty.dtype and not fixed.any()
    assert fix_empty_latent_channels(torch.zeros(1, 16, 4, 4), 4).shape == (1, 4, 4, 4)
    image = torch.zeros(1, 4, 8, 8)
    image[0, 0, 0, 0] = 1.0
    assert fix_empty_latent_channels(image, 16) is image  # a real latent is never replaced (the checks refuse it)
    right = torch.zeros(1, 16, 4, 4)
    assert fix_empty_latent_channels(right, 16) is right


@pytest.mark.parametrize("call, error, match", [
    (lambda: prepare_noise(torch.zeros(2, 4, 2, 2), -1), ValueError, "seed=-1"),
    (lambda: prepare_noise(torch.zeros(2, 4, 2, 2), 1.5), TypeError, "seed=1.5"),
    (lambda: prepare_noise(torch.zeros(2, 4, 2, 2), 0, [0]), ValueError, "batch_index"),
    (lambda: prepare_noise(torch.zeros(2, 4, 2, 2), 0, [0, -1]), ValueError, "batch_index"),
    (lambda: prepare_noise(torch.zeros(2, 4, 2, 2), 0, [0, 0.5]), ValueError, "batch_index"),
    (lambda: prepare_noise([[0.0]], 0), ValueError, "latent: expected a float tensor"),
    (lambda: prepare_noise(torch.zeros(2, 4, 2, 2, dtype=torch.long), 0), ValueError, "latent"),
    (lambda: fix_empty_latent_channels(torch.zeros(1, 4, 2, 2), 0), ValueError, "channels=0"),
])
def test_bad_inputs_are_refused_by_name(call, error, match):
    with pytest.raises(error, match=match):
        call()

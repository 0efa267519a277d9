"""``step_noise`` draws the per-step noise ComfyUI's samplers get (equality with ComfyUI itself is the comfyui-marked
worker test's): the Gaussian sampler is torch's seeded generator stream, the Brownian sampler is a torchsde Brownian
tree over the run's sigma range whose draws are unit-variance, consistent across step sizes (increments add up) and
reproducible from the seed; bad seeds, latents and sigmas fail with a ValueError naming them."""
import pytest
import torch
import torchsde

from leandiffusion.sampling.ksampler.step_noise import brownian_noise_sampler, gaussian_noise_sampler

# torchsde warns when a query equals an end of the tree's interval up to its own rounding of the ends
pytestmark = pytest.mark.filterwarnings("ignore:Should have:UserWarning")
SIGMAS = torch.tensor([14.6, 6.1, 2.2, 0.7, 0.15, 0.0])


def test_gaussian_draws_are_the_seeded_generator_stream():
    x = torch.zeros(2, 4, 5, 3)
    draw = gaussian_noise_sampler(x, 1234)
    reference = torch.Generator().manual_seed(1234)
    for step in range(3):
        expected = torch.randn(x.shape, generator=reference)
        got = draw(SIGMAS[step], SIGMAS[step + 1])
        assert torch.equal(got, expected)
    assert not torch.equal(draw(None, None), draw(None, None))  # a fresh draw each call


def test_gaussian_draws_take_the_latents_dtype():
    x = torch.zeros(1, 4, 8, 8, dtype=torch.float16)
    draw = gaussian_noise_sampler(x, 2 ** 64 - 1)  # the top of ComfyUI's seed range
    got = draw(SIGMAS[0], SIGMAS[1])
    assert got.dtype == torch.float16 and got.shape == x.shape
    expected = torch.randn(x.shape, dtype=torch.float16, generator=torch.Generator().manual_seed(2 ** 64 - 1))
    assert torch.equal(got, expected)


def test_brownian_draw_is_the_trees_increment_over_its_step():
    x = torch.zeros(2, 3, 4, 4)
    draw = brownian_noise_sampler(x, SIGMAS, 7, None)
    tree = torchsde.BrownianTree(torch.tensor(0.15), torch.zeros_like(x), torch.tensor(14.6), entropy=7)
    for high, low in zip(SIGMAS[:-2], SIGMAS[1:-1]):
        expected = -tree(low, high) / (high - low).sqrt()  # stepping down in sigma walks the path backwards
        torch.testing.assert_close(draw(high, low), expected, rtol=0, atol=1e-6)


def test_brownian_increments_add_up_across_step_sizes():
    x = torch.zeros(1, 4, 16, 16)
    draw = brownian_noise_sampler(x, SIGMAS, 3, None)
    a, b, c = SIGMAS[1], SIGMAS[2], SIGMAS[3]
    whole = draw(a, c) * (a - c).sqrt()
    parts = draw(a, b) * (a - b).sqrt() + draw(b, c) * (b - c).sqrt()
    torch.testing.assert_close(parts, whole, rtol=0, atol=1e-5)
    torch.testing.assert_close(draw(c, a), -draw(a, c), rtol=0, atol=0)  # reversed query, reversed increment


def test_brownian_draws_are_unit_variance_and_seeded():
    x = torch.zeros(2, 4, 48, 48)
    first, again = brownian_noise_sampler(x, SIGMAS, 11, None), brownian_noise_sampler(x, SIGMAS, 11, None)
    other = brownian_noise_sampler(x, SIGMAS, 12, None)
    draws = [first(SIGMAS[i], SIGMAS[i + 1]) for i in range(4)]
    assert all(abs(d.std().item() - 1) < 0.05 and abs(d.mean().item()) < 0.05 for d in draws)
    assert torch.equal(again(SIGMAS[2], SIGMAS[3]), draws[2])
    assert not torch.allclose(other(SIGMAS[2], SIGMAS[3]), draws[2])


def test_brownian_draws_take_the_sigmas_dtype_and_ignore_zero_sigmas():
    x = torch.zeros(1, 4, 6, 6, dtype=torch.float16)
    draw = brownian_noise_sampler(x, SIGMAS, 0, None)  # the tree spans [0.15, 14.6]: the final 0 is left out
    got = draw(SIGMAS[3], SIGMAS[4])
    assert got.dtype == torch.float32 and got.shape == x.shape and torch.isfinite(got).all()


@pytest.mark.parametrize("seed", [-1, 2 ** 64, 1.5, True, "7"])
def test_bad_seed_is_named(seed):
    with pytest.raises(ValueError, match="seed="):
        gaussian_noise_sampler(torch.zeros(1, 4, 2, 2), seed)
    with pytest.raises(ValueError, match="seed="):
        brownian_noise_sampler(torch.zeros(1, 4, 2, 2), SIGMAS, seed, None)


def test_bad_latent_and_sigmas_are_named():
    with pytest.raises(ValueError, match="x: .*torch.int64"):
        gaussian_noise_sampler(torch.zeros(1, 4, 2, 2, dtype=torch.long), 0)
    with pytest.raises(ValueError, match="sigmas: .*1-D"):
        brownian_noise_sampler(torch.zeros(1, 4, 2, 2), SIGMAS.view(2, 3), 0, None)
    with pytest.raises(ValueError, match="sigmas=.*positive"):
        brownian_noise_sampler(torch.zeros(1, 4, 2, 2), torch.zeros(3), 0, None)

"""``unipc.sample_uni_pc`` without ComfyUI (its equality to ComfyUI is ``test_comfyui_dpm_unipc.py``'s): it solves
the linear toy ODE to high order on both sigma scales, makes ComfyUI's number of model calls (one per step: the
final step has no corrector), writes 0.001 over a final sigma of 0 in the caller's tensor as ComfyUI does, keeps
batch rows independent, reports every step to the callback, and refuses bad sigmas."""
import pytest
import torch

from leandiffusion.sampling.ksampler.unipc import SAMPLERS, sample_uni_pc
from leandiffusion.tests.sampling.ksampler.gaussian_toy import exact_end, ideal_denoiser, log_sigmas

RANGE = {False: (10.0, 0.05), True: (0.9, 0.05)}


def _toy(x, sigma):
    s = sigma.view(-1, 1, 1, 1)
    return torch.tanh(x * 1.3 + 0.2) / (1 + 0.1 * s) - 0.05 * x * s.sin()


@pytest.mark.parametrize("flow", [False, True], ids=["eps", "flow"])
def test_converges_to_the_ode_solution_faster_than_second_order_solvers_need(flow):
    """float64 so the order shows: from 32 to 128 steps a first-order solver gains 4x, UniPC >= 12x."""
    x = torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    errors = []
    for steps in (32, 128):
        sigmas = log_sigmas(*RANGE[flow], steps)
        out = sample_uni_pc(ideal_denoiser(flow), x.clone(), sigmas)
        exact = exact_end(x, sigmas, flow)
        errors.append(((out - exact).norm() / exact.norm()).item())
    assert errors[0] / errors[1] > 12, errors
    assert errors[0] < 2e-4, errors


@pytest.mark.parametrize("steps", [1, 2, 3, 4, 9])
def test_one_model_call_per_step_and_a_callback_after_each(steps):
    x = torch.randn(2, 4, 5, 5, generator=torch.Generator().manual_seed(1))
    sigmas = log_sigmas(12.0, 0.1, steps, dtype=torch.float32)
    calls, seen = [], []

    def denoiser(x_in, sigma):
        calls.append(sigma.clone())
        return _toy(x_in, sigma)

    out = sample_uni_pc(denoiser, x, sigmas, callback=lambda i, xi, d: seen.append((i, xi)))
    assert len(calls) == steps and [i for i, _ in seen] == list(range(steps))
    assert all(c.shape == (2,) for c in calls) and out.shape == x.shape
    # callbacks see UniPC's x, scaled by alpha = 1 / sqrt(sigma^2 + 1)
    torch.testing.assert_close(seen[-1][1], out / (1 + float(sigmas[-1]) ** 2) ** 0.5, rtol=1e-6, atol=1e-6)


def test_one_step_only_rescales_as_comfyuis_order_zero_does():
    x = torch.randn(2, 4, 5, 5, generator=torch.Generator().manual_seed(2))
    sigmas = torch.tensor([3.0, 0.5])
    out = sample_uni_pc(_toy, x, sigmas)
    torch.testing.assert_close(out, x * (1 + 0.5 ** 2) ** 0.5 / (1 + 3.0 ** 2) ** 0.5, rtol=1e-6, atol=1e-6)


def test_a_final_sigma_of_zero_becomes_0_001_in_the_callers_tensor():
    x = torch.randn(2, 4, 5, 5, generator=torch.Generator().manual_seed(3))
    sigmas = torch.tensor([6.0, 2.0, 0.7, 0.2, 0.0])
    out = sample_uni_pc(_toy, x, sigmas)
    assert torch.equal(sigmas, torch.tensor([6.0, 2.0, 0.7, 0.2, 0.001]))
    assert torch.equal(out, sample_uni_pc(_toy, x, torch.tensor([6.0, 2.0, 0.7, 0.2, 0.001])))


def test_batch_rows_are_independent():
    x = torch.randn(3, 4, 6, 5, generator=torch.Generator().manual_seed(4))
    sigmas = torch.tensor([9.0, 4.0, 1.5, 0.5, 0.1, 0.0])
    whole = sample_uni_pc(_toy, x, sigmas.clone())
    for row in range(3):
        torch.testing.assert_close(whole[row:row + 1], sample_uni_pc(_toy, x[row:row + 1], sigmas.clone()),
                                   rtol=1e-6, atol=1e-6)


def test_bad_sigmas_are_refused():
    x = torch.randn(1, 4, 4, 4)
    with pytest.raises(ValueError, match=r"sigmas=\(2, 3\): uni_pc takes a 1-D float tensor"):
        sample_uni_pc(_toy, x, torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"sigmas=\[\]: uni_pc needs at least one sigma"):
        sample_uni_pc(_toy, x, torch.ones(0))
    assert SAMPLERS["uni_pc"].noise is None

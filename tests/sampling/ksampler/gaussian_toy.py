"""Gaussian data ``x0 ~ N(0, S^2)`` whose ideal denoiser is known in closed form: the probability-flow ODE of both
sigma scales (discrete ``x = x0 + sigma n``, flow ``x = (1 - sigma) x0 + sigma n``) is then linear and keeps
``x / marginal_std(sigma)`` constant, so every deterministic sampler has an exact answer to converge to."""
import math

import torch

S = 0.8  # the data's standard deviation


def ideal_denoiser(flow: bool):
    """E[x0 | x] at sigma (a [B] tensor)."""
    def denoise(x, sigma):
        s = sigma.view(-1, *([1] * (x.ndim - 1)))
        if flow:
            return x * (1 - s) * S ** 2 / ((1 - s) ** 2 * S ** 2 + s ** 2)
        return x * S ** 2 / (S ** 2 + s ** 2)
    return denoise


def marginal_std(sigma: float, flow: bool) -> float:
    return math.hypot((1 - sigma) * S, sigma) if flow else math.hypot(S, sigma)


def log_sigmas(high: float, low: float, steps: int, dtype=torch.float64) -> torch.Tensor:
    """``steps + 1`` sigmas from ``high`` down to ``low`` (> 0), uniform in log sigma."""
    return torch.linspace(math.log(high), math.log(low), steps + 1, dtype=dtype).exp()


def exact_end(x: torch.Tensor, sigmas: torch.Tensor, flow: bool) -> torch.Tensor:
    """The ODE's solution at ``sigmas[-1]`` from ``x`` at ``sigmas[0]``."""
    return x * (marginal_std(float(sigmas[-1]), flow) / marginal_std(float(sigmas[0]), flow))

"""The samplers' per-step noise, drawn as ComfyUI draws it for the same seed.

- Gaussian (ancestral samplers, lcm): one ``torch.Generator`` on the latent's device seeded with ``seed``, a
  ``randn`` of the latent's shape and dtype per call (``k_diffusion.sampling.default_noise_sampler``).
- Brownian tree (SDE samplers): torchsde's ``BrownianTree`` over ``[sigma_min, sigma_max]`` (smallest positive and
  largest sigma of the run), built and queried on the CPU in float32 with entropy ``seed``; a call returns the
  increment between the two sigmas divided by the square root of their distance (``BrownianTreeNoiseSampler``).
Why torchsde: the Brownian tree's values depend on its exact splitting algorithm; only the same library gives the
same noise.
"""
from __future__ import annotations

from typing import Callable

import torch

NoiseSampler = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def gaussian_noise_sampler(x: torch.Tensor, seed: int) -> NoiseSampler:
    generator = torch.Generator(device=x.device)
    generator.manual_seed(seed)
    return lambda sigma, sigma_next: torch.randn(x.size(), dtype=x.dtype, layout=x.layout, device=x.device,
                                                 generator=generator)


class _BrownianTree:
    """A torchsde Brownian tree on the CPU, queried in either time direction."""

    def __init__(self, x: torch.Tensor, t0: torch.Tensor, t1: torch.Tensor, seed: int):
        import torchsde

        t0, t1, self.sign = (t0, t1, 1) if t0 < t1 else (t1, t0, -1)
        w0 = torch.zeros_like(x).detach().cpu()
        self.tree = torchsde.BrownianTree(t0.detach().cpu(), w0, t1.detach().cpu(), entropy=seed)

    def __call__(self, t0: torch.Tensor, t1: torch.Tensor) -> torch.Tensor:
        t0, t1, sign = (t0, t1, 1) if t0 < t1 else (t1, t0, -1)
        device, dtype = t0.device, t0.dtype
        w = self.tree(t0.detach().cpu().float(), t1.detach().cpu().float())
        return w.to(device=device, dtype=dtype) * (self.sign * sign)


def brownian_noise_sampler(x: torch.Tensor, sigmas: torch.Tensor, seed: int, sampling=None) -> NoiseSampler:
    sigma_min, sigma_max = sigmas[sigmas > 0].min(), sigmas.max()
    tree = _BrownianTree(x, torch.as_tensor(sigma_min), torch.as_tensor(sigma_max), seed)

    def sample(sigma, sigma_next):
        t0, t1 = torch.as_tensor(sigma), torch.as_tensor(sigma_next)
        return tree(t0, t1) / (t1 - t0).abs().sqrt()

    return sample

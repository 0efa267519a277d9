"""The samplers' per-step noise: for the same latent, sigmas and seed, the same tensors ComfyUI's KSampler feeds them.

- Gaussian (euler_ancestral, lcm, ...): one ``torch.Generator`` on the latent's device seeded with the KSampler
  seed; every call draws a fresh ``randn`` of the latent's shape, dtype and layout from it. The draws depend only on
  the number of calls, not on the sigmas.
- Brownian (the SDE samplers): a torchsde ``BrownianTree`` over ``[sigma_min, sigma_max]`` (the smallest positive
  and the largest sigma of the run, in the sigmas' dtype), built on the CPU from a zero start shaped like the latent,
  with the seed as its entropy. A call for ``(sigma, sigma_next)`` returns the tree's increment between the two
  sigmas (queried in float32 on the CPU, ordered low -> high, the sign restored) divided by the square root of their
  distance, i.e. a unit-variance sample that is consistent across step sizes. ComfyUI 0.3.64's KSampler samplers pass
  no sigma transform, on CONST (flow) models too, so the tree runs in sigma itself.
Why torchsde and this exact recipe: a Brownian tree's values depend on its splitting algorithm, its interval and the
order of the query's ends; only the same library, interval and query give the same noise for the same seed.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..settings import MAX_SEED  # ComfyUI's seed widget range is [0, 2^64 - 1]

NoiseSampler = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed={seed!r}: expected an int in [0, {MAX_SEED}] (the KSampler seed)")
    return seed


def _check_latent(x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = f"a {x.dtype} tensor" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x: expected the floating-point latent the sampler runs on, got {got}")
    return x


def gaussian_noise_sampler(x: torch.Tensor, seed: int) -> NoiseSampler:
    """Per-step Gaussian noise shaped like ``x``: a generator on ``x.device`` seeded with ``seed``, one draw a call."""
    _check_latent(x)
    generator = torch.Generator(device=x.device)
    generator.manual_seed(_check_seed(seed))
    shape, options = x.shape, dict(dtype=x.dtype, layout=x.layout, device=x.device)

    def draw(sigma=None, sigma_next=None) -> torch.Tensor:
        return torch.randn(shape, generator=generator, **options)

    return draw


def _ordered(low: torch.Tensor, high: torch.Tensor):
    """The two ends in increasing order and the sign that undoes the swap (a tie counts as swapped)."""
    return (low, high, 1) if bool(low < high) else (high, low, -1)


class _SigmaBrownianTree:
    """A torchsde Brownian tree over ``[t_low, t_high]`` on the CPU, queried with its ends in either order."""

    def __init__(self, x: torch.Tensor, t_low: torch.Tensor, t_high: torch.Tensor, seed: int):
        import torchsde

        start, end, self.orientation = _ordered(t_low.detach().cpu(), t_high.detach().cpu())
        origin = torch.zeros_like(x).detach().cpu()
        self.tree = torchsde.BrownianTree(start, origin, end, entropy=seed)

    def increment(self, t_from: torch.Tensor, t_to: torch.Tensor) -> torch.Tensor:
        """W(t_to) - W(t_from) on ``t_from``'s device, in its dtype."""
        device, dtype = t_from.device, t_from.dtype
        host = torch.stack([t_from.detach(), t_to.detach().to(t_from.device, t_from.dtype)]).cpu()  # one copy
        low, high, swap = _ordered(host[0], host[1])
        w = self.tree(low.float(), high.float())
        return w.to(device=device, dtype=dtype) * (self.orientation * swap)


def brownian_noise_sampler(x: torch.Tensor, sigmas: torch.Tensor, seed: int, sampling: Optional[object] = None
                           ) -> NoiseSampler:
    """Brownian-tree noise for the SDE samplers over the run's ``sigmas`` (1-D, at least one positive).

    ``sampling`` (the model sampling) is accepted for the samplers' common signature: ComfyUI 0.3.64's KSampler
    path applies no transform for any model sampling, so the tree's time is sigma itself.
    """
    _check_latent(x)
    if not isinstance(sigmas, torch.Tensor) or sigmas.ndim != 1 or not sigmas.is_floating_point():
        got = f"shape {tuple(sigmas.shape)} {sigmas.dtype}" if isinstance(sigmas, torch.Tensor) else \
            type(sigmas).__name__
        raise ValueError(f"sigmas: expected a 1-D floating-point tensor (the run's sigma schedule), got {got}")
    host = sigmas.detach().cpu()
    positive = host[host > 0]
    if positive.numel() == 0:
        raise ValueError(f"sigmas={host.tolist()}: a Brownian tree needs at least one positive sigma; pass the "
                         f"schedule of a run that has steps")
    tree = _SigmaBrownianTree(x, positive.min(), host.max(), _check_seed(seed))

    def draw(sigma, sigma_next) -> torch.Tensor:
        t_from, t_to = torch.as_tensor(sigma), torch.as_tensor(sigma_next)
        return tree.increment(t_from, t_to) / (t_to - t_from).abs().sqrt()

    return draw

"""The flow sampler's attention and lean blocks: masked SDPA against a plain softmax, the fused RMSNorm against
diffusers' RMSNorm, and a lean block against the block's own forward (with and without modulation and mask)."""
import math

import pytest
import torch

from leandiffusion.memory.tiny_zimage import build_tiny_zimage
from leandiffusion.sampling.flow.attention import masked_attention, rms_norm
from leandiffusion.sampling.flow.block import installed


def _plain(q, k, v, mask):
    scores = torch.einsum("blhd,bmhd->bhlm", q.double(), k.double()) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    return torch.einsum("bhlm,bmhd->blhd", scores.softmax(-1), v.double())


def test_masked_attention_equals_a_plain_masked_softmax():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 70, 2, 32, generator=g) for _ in range(3))
    mask = torch.zeros(3, 70, dtype=torch.bool)
    mask[0, :33] = True
    mask[1, :] = True
    mask[2, :1] = True
    assert (masked_attention(q, k, v, mask).double() - _plain(q, k, v, mask)).abs().max().item() < 1e-5


def test_rms_norm_equals_diffusers_rmsnorm():
    from diffusers.models.normalization import RMSNorm

    norm = RMSNorm(48, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(2, 5, 48) * 3
    assert (rms_norm(x, norm) - norm(x)).abs().max().item() < 1e-5


@pytest.mark.parametrize("group", ["noise_refiner", "context_refiner", "layers"])
def test_lean_block_equals_the_block_forward(group):
    dit = build_tiny_zimage(seed=4)["transformer"]
    block = getattr(dit, group)[0]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 40, dit.config.dim, generator=g)
    freqs = dit.rope_embedder(torch.randint(0, 50, (80, 3), generator=g, dtype=torch.int32)).reshape(2, 40, -1)
    adaln = torch.randn(2, 64, generator=g) if block.modulation else None
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1, 25:] = False
    ref = block(x, mask, freqs, adaln)
    with installed(dit):
        out = block(x, mask, freqs, adaln)
    assert (out - ref).abs().max().item() < 1e-5
    assert block.forward.__func__ is type(block).forward  # restored after the call

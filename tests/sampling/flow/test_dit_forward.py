"""The static-shape DiT forward equals diffusers' ZImageTransformer2DModel.forward for any caption length laid out
in any bucket (the invariant that lets one captured graph serve every prompt of a bucket), and the learned pad
tokens matter (a layout that dropped them would fail these tests)."""
import pytest
import torch

from leandiffusion.memory.tiny_zimage import build_tiny_zimage
from leandiffusion.sampling.flow.dit_forward import (CAPTION_BUCKETS, ImageGrid, caption_capacity, caption_layout,
                                                     dit_forward)


@pytest.fixture(scope="module")
def dit():
    return build_tiny_zimage(seed=2)["transformer"]


def _reference(dit, x, t, captions):
    out = dit(list(x.unsqueeze(2).unbind(0)), t, list(captions), return_dict=False)[0]
    return torch.stack(out).squeeze(2)


@pytest.mark.parametrize("lengths,size", [((5, 40, 33), (6, 10)), ((1,), (8, 8)), ((32, 64), (4, 14)),
                                          ((130,), (6, 6))])
def test_equals_diffusers_in_every_bucket(dit, lengths, size):
    g = torch.Generator().manual_seed(len(lengths))
    x = torch.randn(len(lengths), 16, *size, generator=g)
    t = torch.rand(len(lengths), generator=g)
    captions = [torch.randn(n, dit.config.cap_feat_dim, generator=g) for n in lengths]
    ref = _reference(dit, x, t, captions)
    grid = ImageGrid.of(*size, 2)
    for capacity in [c for c in CAPTION_BUCKETS if c >= caption_capacity(lengths)]:
        layout = caption_layout(dit, captions, grid, capacity, torch.float32, torch.device("cpu"))
        out = dit_forward(dit, x, t, layout, grid)
        assert (out - ref).abs().max().item() <= 1e-5, capacity


def test_the_learned_pad_tokens_change_the_output(dit):
    """Zeroing the caption or image pad token moves the result: the pads are seen by attention."""
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(1, 16, 6, 10, generator=g), torch.rand(1, generator=g)
    captions = [torch.randn(5, dit.config.cap_feat_dim, generator=g)]
    grid = ImageGrid.of(6, 10, 2)
    layout = caption_layout(dit, captions, grid, 128, torch.float32, torch.device("cpu"))
    base = dit_forward(dit, x, t, layout, grid)
    for name in ("cap_pad_token", "x_pad_token"):
        token = getattr(dit, name)
        saved = token.detach().clone()
        with torch.no_grad():
            token.zero_()
        try:
            assert (dit_forward(dit, x, t, layout, grid) - base).abs().max().item() > 1e-3, name
        finally:
            with torch.no_grad():
                token.copy_(saved)


def test_caption_capacity_buckets_and_refusals():
    assert caption_capacity([1, 90]) == 128
    assert caption_capacity([97]) == 128 and caption_capacity([129]) == 256 and caption_capacity([512]) == 512
    with pytest.raises(ValueError, match="exceeds the longest supported"):
        caption_capacity([513])
    with pytest.raises(ValueError, match="multiple of the patch size"):
        ImageGrid.of(7, 8, 2)

"""Row-grouped attention (sampling/qwen/attention.py): a padded batch of prompts of different lengths gives every
row what the diffusers transformer gives that row alone, unpadded, and the processors are restored afterwards."""
import pytest
import torch
from diffusers import QwenImageTransformer2DModel

from leandiffusion.memory.tiny_qwen_image import TEXT_HIDDEN, transformer_config
from leandiffusion.sampling.qwen.attention import RowGroup, row_groups, row_groups_installed

GRID = (1, 4, 6)  # one frame of 4 x 6 patches


@pytest.fixture(scope="module")
def dit():
    torch.manual_seed(3)
    return QwenImageTransformer2DModel(**transformer_config()).eval()


def _call(dit, x, text, mask=None, shapes=None):
    shapes = shapes or [[GRID]] * x.shape[0]
    t = torch.full((x.shape[0],), 0.7)
    with torch.no_grad():
        return dit(hidden_states=x, timestep=t, encoder_hidden_states=text, encoder_hidden_states_mask=mask,
                   img_shapes=shapes, return_dict=False)[0]


def _padded(texts, length):
    return torch.stack([torch.cat([t, t.new_zeros(length - t.shape[0], t.shape[1])]) for t in texts])


@pytest.mark.parametrize("lengths,capacity", [((7, 7, 4, 4), 9), ((3, 8), 8), ((5,), 5)])
def test_rows_equal_their_unpadded_calls(dit, lengths, capacity):
    g = torch.Generator().manual_seed(0)
    texts = [torch.randn(n, TEXT_HIDDEN, generator=g) for n in lengths]
    x = torch.randn(len(lengths), GRID[1] * GRID[2], 64, generator=g)
    alone = torch.cat([_call(dit, x[i:i + 1], texts[i][None]) for i in range(len(lengths))])
    with row_groups_installed(dit, row_groups(lengths)):
        grouped = _call(dit, x, _padded(texts, capacity))
    assert (grouped - alone).abs().max().item() < 1e-5
    # the reference is not trivially equal: padding without the groups moves the rows
    if capacity > min(lengths):
        assert (_call(dit, x, _padded(texts, capacity)) - alone).abs().max().item() > 1e-3


def test_reference_image_tokens_and_processors_restored(dit):
    g = torch.Generator().manual_seed(1)
    texts = [torch.randn(n, TEXT_HIDDEN, generator=g) for n in (6, 2)]
    shapes = [[GRID, (1, 2, 4)]] * 2  # noise tokens, then one reference image's tokens
    x = torch.randn(2, GRID[1] * GRID[2] + 8, 64, generator=g)
    before = [b.attn.processor for b in dit.transformer_blocks]
    alone = torch.cat([_call(dit, x[i:i + 1], texts[i][None], shapes=shapes[:1]) for i in range(2)])
    with row_groups_installed(dit, row_groups([6, 2])):
        grouped = _call(dit, x, _padded(texts, 6), shapes=shapes)
    assert (grouped - alone).abs().max().item() < 1e-5
    assert [b.attn.processor for b in dit.transformer_blocks] == before


def test_groups_must_cover_the_rows(dit):
    x = torch.randn(2, GRID[1] * GRID[2], 64)
    with row_groups_installed(dit, (RowGroup(0, 1, 3),)), pytest.raises(ValueError, match="do not cover"):
        _call(dit, x, torch.randn(2, 3, TEXT_HIDDEN))


def test_row_groups_runs():
    assert row_groups([5, 5, 3, 3, 5]) == (RowGroup(0, 2, 5), RowGroup(2, 4, 3), RowGroup(4, 5, 5))
    with pytest.raises(ValueError, match="lengths"):
        row_groups([])
    with pytest.raises(ValueError, match=r"lengths\[1\]=0"):
        row_groups([2, 0])


def test_rotary_under_compile_equals_the_complex_product():
    """The real-arithmetic rotary form ``torch.compile`` traces equals the eager complex product and diffusers'
    ``apply_rotary_emb_qwen`` (float32 rounding only; a wrong sign or pair order is O(1) away)."""
    from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

    from leandiffusion.sampling.qwen.attention import _rotary

    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 7, 3, 8, generator=g)
    freqs = torch.polar(torch.ones(7, 4), torch.randn(7, 4, generator=g) * 3)
    reference = apply_rotary_emb_qwen(x, freqs, use_real=False)
    eager = _rotary(x, freqs)
    traced = torch.compile(_rotary, backend="eager", fullgraph=True)(x, freqs)
    assert (eager - reference).abs().max().item() < 1e-6
    assert (traced - reference).abs().max().item() < 1e-6
    assert (x - reference).abs().max().item() > 0.5  # the angles rotate

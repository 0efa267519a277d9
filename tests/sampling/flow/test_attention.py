"""Masked attention of the Z-Image blocks: the segment boundaries the varlen flash path uses, the CPU/SDPA path
against a plain softmax, and (GPU) the varlen flash path against SDPA with the mask on every row a caller reads."""
import math

import pytest
import torch

from leandiffusion.sampling.flow.attention import _segments, masked_attention, prepare_attention


def _plain(q, k, v, mask):
    scores = torch.einsum("blhd,bmhd->bhlm", q.double(), k.double()) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    return torch.einsum("bhlm,bmhd->blhd", scores.softmax(-1), v.double())


def _case(device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 70, 2, 32, generator=g).to(device, dtype) for _ in range(3))
    mask = torch.zeros(3, 70, dtype=torch.bool, device=device)
    mask[0, :33] = True
    mask[1, :] = True
    mask[2, :1] = True
    return q, k, v, mask


def test_segments_split_each_row_into_visible_head_and_tail():
    mask = torch.zeros(3, 10, dtype=torch.bool)
    mask[0, :4] = True
    mask[1, :] = True
    mask[2, :7] = True
    assert _segments(mask).tolist() == [0, 4, 10, 20, 20, 27, 30]


def test_cpu_path_equals_plain_masked_softmax_on_visible_rows():
    q, k, v, mask = _case()
    out = masked_attention(q, k, v, mask)
    ref = _plain(q, k, v, mask)
    assert (out.double() - ref).abs().max().item() < 1e-5
    assert not prepare_attention(torch.device("cpu"), torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_varlen_flash_equals_sdpa_on_rows_read():
    q, k, v, mask = _case("cuda", torch.bfloat16)
    assert prepare_attention(torch.device("cuda", torch.cuda.current_device()), torch.bfloat16)
    out = masked_attention(q, k, v, mask).double()
    ref = _plain(q, k, v, mask)
    for row in range(3):  # the visible head segment holds the rows callers read
        visible = int(mask[row].sum())
        assert (out[row, :visible] - ref[row, :visible]).abs().max().item() < 2e-2

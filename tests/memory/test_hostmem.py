"""``memory.hostmem``: the flat aligned layout every moved weight set uses, worked by hand.

Guards the module's first invariant (an unaligned layout would pass tests that only read the weights back): every
tensor starts at a multiple of ``ALIGN`` bytes, the slots do not overlap, the size is the last slot rounded up (at
least one ``ALIGN``), a dtype override applies to floating tensors only, and each view reads back the values
written into it.
"""
import torch

from leandiffusion.memory.hostmem import ALIGN, FlatLayout, PinnedBuffer, align


def test_align_by_hand():
    assert ALIGN == 512
    assert [align(n) for n in (0, 1, 511, 512, 513, 1024)] == [0, 512, 512, 512, 1024, 1024]


def test_layout_offsets_sizes_and_dtypes_by_hand():
    tensors = [torch.zeros(3, 5), torch.zeros(129, dtype=torch.float16), torch.zeros(2, dtype=torch.int64),
               torch.zeros(256)]
    plain = FlatLayout.of(tensors)
    # bytes 60, 258, 16, 1024 -> slots of 512, 512, 512, 1024
    assert plain.offsets == (0, 512, 1024, 1536) and plain.nbytes == 2560
    assert plain.dtypes == (torch.float32, torch.float16, torch.int64, torch.float32)
    half = FlatLayout.of(tensors, torch.float16)  # bytes 30, 258, 16 (int64 kept), 512
    assert half.offsets == (0, 512, 1024, 1536) and half.nbytes == 2048
    assert half.dtypes == (torch.float16, torch.float16, torch.int64, torch.float16)
    assert FlatLayout.of([]).nbytes == ALIGN and FlatLayout.of([torch.zeros(0)]).nbytes == ALIGN


def test_views_are_aligned_disjoint_and_read_back():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(7, 3, generator=g), torch.randn(1, generator=g), torch.arange(5),
               torch.randn(33, 2, generator=g)]
    layout = FlatLayout.of(tensors)
    buffer = PinnedBuffer(layout.nbytes, pin=False).tensor
    views = layout.views(buffer)
    for view, t in zip(views, tensors):
        view.copy_(t)
    starts = [v.data_ptr() - buffer.data_ptr() for v in views]
    ends = [s + v.numel() * v.element_size() for s, v in zip(starts, views)]
    assert all(s % ALIGN == 0 for s in starts)
    assert all(e <= s for e, s in zip(ends, starts[1:])) and ends[-1] <= layout.nbytes
    assert all(torch.equal(v, t) for v, t in zip(layout.views(buffer), tensors))

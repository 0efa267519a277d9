"""``memory/held_units.py``: held units' parameters are views of the held buffer (laid out as in their ring slices),
each is filled once, and releasing points them back at the ring or leaves them where the caller put them."""
import torch

from leandiffusion.memory.held_units import HeldUnits
from leandiffusion.memory.hostmem import ALIGN, FlatLayout


def _units(sizes):
    params = [[torch.nn.Parameter(torch.full((n,), float(k)))] for k, n in enumerate(sizes)]
    return params, [FlatLayout.of(p) for p in params]


def test_units_are_chosen_in_schedule_order_while_they_fit():
    _, layouts = _units([ALIGN // 4, 3 * ALIGN // 4, ALIGN // 4])  # fp32: one, three and one ALIGN blocks
    chosen, total = HeldUnits.choose(layouts, 2 * ALIGN)
    assert chosen == {0: 0, 2: ALIGN} and total == 2 * ALIGN  # the middle unit does not fit, the last one does
    assert HeldUnits.choose(layouts, ALIGN - 1) == ({}, 0)


def test_held_parameters_live_in_the_buffer_are_filled_once_and_go_back_to_the_ring():
    params, layouts = _units([ALIGN // 4, ALIGN // 4])
    ring_offsets = (0, ALIGN)
    arena = torch.zeros(2 * ALIGN, dtype=torch.uint8)
    chosen, total = HeldUnits.choose(layouts, 2 * ALIGN)
    held = HeldUnits(torch.zeros(total, dtype=torch.uint8), chosen, params, layouts)
    assert 1 in held and held.buffer.numel() == total
    slot = held.take_fill(1)
    assert slot is not None and held.take_fill(1) is None  # a second forward copies nothing
    slot.view(torch.float32).fill_(7.0)
    assert torch.equal(params[1][0].data, torch.full((ALIGN // 4,), 7.0))  # the parameter reads the held slice
    held.release(arena, ring_offsets)
    assert params[1][0].data.data_ptr() == arena[ALIGN:].data_ptr()
    again = HeldUnits(torch.zeros(total, dtype=torch.uint8), chosen, params, layouts)
    buffer_ptr = again.buffer.data_ptr()
    again.release(None, ring_offsets)
    assert params[0][0].data.data_ptr() == buffer_ptr  # no ring: the caller repoints them (offload: the host)

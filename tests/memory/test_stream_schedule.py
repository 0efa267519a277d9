"""The stream schedule's pure parts: ring layout dependencies, spreading, the step-time model.

Guards the schedule invariants the CUDA path relies on (a copy never overwrites a slice a block still needs;
every block has at least one block of prefetch lead with the minimum arena; copies are issued in order).
"""
import pytest

from leandiffusion.memory.streaming import Unit, choose_streamed, plan_schedule, ring_layout, simulate


def _units(sizes, flops=None):
    flops = flops or [1e9] * len(sizes)
    return [Unit(f"u{i}", s, f) for i, (s, f) in enumerate(zip(sizes, flops))]


@pytest.mark.parametrize("sizes", [[512] * 10, [512, 1024, 2048, 512, 4096, 1024, 512, 512, 3072, 2048]])  # aligned, like FlatLayout sizes
def test_ring_dependencies_are_safe_and_leave_lead(sizes):
    units = _units(sizes)
    streamed = list(range(len(units)))
    arena = 3 * max(sizes)
    offsets, wait_for = ring_layout(units, streamed, arena)
    for k, i in enumerate(streamed):
        lo, hi = offsets[k], offsets[k] + sizes[i]
        assert hi <= arena
        assert wait_for[k] < i - 1 or wait_for[k] == -1  # at least one block of lead
        for j in range(k):  # every earlier overlapping block is finished before this copy starts
            if offsets[j] < hi and lo < offsets[j] + sizes[streamed[j]]:
                assert streamed[j] <= wait_for[k]
    assert wait_for == sorted(wait_for)  # copies are issued in order


def test_equal_blocks_are_spread_not_clustered():
    units = _units([100] * 16)
    picked = choose_streamed(units, 400)
    assert len(picked) == 4 and max(b - a for a, b in zip(picked, picked[1:])) <= 6


def test_compute_heavy_blocks_stream_first():
    units = _units([100, 100, 100, 100], flops=[1e6, 9e9, 1e6, 8e9])
    assert choose_streamed(units, 200) == [1, 3]


def test_simulation_hides_copies_behind_compute():
    units = _units([1000] * 8, flops=[1e9] * 8)
    offsets, wait_for = ring_layout(units, list(range(8)), 4000)
    fast = simulate(units, list(range(8)), wait_for, bw=1e12, rate=1e12)  # copy 1 ns/B, compute 1 ms
    slow = simulate(units, list(range(8)), wait_for, bw=1e5, rate=1e12)  # copy-bound
    assert fast == pytest.approx(8e-3, rel=0.01)
    assert slow > 8 * 1000 / 1e5


def test_plan_fits_capacity():
    units = _units([1000] * 20)
    sched = plan_schedule(units, 9000)
    assert sched.resident_unit_bytes + sched.arena_bytes <= 9000
    assert sched.streamed_bytes + sched.resident_unit_bytes == 20000
    assert plan_schedule(units, 30000).streamed == ()
    with pytest.raises(ValueError, match="arena"):
        plan_schedule(units, 2000)

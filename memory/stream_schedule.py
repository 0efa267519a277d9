"""Which units (UNet or DiT blocks, text encoder layers) stream under the ``stream`` policy, where each lands in the
staging ring, and what a step costs.

Resident set
    ``capacity = budget - headroom - activations_estimate - always_resident - arena`` (``vram_budget.HEADROOM``;
    resident weights sit in one exact-size flat buffer). Units stay resident until the capacity is used; the rest
    (``S`` bytes) stream. Which units stream: those with the most compute per weight byte (``flops_i / bytes_i``;
    the high-resolution blocks), so their copies hide behind their own compute; among equal ratios (SDXL's 60
    identical 32x32 transformer blocks) a bit-reversed pick spreads the streamed ones evenly through the forward
    instead of clustering them. A stage whose weights visit the device only while it runs (a streamed text
    encoder) has no resident set: every unit streams (``plan_all_streamed``).

Staging arena (the math)
    Streamed units live in one device ``arena`` of ``A`` bytes used as a ring: unit ``k`` (in execution order)
    gets the next ``[off_k, off_k + s_k)`` slice, wrapping to 0 when it does not fit. Its parameters are *fixed
    views* of that slice for the whole life of the placement (no allocation per step, fixed addresses: a captured
    CUDA graph stays valid). ``p(k)`` = the last earlier streamed unit whose slice overlaps ``k``'s: the copy of
    ``k`` may start once ``p(k)`` has finished computing. With ``A >= 3 * max(s_k)`` every copy has at least one
    unit of lead (block k+1 is fetched while block k computes); bigger arenas give more lead.

Packed slot
    Where streamed weights travel packed (``packed_weights.py``: bf16 on CUDA), the arena also holds ``slots``
    packed staging slots (``slot_bytes`` in all) after the ring: a unit's packed bytes land in one and are decoded
    into its ring slice, for a stage whose step waits on its copies (``copy_bound``); a compute-bound stage keeps
    plain copies (the decode would only take GPU time from it). ``arena_bytes`` counts the slots, so every budget
    sum stays right; a capacity too small for the ring and the slots gets the plain schedule instead of a refusal.

Next-forward prefetch (eager forwards that follow one another)
    A forward copies its ``head`` units (``wait_for == -1``) at its start, after the previous forward's compute:
    the copy engine idles through the previous forward's last blocks and the step between. ``prefetch_points``
    says where the previous forward can copy them instead: after the last unit that reads the head's slice in a
    forward, and not before the forward's own last copy is issued (its own copies go first).

Time model
    A step costs ~``max(sum_i c_i, S / B)`` when copies hide, where ``c_i`` is unit compute and ``B`` the pinned
    host-to-device bandwidth (``ASSUMED_H2D_BYTES_PER_S``); packed units cross as ``ESTIMATED_RATIO`` of their
    bytes. :func:`simulate` evaluates exactly this model (one copy engine, one compute stream) to choose the arena
    size and to print the plan's step estimate.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .hostmem import ALIGN, align
from .packed_weights import ESTIMATED_RATIO, slot_bytes_for, slot_count
from .unet_units import Unit

ASSUMED_H2D_BYTES_PER_S = 50e9
ASSUMED_FLOPS_PER_S = 200e12
COPY_OVERHEAD_S = 5e-6
ARENA_MULTIPLES = (3, 4, 6, 8, 12)
# compute per streamed weight byte below which packed copies shorten a step: copies and compute balance at the
# achieved rate over the host link (H200: ~450-560 TFLOP/s of bf16 blocks over ~52 GB/s pinned, ~9-11k), and near
# the balance the decode (~7% of the plain copy time in GPU work) eats what packing saves. Measured under ``stream``
# at the samplers' default rows: Z-Image at 6 GB ~5k (packed 1.18-1.21x resident, plain 1.61x), Qwen-Image
# text-to-image at 12 GB ~7k (packed 1.37x, plain 1.90x), Qwen-Image-Edit at 12 GB ~10k (plain 1.06x, packed 1.09x)
PACK_BELOW_FLOPS_PER_BYTE = 8_000


@dataclass(frozen=True)
class StreamSchedule:
    order: tuple  # all units, execution order
    streamed: tuple  # indices into ``order`` of streamed units, ascending
    offsets: tuple  # arena offset per streamed unit
    wait_for: tuple  # per streamed unit: index into ``order`` of the unit that must finish first, or -1
    arena_bytes: int
    est_step_s: float
    est_compute_s: float
    slot_bytes: int = 0  # the packed staging slots at the arena's end (0: plain copies)
    slots: int = 0  # how many (``slot_bytes`` is split evenly among them)

    @property
    def ring_bytes(self) -> int:
        return self.arena_bytes - self.slot_bytes

    @property
    def streamed_bytes(self) -> int:
        return sum(self.order[i].nbytes for i in self.streamed)

    @property
    def resident_unit_bytes(self) -> int:
        return sum(u.nbytes for u in self.order) - self.streamed_bytes


def _bitrev_rank(n: int) -> list[int]:
    """A permutation of range(n) whose prefixes are spread evenly (van der Corput order)."""
    bits = max(1, (n - 1).bit_length())
    return sorted(range(n), key=lambda i: int(format(i, f"0{bits}b")[::-1], 2))


def choose_streamed(units: list[Unit], need_bytes: int) -> list[int]:
    """Indices of the units to stream: highest FLOPs per byte first, equal ratios spread evenly."""
    if need_bytes <= 0:
        return []
    buckets: dict[int, list[int]] = {}
    for i, u in enumerate(units):
        if u.nbytes:
            key = int(round(10 * math.log10(u.flops / u.nbytes + 1e-12)))
            buckets.setdefault(key, []).append(i)
    picked, total = [], 0
    for key in sorted(buckets, reverse=True):
        members = buckets[key]
        for r in _bitrev_rank(len(members)):
            if total >= need_bytes:
                break
            picked.append(members[r])
            total += units[members[r]].nbytes
    return sorted(picked)


def ring_layout(units: list[Unit], streamed: list[int], arena: int) -> tuple[list[int], list[int]]:
    """Ring offsets and the ``p(k)`` dependency (index into ``units``) for the streamed units."""
    offsets, wait_for, placed = [], [], []
    pos = 0
    for i in streamed:
        size = units[i].nbytes
        if size > arena:
            raise ValueError(f"unit {units[i].name} ({size} B) is larger than the staging arena ({arena} B)")
        if pos + size > arena:
            pos = 0
        lo, hi = pos, pos + size
        dep = -1
        for j, (plo, phi) in placed:
            if plo < hi and lo < phi:
                dep = max(dep, j)
        offsets.append(lo)
        wait_for.append(dep)
        placed.append((i, (lo, hi)))
        placed = [(j, r) for j, r in placed if not (lo <= r[0] and r[1] <= hi and j != i)]
        pos = align(hi, ALIGN)
    return offsets, wait_for


def simulate(units: list[Unit], streamed: list[int], wait_for: list[int], bw: float = ASSUMED_H2D_BYTES_PER_S,
             rate: float = ASSUMED_FLOPS_PER_S, copy_ratio: float = 1.0) -> float:
    """Step time (s) of the schedule under the module docstring's model (one copy engine, one compute stream);
    each copy moves ``copy_ratio`` of its unit's bytes."""
    kpos = {i: k for k, i in enumerate(streamed)}
    compute_end: dict[int, float] = {}
    ready: dict[int, float] = {}
    copy_free, kk, t = 0.0, 0, 0.0
    for i, u in enumerate(units):
        while kk < len(streamed) and wait_for[kk] < i:
            start = max(copy_free, compute_end.get(wait_for[kk], 0.0))
            copy_free = start + copy_ratio * units[streamed[kk]].nbytes / bw + COPY_OVERHEAD_S
            ready[kk] = copy_free
            kk += 1
        start = max(t, ready[kpos[i]]) if i in kpos else t
        t = start + u.flops / rate
        compute_end[i] = t
    return t


def prefetch_points(schedule: StreamSchedule) -> dict[int, list[int]]:
    """Per index ``j`` of ``schedule.order``: the head units (positions in ``schedule.streamed``) the next forward
    needs that a forward may copy once unit ``j`` has finished (module docstring, next-forward prefetch)."""
    if not schedule.streamed:
        return {}
    sizes = [schedule.order[i].nbytes for i in schedule.streamed]
    last_issue = max(schedule.wait_for)
    points: dict[int, list[int]] = {}
    for k, dep in enumerate(schedule.wait_for):
        if dep != -1:
            continue
        lo, hi = schedule.offsets[k], schedule.offsets[k] + sizes[k]
        last_user = max(i for u, i in enumerate(schedule.streamed)
                        if schedule.offsets[u] < hi and lo < schedule.offsets[u] + sizes[u])
        points.setdefault(max(last_user, last_issue), []).append(k)
    return points


def copy_bound(units: list[Unit], rows_scale: float = 1.0) -> bool:
    """Whether streaming ``units`` waits on the copies enough for packing to pay (``PACK_BELOW_FLOPS_PER_BYTE``);
    ``rows_scale``: the rows a run computes per row of the units' working shape (FLOPs scale with the rows)."""
    nbytes = sum(u.nbytes for u in units)
    return nbytes > 0 and rows_scale * sum(u.flops for u in units) / nbytes < PACK_BELOW_FLOPS_PER_BYTE


def plan_schedule(units: list[Unit], capacity_bytes: int, slot_fraction: float = 0.0) -> StreamSchedule:
    """Best schedule whose resident units + arena fit ``capacity_bytes`` (raises ``ValueError`` if none fits);
    ``slot_fraction`` > 0 reserves a packed staging slot of that size per byte of the largest unit."""
    total = sum(u.nbytes for u in units)
    compute = sum(u.flops for u in units) / ASSUMED_FLOPS_PER_S
    if total <= capacity_bytes:
        return StreamSchedule(tuple(units), (), (), (), 0, compute, compute)
    return _best_arena(units, capacity_bytes, lambda arena: choose_streamed(units, total - (capacity_bytes - arena)),
                       slot_fraction=slot_fraction)


def plan_all_streamed(units: list[Unit], room_bytes: int, slot_fraction: float = 0.0) -> StreamSchedule:
    """Every unit with weights streams (a stage whose weights visit the device only while it runs); the arena is
    the multiple of the largest unit within ``room_bytes`` with the best simulated time, never above what the
    units hold in all (raises ``ValueError`` if not even the minimum fits); ``slot_fraction`` as ``plan_schedule``."""
    streamed = [i for i, u in enumerate(units) if u.nbytes]
    total = sum(u.nbytes for u in units)
    return _best_arena(units, room_bytes, lambda arena: streamed, total, slot_fraction)


def _best_arena(units: list[Unit], capacity_bytes: int, pick, most: Optional[int] = None,
                slot_fraction: float = 0.0) -> StreamSchedule:
    """The schedule of the ``ARENA_MULTIPLES`` ring (within ``capacity_bytes`` with the packed slot, and, if given,
    ``most`` bytes) whose simulated step is fastest; ``pick(arena)`` gives the streamed units' indices for an arena
    of that many bytes (ring and slot). Without room for the slot, the plain schedule."""
    compute = sum(u.flops for u in units) / ASSUMED_FLOPS_PER_S
    biggest = max(u.nbytes for u in units)
    slot = slot_bytes_for(biggest, slot_fraction)
    slots = slot_count() if slot else 0
    ratio = ESTIMATED_RATIO if slot else 1.0
    best: Optional[StreamSchedule] = None
    for m in ARENA_MULTIPLES:
        ring = int(m * biggest)
        if ring + slot > capacity_bytes or (best is not None and most is not None and ring > most):
            break
        streamed = pick(ring + slot)
        offsets, wait_for = ring_layout(units, streamed, ring)
        est = simulate(units, streamed, wait_for, copy_ratio=ratio)
        cand = StreamSchedule(tuple(units), tuple(streamed), tuple(offsets), tuple(wait_for), ring + slot, est,
                              compute, slot, slots)
        if best is None or est < best.est_step_s * 0.98:
            best = cand
    if best is None and slot:
        return _best_arena(units, capacity_bytes, pick, most)
    if best is None:
        raise ValueError(f"capacity {capacity_bytes} B cannot hold the minimum staging arena "
                         f"({ARENA_MULTIPLES[0]} x {biggest} B)")
    return best


def minimum_arena_bytes(units: list[Unit]) -> int:
    return int(ARENA_MULTIPLES[0] * max(u.nbytes for u in units))


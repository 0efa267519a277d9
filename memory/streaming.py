"""Block-wise weight streaming at run time: a :class:`StreamSchedule` applied to a model (a UNet, a DiT, a text
encoder) by forward hooks.

Invariants
- Resident weights live in one flat device buffer; streamed units' parameters are fixed views of their slices of
  the staging ring (``memory/stream_schedule.py``), filled from one pinned host buffer laid out like the ring.
- Submodules named in ``host_modules`` keep their weights on the host (the caller hooks them to run there); a
  streamer whose ``arena_at_build`` is False holds its ring only between ``onload`` and ``offload`` (a stage's
  working memory), its streamed parameters pointing at their host copies otherwise.
- Per forward, on the current stream ``C`` and one side stream ``S``:
    begin:        record E0 on C; S waits E0 (fork: the previous forward is done with the arena);
                  S copies every unit with no ``p(k)`` (host pinned -> arena), records ``ready[k]``
    before k:     C waits ``ready[k]``
    after unit j: record ``done[j]`` on C; for every ``k`` with ``p(k) = j``: S waits ``done[j]``, copies
                  ``k``, records ``ready[k]``
    end:          record E1 on S; C waits E1 (join: nothing is left outstanding on S)
  Every copy is one ``cudaMemcpyAsync`` of ``s_k`` contiguous bytes. There are no host syncs, no allocations and
  no ``.item()``, so the whole forward, copies included, can be captured into a CUDA graph (fork/join through
  events is how CUDA graphs express multi-stream work). On the CPU the same schedule runs with synchronous copies
  and no events.
- Packed units: when the schedule reserves packed staging slots (``StreamSchedule.slot_bytes``, ``slots`` of
  them), each streamed unit is also packed at build (``packed_weights.py``, lossless) into its own pinned host
  buffer. Its copy is then: on ``S``, wait until the previous unit using the same slot (packed units alternate
  slots) has decoded, copy the packed bytes into the slot, record ``copied[k]``; on a second side stream ``D``,
  wait ``copied[k]`` and ``done[p(k)]`` (its ring slice is free), decode into the slice, record ``ready[k]``. So
  the copy engine fills one slot while the other decodes, and runs ahead of the compute by the slots as well as
  the ring (a packed unit's bytes cross before its ring slice is free); ``D`` forks and joins with ``C`` like
  ``S``. Units that do not pack smaller, or a host without the memory for the packed copies, keep plain copies.
  The plain pinned host copy stays either way: it is what ``host_copy`` returns and what ``remove`` restores.
- Held units (``hold``, ``held_units.py``): for one run, some streamed units' parameters point into a device
  buffer in room the run does not need (``memory/spare_room.py``) instead of their ring slices; the run's first
  forward copies them there as it would into the ring, later forwards copy nothing for them. ``release_held``
  points them back at the ring; a forward joins its copy streams before it returns, so nothing reads a dropped
  buffer.
- Next-forward prefetch (``prefetch_next``, eager forwards only): while on, a forward also copies the next
  forward's head units (those issued at ``begin``) into their slices at ``stream_schedule.prefetch_points`` (after
  the last block that reads the slice), so the copy engine works through the boundary between forwards; the next
  forward skips those copies. A captured forward neither prefetches nor relies on a prefetch; the prefetched set
  is forgotten by ``drop_prefetched``, ``offload`` and a failed forward (the next forward then copies them again).
"""
from __future__ import annotations

import logging
import time
import traceback
from typing import Optional

import torch

from .host_memory import HOST_SHARE, available_host_bytes
from .held_units import HeldUnits
from .hostmem import ALIGN, FlatLayout, PinnedBuffer
from .packed_weights import PackedUnit, pack_words, packed_host_estimate
from .stream_copies import CudaCopier, SyncCopier
from .stream_schedule import StreamSchedule, prefetch_points
from .unet_units import unit_params

logger = logging.getLogger(__name__)

HOST_COPY_ATTR = "_leandiffusion_host_copy"


def host_copy(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The pinned host tensor that holds a streamed parameter's values, else None. A streamed parameter's device
    tensor is a slot of the staging ring: its contents are that parameter's only inside its unit's forward, so code
    that reads weights outside a forward (the DoRA gain, ``lora/dora_forward.py``) reads this copy instead."""
    return getattr(param, HOST_COPY_ATTR, None)


class BlockStreamer:
    """Applies a :class:`StreamSchedule` to a UNet: resident weights on ``device``, streamed ones in the arena.

    Hooks are named (``self.handles``: name -> handle) and removed by :meth:`remove`, which also puts every weight
    back on the host. Not re-entrant: one forward at a time per UNet (forwards on several streams serialise).
    A forward that raises midway (out of memory inside a block, an interrupt) still ends its schedule: the end hook
    is registered with ``always_call``, joins the copy stream as a finished forward would, and leaves the streamer
    ready for the next forward (the Stream Scheduler retries a failed batch on the same engine).
    A ``BaseException`` that is not an ``Exception`` (``KeyboardInterrupt``) skips ``always_call`` hooks; the
    placement then closes the forward when the UNet session exits (``end_unfinished``).
    """

    arena_at_build = True  # False: the staging ring exists only between ``onload`` and ``offload``

    def __init__(self, unet: torch.nn.Module, schedule: StreamSchedule, device: torch.device, dtype: torch.dtype,
                 host_modules: tuple = ()):
        self.unet = unet
        self.host_modules = tuple(host_modules)  # submodules kept and run on the host (their hooks: the caller's)
        self.schedule = schedule
        self.device = torch.device(device)
        self.dtype = dtype
        self.handles: dict[str, torch.utils.hooks.RemovableHandle] = {}
        self._host_param_views: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        self._src, self._dst = [], []
        self._streamed, self._layouts = [], []
        self._packed: list[Optional[PackedUnit]] = []  # per streamed unit, its packed copy (None: plain copies)
        self._slots: list[torch.Tensor] = []  # the packed staging slots (views of the arena's end)
        self._slot_users: list[Optional[int]] = [None] * schedule.slots  # per slot, its last unit in this forward
        self._packed_issued = 0
        self._held: Optional[HeldUnits] = None  # ``hold``: the units computed from a device buffer this run
        self.host = self.arena = self.resident = None
        self.copies_issued = 0
        self._prefetch, self._prefetched = False, set()  # ``prefetch_next``; heads already copied for the next forward
        self._cursor = 0
        self._active = False
        self._depth = 0  # UNet forwards entered and not yet ended (> 1 only while a nested call is refused)
        try:
            self._build()
        except BaseException as exc:
            self.remove()  # a failed build leaves the UNet whole, on the host, without hooks
            # the traceback keeps _build's locals (views of the arena) alive: drop them so no GPU memory stays held
            traceback.clear_frames(exc.__traceback__)
            raise

    def _build(self) -> None:
        unet, schedule, dtype = self.unet, self.schedule, self.dtype
        modules = dict(unet.named_modules())
        order = schedule.order
        streamed_mods = [modules[order[i].name] for i in schedule.streamed]
        streamed_params = {id(p) for m in streamed_mods for p in unit_params(m)}
        host_mods = [modules[name] for name in self.host_modules]
        for m in host_mods:
            m.to(dtype=dtype)  # run on the host in the run dtype (the same values the device would compute with)
        host_params = {id(p) for m in host_mods for p in m.parameters()}
        # Host side: one pinned buffer, unit k's params laid out exactly as in its arena slice.
        self._streamed = [unit_params(m) for m in streamed_mods]
        self._layouts = [FlatLayout.of(params, dtype) for params in self._streamed]
        host_offsets, pos = [], 0
        for lay in self._layouts:
            host_offsets.append(pos)
            pos += lay.nbytes
        self.host = PinnedBuffer(max(pos, ALIGN), pin=self.device.type == "cuda")
        with torch.no_grad():
            for params, lay, hoff in zip(self._streamed, self._layouts, host_offsets):
                for p, hv in zip(params, lay.views(self.host.tensor, hoff)):
                    hv.copy_(p.data)
                    p.data = hv
                    setattr(p, HOST_COPY_ATTR, hv)
                    self._host_param_views.append((p, hv))
            self._place_resident([p for p in unet.parameters() if id(p) not in streamed_params | host_params],
                                 {id(m) for hm in host_mods for m in hm.modules()})
        self._src = [self.host.tensor[h: h + lay.nbytes] for h, lay in zip(host_offsets, self._layouts)]
        if schedule.slot_bytes:
            self._packed = self._pack_units(schedule.slot_bytes)
        if self.arena_at_build:
            self.onload()
        self._issue_after: dict[int, list[int]] = {}
        for k, j in enumerate(schedule.wait_for):
            self._issue_after.setdefault(j, []).append(k)
        self._prefetch_after = prefetch_points(schedule)
        self._kpos = {i: k for k, i in enumerate(schedule.streamed)}
        n = len(schedule.streamed)
        self.copier = CudaCopier(self.device, len(order), n) if self.device.type == "cuda" else SyncCopier()
        self._install_hooks(modules)

    def _place_resident(self, resident: list, host_module_ids: set) -> None:
        """Resident weights: one flat device buffer (exact size; per-tensor allocations would each be rounded up by
        the caching allocator, ~1 MB per large tensor, a quarter GB for SDXL); buffers of every module not run on
        the host move to the device."""
        res_layout = FlatLayout.of(resident, self.dtype)
        self.resident = torch.empty(res_layout.nbytes, dtype=torch.uint8, device=self.device)
        for p, view in zip(resident, res_layout.views(self.resident)):
            view.copy_(p.data)
            p.data = view
        for mod in self.unet.modules():
            if id(mod) in host_module_ids:
                continue
            for name, buf in list(mod._buffers.items()):
                if buf is not None:
                    setattr(mod, name, buf.to(self.device))

    def _pack_units(self, slot_bytes: int) -> list[Optional[PackedUnit]]:
        """Each streamed unit's packed copy, or None where it does not pack smaller within the slot (module
        docstring); all None when the host lacks the memory for them or packing runs out of memory."""
        plain = sum(lay.nbytes for lay in self._layouts)
        available = available_host_bytes()
        if available is not None and packed_host_estimate(plain) > HOST_SHARE * available:
            logger.warning("streamed weights cross unpacked: packing them needs ~%.1f GiB of host memory, %.1f GiB "
                           "available", packed_host_estimate(plain) / 2 ** 30, available / 2 ** 30)
            return [None] * len(self._layouts)
        start, packed = time.perf_counter(), []
        pin = self.device.type == "cuda"
        try:
            for src in self._src:
                limit = min(slot_bytes // self.schedule.slots, int(0.9 * src.numel()))
                packed.append(pack_words(src.view(torch.int16), device=self.device, pin=pin, limit_bytes=limit))
        except torch.OutOfMemoryError as exc:  # the device had no room to pack in: plain copies, the same weights
            for unit in packed:
                if unit is not None:
                    unit.host.release()
            logger.warning("streamed weights cross unpacked: packing them ran out of memory (%s)",
                           str(exc).splitlines()[0][:160])
            return [None] * len(self._layouts)
        moved = sum(p.nbytes if p is not None else lay.nbytes for p, lay in zip(packed, self._layouts))
        logger.info("packed %d of %d streamed blocks in %.1f s: %.2f GB cross per forward instead of %.2f GB",
                    sum(p is not None for p in packed), len(packed), time.perf_counter() - start, moved / 1e9,
                    plain / 1e9)
        return packed

    def hold(self, room_bytes: int) -> int:
        """Keep as many streamed units as fit in ``room_bytes`` on the device for the coming forwards, in schedule
        order (module docstring); returns the bytes held (0 without a ring, or out of memory)."""
        self.release_held()
        if self.arena is None or room_bytes <= 0:
            return 0
        chosen, total = HeldUnits.choose(self._layouts, room_bytes)
        if not chosen:
            return 0
        try:
            buffer = torch.empty(total, dtype=torch.uint8, device=self.device)
        except torch.OutOfMemoryError:
            return 0
        self._held = HeldUnits(buffer, chosen, self._streamed, self._layouts)
        self._prefetched = set()  # a head copied ahead went to its ring slice, not to its held slice
        return total

    def release_held(self) -> None:
        """Forget the held units: their parameters are ring slices again and every forward copies them."""
        if self._held is not None:
            self._held.release(self.arena, self.schedule.offsets)
            self._held = None
            self._prefetched = set()  # a held unit's ring slice was not filled while it was held

    @property
    def packed_units(self) -> int:
        """How many streamed units cross packed."""
        return sum(p is not None for p in self._packed)

    # ----------------------------------------------------------------- staging ring
    def onload(self) -> None:
        """Allocate the staging ring on the device and make each streamed parameter a fixed view of its slice (at
        build time unless ``arena_at_build`` is False: then the stage that runs the model calls it)."""
        if self.arena is not None:
            return
        arena = torch.empty(max(self.schedule.arena_bytes, ALIGN), dtype=torch.uint8, device=self.device)
        with torch.no_grad():
            for params, lay, aoff in zip(self._streamed, self._layouts, self.schedule.offsets):
                for p, av in zip(params, lay.views(arena, aoff)):
                    p.data = av
        self._dst = [arena[a: a + lay.nbytes] for a, lay in zip(self.schedule.offsets, self._layouts)]
        ring, slots = self.schedule.ring_bytes, self.schedule.slots
        each = self.schedule.slot_bytes // slots if slots else 0
        self._slots = [arena[ring + i * each: ring + (i + 1) * each] for i in range(slots)] if each else []
        self.arena = arena

    def offload(self) -> None:
        """Drop the staging ring: a forward left unfinished is closed first (its copies joined), then every streamed
        parameter points at its host copy again."""
        if self.arena is None:
            return
        self.end_unfinished()
        with torch.no_grad():
            for p, hv in self._host_param_views:
                p.data = hv
        self._dst, self._slots, self.arena, self._prefetched = [], [], None, set()
        self.release_held()

    # ----------------------------------------------------------------- hooks
    def _install_hooks(self, modules: dict) -> None:
        self.handles["unet.begin"] = self.unet.register_forward_pre_hook(self._begin)
        self.handles["unet.end"] = self.unet.register_forward_hook(self._end, always_call=True)
        for i, u in enumerate(self.schedule.order):
            mod = modules[u.name]
            self.handles[f"{u.name}.before"] = mod.register_forward_pre_hook(lambda m, a, i=i: self._before(i))
            if i in self._issue_after or i in self._prefetch_after:
                self.handles[f"{u.name}.after"] = mod.register_forward_hook(lambda m, a, o, i=i: self._after(i))

    def _issue(self, ks: list[int], gate: Optional[int]) -> None:
        """Copy units ``ks`` (positions in the schedule's streamed units) into their ring slices once unit ``gate``
        (an index into the order; None: the forward's fork) has finished computing."""
        if self.arena is None:  # no staging ring (outside the stage): streamed weights are their host copies
            return
        for k in ks:
            dst, after = self._dst[k], gate
            if self._held is not None and k in self._held:
                dst, after = self._held.take_fill(k), None  # its own slice: no earlier unit reads it
                if dst is None:  # filled by an earlier forward of the run: nothing crosses
                    continue
            packed = self._packed[k] if self._packed else None
            if packed is not None and self._slots:
                i = self._packed_issued % len(self._slots)
                self.copier.copy_packed(dst, packed, self._slots[i], k, self._slot_users[i], after)
                self._slot_users[i] = k
                self._packed_issued += 1
            else:
                self.copier.copy(dst, self._src[k], k, after)
            self.copies_issued += 1

    def _begin(self, module, args) -> None:
        self._depth += 1  # counted before the check: the refused call's own end hook (always called) uncounts it
        if self._active:
            raise RuntimeError("the streamed UNet was entered twice without finishing (re-entrant call)")
        self._start()

    def _start(self) -> None:
        self._active = True
        self._cursor = 0
        self._packed_issued = 0  # forward-local: no wait on a previous forward's decodes (the fork orders them)
        self._slot_users = [None] * self.schedule.slots
        self.copier.begin()
        heads = self._issue_after.get(-1, [])
        if not self._capturing():
            heads = [k for k in heads if k not in self._prefetched]
        self._prefetched = set()
        self._issue(heads, None)

    def _before(self, i: int) -> None:
        if not self._active:
            raise RuntimeError(f"UNet block {self.schedule.order[i].name} ran outside a UNet forward; streamed "
                               f"blocks can only run inside the whole UNet")
        if i != self._cursor:  # the UNet's end hook (always called) closes the schedule
            raise RuntimeError(f"UNet block order changed: expected {self.schedule.order[self._cursor].name}, "
                               f"got {self.schedule.order[i].name}; re-apply the VRAM policy")
        self._cursor += 1
        k = self._kpos.get(i)
        if k is not None:
            self.copier.before(k)

    def _after(self, i: int) -> None:
        ks = self._issue_after.get(i, [])
        ahead = self._prefetch_after.get(i, []) if self._prefetch and self.arena is not None else []
        if ahead and self._capturing():
            ahead = []
        if ks or ahead:
            self.copier.after(i)
            self._issue(ks + ahead, i)
            self._prefetched.update(ahead)

    def _capturing(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def prefetch_next(self, on: bool) -> None:
        """Whether the coming eager forwards copy the next forward's head units (module docstring); heads already
        copied stay valid for the next forward either way."""
        self._prefetch = bool(on)

    def drop_prefetched(self) -> None:
        """Stop prefetching and forget what was copied ahead: the next forward copies all of its own units."""
        self._prefetch, self._prefetched = False, set()

    def _end(self, module, args, output) -> None:
        """Runs after every UNet forward, also one that raised (``output`` is then ``None``)."""
        self._depth -= 1
        if self._depth > 0:  # the end of a refused nested call: the outer forward is still running
            return
        was_active, self._active = self._active, False
        if not was_active:  # this forward failed before its schedule began: nothing to join
            return
        if output is None:
            self._prefetched = set()
        self.copier.end()  # a failed forward joins too: the next one orders after every copy it issued
        if output is not None and self._cursor != len(self.schedule.order):
            raise RuntimeError(f"UNet forward ran {self._cursor} of {len(self.schedule.order)} blocks")

    def end_unfinished(self) -> bool:
        """Close a forward whose end hook never ran; True if there was one (the placement calls this when a UNet
        session exits, after every forward of the session has returned or raised).

        torch runs ``always_call`` hooks only for a forward that raised an ``Exception``: a ``KeyboardInterrupt``
        (or ``SystemExit``) inside a block skips the end hook; without this call the streamer would stay 'active'
        and refuse every later forward of the model as re-entrant."""
        if not self._active and self._depth == 0:
            return False
        was_active = self._active
        self._active, self._depth = False, 0
        if was_active:
            self.copier.end()  # join the copy stream as a finished forward would
        return True

    # ----------------------------------------------------------------- teardown
    def remove(self) -> None:
        """Remove every hook and put every UNet weight back on the host (plain memory)."""
        for h in self.handles.values():
            h.remove()
        self.handles.clear()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        with torch.no_grad():
            for p, hv in self._host_param_views:
                p.data = hv
                if hasattr(p, HOST_COPY_ATTR):
                    delattr(p, HOST_COPY_ATTR)
            for p in self.unet.parameters():
                if p.device != torch.device("cpu"):
                    p.data = p.data.cpu()
            for mod in self.unet.modules():
                for name, buf in list(mod._buffers.items()):
                    if buf is not None:
                        setattr(mod, name, buf.cpu())
        self._host_param_views = []
        self._src, self._dst, self._slots, self.arena = [], [], [], None
        self.release_held()
        self.resident = None
        for packed in self._packed:
            if packed is not None:
                packed.host.release()
        self._packed = []
        if self.host is not None:
            self.host.release()

"""Block-wise UNet weight streaming inside a VRAM budget (the ``stream`` policy's engine).

What is streamed
    The UNet is cut into *units*: every ``ResnetBlock2D``, ``BasicTransformerBlock``, ``Downsample2D`` and
    ``Upsample2D`` (each runs once per forward, in a fixed order, and uses its weights only inside its own
    ``forward``). Everything else (conv_in/out, time and added embeddings, norms, transformer proj_in/out; ~2% of
    SDXL) is always resident. The execution order and every unit's output size at the working shape come from one
    forward of an empty copy of the UNet on the ``meta`` device (no data, no memory, milliseconds).

Resident set
    ``capacity = budget - headroom - activations_estimate - always_resident - arena`` (``policies.HEADROOM``,
    currently 0: the estimate has its own margin; resident weights sit in one exact-size flat buffer). Units stay
    resident until the capacity is used; the rest (``S`` bytes) stream. Which units stream: those with the most compute per weight
    byte (``flops_i / bytes_i``; the high-resolution blocks), so their copies hide behind their own compute;
    among equal ratios (SDXL's 60 identical 32x32 transformer blocks) a bit-reversed pick spreads the streamed ones
    evenly through the forward instead of clustering them.

Staging arena and schedule (the math)
    Streamed units live in one device ``arena`` of ``A`` bytes used as a ring: unit ``k`` (in execution order)
    gets the next ``[off_k, off_k + s_k)`` slice, wrapping to 0 when it does not fit. Its parameters are *fixed
    views* of that slice for the whole life of the placement (no allocation per step, fixed addresses: a captured
    CUDA graph stays valid). ``p(k)`` = the last earlier streamed unit whose slice overlaps ``k``'s: the copy of
    ``k`` may start once ``p(k)`` has finished computing. With ``A >= 3 * max(s_k)`` every copy has at least one
    unit of lead (block k+1 is fetched while block k computes), bigger arenas give more lead.

    Per forward, on the current stream ``C`` and one side stream ``S``:
      begin:        record E0 on C; S waits E0 (fork: the previous forward is done with the arena);
                    S copies every unit with no ``p(k)`` (host pinned -> arena), records ``ready[k]``
      before k:     C waits ``ready[k]``
      after unit j: record ``done[j]`` on C; S waits ``done[j]``; S copies every ``k`` with ``p(k) = j``,
                    records ``ready[k]``
      end:          record E1 on S; C waits E1 (join: nothing is left outstanding on S)
    Every copy is one ``cudaMemcpyAsync`` of ``s_k`` contiguous bytes from a pinned host buffer (laid out like the
    arena slice). There are no host syncs, no allocations and no ``.item()``, so the whole forward, copies
    included, can be captured into a CUDA graph (fork/join through events is how CUDA graphs express multi-stream
    work). On the CPU the same schedule runs with synchronous copies and no events.

    Time model: a step costs ~``max(sum_i c_i, S / B)`` when copies hide, where ``c_i`` is unit compute and ``B``
    the pinned H2D bandwidth (~50 GB/s on H100/H200). SDXL fp16 at 128x128 latent, batch 2: ~5.1 GB of weights,
    ~60 ms eager compute. At a 4 GB budget about 1.9-2.3 GB stream: 38-46 ms of copy, hidden behind 60 ms of
    compute if spread evenly (the target is <= 1.25x full eager). At 1.5 GB about 4.4 GB stream: ~88 ms of copy,
    so the step is copy-bound at ~90-100 ms, against 227 ms for diffusers' leaf-level group offload (target
    <= 0.6x). :func:`simulate` evaluates exactly this model to choose the arena size and to print the plan.
"""
from __future__ import annotations

import logging
import math
import traceback
from dataclasses import dataclass
from typing import Optional

import torch

from .hostmem import ALIGN, FlatLayout, PinnedBuffer, align

logger = logging.getLogger(__name__)

HOST_COPY_ATTR = "_leandiffusion_host_copy"


def host_copy(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The pinned host tensor that holds a streamed parameter's values, else None. A streamed parameter's device
    tensor is a slot of the staging ring: its contents are that parameter's only inside its unit's forward, so code
    that reads weights outside a forward (the DoRA gain, ``lora/dora_forward.py``) reads this copy instead."""
    return getattr(param, HOST_COPY_ATTR, None)


ASSUMED_H2D_BYTES_PER_S = 50e9
ASSUMED_FLOPS_PER_S = 200e12
COPY_OVERHEAD_S = 5e-6
ARENA_MULTIPLES = (3, 4, 6, 8, 12)
CONTEXT_TOKENS = 77


def stream_unit_types() -> tuple:
    from diffusers.models.attention import BasicTransformerBlock
    from diffusers.models.resnet import Downsample2D, ResnetBlock2D, Upsample2D

    return (ResnetBlock2D, BasicTransformerBlock, Downsample2D, Upsample2D)


@dataclass(frozen=True)
class Unit:
    name: str
    nbytes: int  # aligned flat size in the target dtype
    flops: float  # at the working shape
    out_numel: int = 0  # elements of the unit's output at the working shape
    kind: str = ""  # "resnet", "transformer", "downsample", "upsample"


def unit_params(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for _, p in module.named_parameters()]


# --------------------------------------------------------------------------------------------- tracing
def meta_inputs(config, batch: int, latent_h: int, latent_w: int) -> tuple:
    cross = config.cross_attention_dim
    if not isinstance(cross, int):
        raise ValueError(f"UNet cross_attention_dim={cross!r}: per-block context widths are not supported")
    dev = torch.device("meta")
    args = (torch.empty(batch, config.in_channels, latent_h, latent_w, device=dev), torch.tensor(500, device=dev))
    kwargs = {"encoder_hidden_states": torch.empty(batch, CONTEXT_TOKENS, cross, device=dev)}
    if config.addition_embed_type == "text_time":
        pooled = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
        kwargs["added_cond_kwargs"] = {"text_embeds": torch.empty(batch, pooled, device=dev),
                                       "time_ids": torch.empty(batch, 6, device=dev)}
    return args, kwargs


def trace_units(unet: torch.nn.Module, working_shape: tuple[int, int, int], dtype: torch.dtype) -> list[Unit]:
    """Units in execution order with their flat sizes and FLOP estimates (one ``meta`` forward)."""
    types = stream_unit_types()
    batch, h, w = working_shape
    with torch.device("meta"):
        ghost = type(unet).from_config(unet.config)
    seen: list[tuple[str, tuple]] = []
    handles = []
    for name, mod in ghost.named_modules():
        if isinstance(mod, types):
            handles.append(mod.register_forward_hook(
                lambda m, a, out, name=name: seen.append((name, tuple((out[0] if isinstance(out, tuple) else out).shape)))))
    try:
        args, kwargs = meta_inputs(unet.config, batch, h, w)
        with torch.no_grad():
            ghost(*args, **kwargs)
    finally:
        for hd in handles:
            hd.remove()
    names = [n for n, _ in seen]
    if len(set(names)) != len(names):
        raise ValueError("a UNet block ran twice in one forward; block streaming needs each block to run once")
    real = dict(unet.named_modules())
    units = []
    for name, shape in seen:
        mod = real[name]
        params = unit_params(mod)
        nbytes = FlatLayout.of(params, dtype).nbytes if params else 0
        if len(shape) == 4:
            tokens, quad = shape[0] * shape[2] * shape[3], 0.0
        else:  # [B, N, C] transformer tokens: + self-attention's two N x N x C products
            tokens, quad = shape[0] * shape[1], 4.0 * shape[0] * shape[1] ** 2 * shape[2]
        kv = sum(p.numel() for n, p in mod.named_parameters() if ".attn2.to_k" in "." + n or ".attn2.to_v" in "." + n)
        total = sum(p.numel() for p in params)
        flops = 2.0 * tokens * (total - kv) + 2.0 * batch * CONTEXT_TOKENS * kv + quad
        kind = {0: "resnet", 1: "transformer", 2: "downsample", 3: "upsample"}[
            next(k for k, t in enumerate(types) if isinstance(mod, t))]
        units.append(Unit(name, nbytes, flops, int(torch.Size(shape).numel()), kind))
    return units


# --------------------------------------------------------------------------------------------- planning
@dataclass(frozen=True)
class StreamSchedule:
    order: tuple  # all units, execution order
    streamed: tuple  # indices into ``order`` of streamed units, ascending
    offsets: tuple  # arena offset per streamed unit
    wait_for: tuple  # per streamed unit: index into ``order`` of the unit that must finish first, or -1
    arena_bytes: int
    est_step_s: float
    est_compute_s: float

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
             rate: float = ASSUMED_FLOPS_PER_S) -> float:
    """Step time (s) of the schedule under the module docstring's model (one copy engine, one compute stream)."""
    kpos = {i: k for k, i in enumerate(streamed)}
    compute_end: dict[int, float] = {}
    ready: dict[int, float] = {}
    copy_free, kk, t = 0.0, 0, 0.0
    for i, u in enumerate(units):
        while kk < len(streamed) and wait_for[kk] < i:
            start = max(copy_free, compute_end.get(wait_for[kk], 0.0))
            copy_free = start + units[streamed[kk]].nbytes / bw + COPY_OVERHEAD_S
            ready[kk] = copy_free
            kk += 1
        start = max(t, ready[kpos[i]]) if i in kpos else t
        t = start + u.flops / rate
        compute_end[i] = t
    return t


def plan_schedule(units: list[Unit], capacity_bytes: int) -> StreamSchedule:
    """Best schedule whose resident units + arena fit ``capacity_bytes`` (raises ``ValueError`` if none fits)."""
    total = sum(u.nbytes for u in units)
    compute = sum(u.flops for u in units) / ASSUMED_FLOPS_PER_S
    if total <= capacity_bytes:
        return StreamSchedule(tuple(units), (), (), (), 0, compute, compute)
    biggest = max(u.nbytes for u in units)
    best: Optional[StreamSchedule] = None
    for m in ARENA_MULTIPLES:
        arena = int(m * biggest)
        if arena > capacity_bytes:
            break
        streamed = choose_streamed(units, total - (capacity_bytes - arena))
        offsets, wait_for = ring_layout(units, streamed, arena)
        est = simulate(units, streamed, wait_for)
        cand = StreamSchedule(tuple(units), tuple(streamed), tuple(offsets), tuple(wait_for), arena, est, compute)
        if best is None or est < best.est_step_s * 0.98:
            best = cand
    if best is None:
        raise ValueError(f"capacity {capacity_bytes} B cannot hold the minimum staging arena "
                         f"({ARENA_MULTIPLES[0]} x {biggest} B)")
    return best


def minimum_arena_bytes(units: list[Unit]) -> int:
    return int(ARENA_MULTIPLES[0] * max(u.nbytes for u in units))


# --------------------------------------------------------------------------------------------- runtime
class _SyncCopier:
    """CPU (or any synchronous) copy engine: the same schedule, copies happen at issue time."""

    def begin(self) -> None:
        return None

    def before(self, k: int) -> None:
        return None

    def after(self, j: int) -> None:
        return None

    def copy(self, dst: torch.Tensor, src: torch.Tensor, k: int) -> None:
        dst.copy_(src)

    def issue(self, fn) -> None:
        fn()

    def end(self) -> None:
        return None


class _CudaCopier:
    """Side-stream copy engine with fork/join events (capture-safe; see the module docstring)."""

    def __init__(self, device: torch.device, n_units: int, n_streamed: int):
        self.device = device
        self.side = torch.cuda.Stream(device=device)
        self.fork = torch.cuda.Event()
        self.join = torch.cuda.Event()
        self.last = torch.cuda.Event()
        self.done = [torch.cuda.Event() for _ in range(n_units)]
        self.ready = [torch.cuda.Event() for _ in range(n_streamed)]
        self.cur = None
        self._last_recorded = False
        cur = torch.cuda.current_stream(device)
        for ev in [self.fork, self.join, self.last, *self.done, *self.ready]:
            ev.record(cur)  # create every CUDA event now, never during a capture
        torch.cuda.current_stream(device).synchronize()

    def begin(self) -> None:
        self.cur = torch.cuda.current_stream(self.device)
        if self._last_recorded and not torch.cuda.is_current_stream_capturing():
            self.cur.wait_event(self.last)  # a forward issued on another stream waits for the previous one
        self.fork.record(self.cur)
        self.side.wait_event(self.fork)

    def before(self, k: int) -> None:
        self.cur.wait_event(self.ready[k])

    def after(self, j: int) -> None:
        self.done[j].record(self.cur)
        self.side.wait_event(self.done[j])

    def copy(self, dst: torch.Tensor, src: torch.Tensor, k: int) -> None:
        with torch.cuda.stream(self.side):
            dst.copy_(src, non_blocking=True)
            self.ready[k].record(self.side)

    def end(self) -> None:
        if self.cur is None:  # begin never ran (or raised before it had a stream): nothing was forked
            return
        self.join.record(self.side)
        self.cur.wait_event(self.join)
        self.last.record(self.cur)
        # an event recorded during a capture is not a real record outside it: only eager forwards chain on it
        self._last_recorded = not torch.cuda.is_current_stream_capturing()
        self.cur = None


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

    def __init__(self, unet: torch.nn.Module, schedule: StreamSchedule, device: torch.device, dtype: torch.dtype):
        self.unet = unet
        self.schedule = schedule
        self.device = torch.device(device)
        self.dtype = dtype
        self.handles: dict[str, torch.utils.hooks.RemovableHandle] = {}
        self._host_param_views: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        self._src, self._dst = [], []
        self.host = self.arena = self.resident = None
        self.copies_issued = 0
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
        # Host side: one pinned buffer, unit k's params laid out exactly as in its arena slice.
        layouts = [FlatLayout.of(unit_params(m), dtype) for m in streamed_mods]
        host_offsets, pos = [], 0
        for lay in layouts:
            host_offsets.append(pos)
            pos += lay.nbytes
        self.host = PinnedBuffer(max(pos, ALIGN), pin=self.device.type == "cuda")
        self.arena = torch.empty(max(schedule.arena_bytes, ALIGN), dtype=torch.uint8, device=self.device)
        with torch.no_grad():
            for m, lay, hoff, aoff in zip(streamed_mods, layouts, host_offsets, schedule.offsets):
                params = unit_params(m)
                for p, hv, av in zip(params, lay.views(self.host.tensor, hoff), lay.views(self.arena, aoff)):
                    hv.copy_(p.data)
                    p.data = av
                    setattr(p, HOST_COPY_ATTR, hv)
                    self._host_param_views.append((p, hv))
            # Resident weights: one flat device buffer (exact size; per-tensor allocations would each be rounded
            # up by the caching allocator, ~1 MB per large tensor, a quarter GB for SDXL).
            resident = [p for p in unet.parameters() if id(p) not in streamed_params]
            res_layout = FlatLayout.of(resident, dtype)
            self.resident = torch.empty(res_layout.nbytes, dtype=torch.uint8, device=self.device)
            for p, view in zip(resident, res_layout.views(self.resident)):
                view.copy_(p.data)
                p.data = view
            for mod in unet.modules():
                for name, buf in list(mod._buffers.items()):
                    if buf is not None:
                        setattr(mod, name, buf.to(self.device))
        self._src = [self.host.tensor[h: h + lay.nbytes] for h, lay in zip(host_offsets, layouts)]
        self._dst = [self.arena[a: a + lay.nbytes] for a, lay in zip(schedule.offsets, layouts)]
        self._issue_after: dict[int, list[int]] = {}
        for k, j in enumerate(schedule.wait_for):
            self._issue_after.setdefault(j, []).append(k)
        self._kpos = {i: k for k, i in enumerate(schedule.streamed)}
        n = len(schedule.streamed)
        self.copier = _CudaCopier(self.device, len(order), n) if self.device.type == "cuda" else _SyncCopier()
        self._install_hooks(modules)

    # ----------------------------------------------------------------- hooks
    def _install_hooks(self, modules: dict) -> None:
        self.handles["unet.begin"] = self.unet.register_forward_pre_hook(self._begin)
        self.handles["unet.end"] = self.unet.register_forward_hook(self._end, always_call=True)
        for i, u in enumerate(self.schedule.order):
            mod = modules[u.name]
            self.handles[f"{u.name}.before"] = mod.register_forward_pre_hook(lambda m, a, i=i: self._before(i))
            if i in self._issue_after:
                self.handles[f"{u.name}.after"] = mod.register_forward_hook(lambda m, a, o, i=i: self._after(i))

    def _issue(self, ks: list[int]) -> None:
        for k in ks:
            self.copier.copy(self._dst[k], self._src[k], k)
            self.copies_issued += 1

    def _begin(self, module, args) -> None:
        self._depth += 1  # counted before the check: the refused call's own end hook (always called) uncounts it
        if self._active:
            raise RuntimeError("the streamed UNet was entered twice without finishing (re-entrant call)")
        self._active = True
        self._cursor = 0
        self.copier.begin()
        self._issue(self._issue_after.get(-1, []))

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
        ks = self._issue_after.get(i)
        if ks:
            self.copier.after(i)
            self._issue(ks)

    def _end(self, module, args, output) -> None:
        """Runs after every UNet forward, also one that raised (``output`` is then ``None``)."""
        self._depth -= 1
        if self._depth > 0:  # the end of a refused nested call: the outer forward is still running
            return
        was_active, self._active = self._active, False
        if not was_active:  # this forward failed before its schedule began: nothing to join
            return
        self.copier.end()  # a failed forward joins too: the next one orders after every copy it issued
        if output is not None and self._cursor != len(self.schedule.order):
            raise RuntimeError(f"UNet forward ran {self._cursor} of {len(self.schedule.order)} blocks")

    def end_unfinished(self) -> bool:
        """Close a forward whose end hook never ran; True if there was one (the placement calls this when a UNet
        session exits, after every forward of the session has returned or raised).

        torch runs ``always_call`` hooks only for a forward that raised an ``Exception``: a ``KeyboardInterrupt``
        (or ``SystemExit``) inside a block skips the end hook, and the streamer stayed 'active', so every later
        forward of the model was refused as re-entrant until the model was loaded again."""
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
        self._src, self._dst = [], []
        self.arena = None
        self.resident = None
        if self.host is not None:
            self.host.release()

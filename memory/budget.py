"""The ``stream`` policy's VRAM budget as a hard limit on every stage of every node, not only on the plan's estimate.

Invariants (an engine whose plan is budgeted -- policy ``stream`` -- on a CUDA device; elsewhere nothing here acts)
- While any session of the engine runs (``LeanEngine.session``: samplers, prompt encoding, VAE decode / encode, the
  Stream Scheduler's stages), the process's caching allocator holds at most ``cap_bytes``: the budget plus what
  other models held beyond ``SMALL_OTHERS_BYTES`` when the session began (``memory.cap`` does the capping; cached
  blocks go back to the driver before the process would hold more, and only live tensors that do not fit raise
  out-of-memory). The placement opens the cap when a stage is entered and restores the previous one at its exit.
- Device memory that outlives a call but is not in the plan -- captured CUDA graphs and their private memory pools
  (``sampling.graph_runner``) -- is registered here (``register_device_cache``). Before a text or VAE stage places
  its weights, these caches are released when what the process holds plus the stage's weights and its working
  floor (``STAGE_FLOOR_BYTES``) would not fit under the cap less the loader's headroom; the next sampler run
  captures its graphs again. The UNet stage keeps them when it replays them; an eager UNet run releases them when
  they would leave its activations (the plan's estimate) no room (``ensure_room``).
- ``room_bytes``: what the cap leaves now for the running stage's working memory (after the loader's headroom);
  the Tiled VAE Decode / Encode size their tiles from it (``vae.targets``).

Why: measured on an H100 (2026-11-22, SDXL 1024 px, full-size random weights, ``stream`` policy, the nodes called
one after another as a workflow does, ``scripts/diag/budget_node_paths.py``): the Fused DDIM Sampler stayed within
the budget (1.22 GB reserved at 1.5 GB, its 0.6 GB captured graph included), but the Tiled VAE Decode never saw
the budget (it sized its tiles from the free VRAM) and held 11.5 GB at a 4 GB budget and 9.2 GB at 1.5 GB; with
its tiles sized by the budget, the sampler's graph pool still left no room for the VAE's weights.

Cost (H100, ``scripts/diag/budget_overheads.py``, medians of three alternating runs): a budgeted Stream Scheduler
run of SD1.5 @ 3 GB, 4 images x 10 steps, 0.676 s against 0.644 s with the stage scopes switched off (the device
syncs and cache releases of each decode's room check); SDXL @ 4 GB, 2 x 10, 2.85 vs 2.78 s (within the spread).
"""
from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Any, Iterator, Optional

import torch

from .cap import allocator_cap, device_storage_bytes

logger = logging.getLogger(__name__)

NO_CAP = 1 << 62
MiB = 2 ** 20
# Allocated memory outside the engine that still counts against its budget: small buffers and library workspaces
# (the Stream Scheduler first releases cuBLAS's; measured before that: 0.1-0.43 GiB after earlier runs, H100).
SMALL_OTHERS_BYTES = 256 * MiB
# The least working memory a stage must find under the cap beside its weights before cached graphs are released:
# VAE: an exact tiled decode of 256 px tiles in fp32 with the reserved/estimate factor (vae.tiled); text: one
# prompt batch's embeddings and activations.
STAGE_FLOOR_BYTES = {"text": 128 * MiB, "vae": 512 * MiB}

_device_caches: "weakref.WeakSet[Any]" = weakref.WeakSet()


def budgeted_plan(engine) -> Optional[Any]:
    """The loader's memory plan when it sets a hard VRAM budget (policy ``stream``), else ``None``."""
    return hard_budget_plan(getattr(engine, "placement", None))


def hard_budget_plan(placement) -> Optional[Any]:
    plan = getattr(placement, "plan", None)
    if plan is None or getattr(plan, "policy", "") != "stream" or not getattr(plan, "budget_bytes", None):
        return None
    return plan


def _capped_device(placement) -> Optional[torch.device]:
    device = getattr(placement, "device", None)
    if hard_budget_plan(placement) is None or device is None or torch.device(device).type != "cuda":
        return None
    return torch.device(device)


def engine_device_bytes(placement, device: torch.device) -> int:
    """Bytes of the engine's own storages on ``device``: its modules' weights and the block streamer's buffers."""
    parts = placement.parts
    streamer = getattr(placement, "streamer", None)
    modules = (parts.unet, parts.vae, parts.text_encoder, getattr(parts, "text_encoder_2", None))
    return device_storage_bytes(modules, (getattr(streamer, "arena", None), getattr(streamer, "resident", None)),
                                device)


def cap_bytes(placement) -> int:
    """The allocator cap for a session of ``placement``'s engine: the budget plus what the process already held
    outside this engine (other models, ComfyUI's own tensors: allocated memory minus the engine's storages)
    beyond ``SMALL_OTHERS_BYTES``; without a hard budget on a CUDA device, ``NO_CAP``."""
    device = _capped_device(placement)
    if device is None:
        return NO_CAP
    others = max(0, torch.cuda.memory_allocated(device) - engine_device_bytes(placement, device) - SMALL_OTHERS_BYTES)
    return hard_budget_plan(placement).budget_bytes + others


def run_cap_bytes(engine) -> int:
    """``cap_bytes`` of the engine's placement (``NO_CAP`` without a budget or off CUDA)."""
    return cap_bytes(getattr(engine, "placement", None))


def _headroom(plan) -> int:
    from .policies import HEADROOM

    return int(HEADROOM * plan.budget_bytes)


def room_bytes(engine, cap: Optional[int] = None) -> Optional[int]:
    """What the budget leaves now for the running stage's working memory: the cap less the loader's headroom less
    what the process holds once cached blocks are returned (weights, live tensors, graph pools); ``None`` without
    a hard budget on a CUDA device. May be negative when the process already holds more."""
    placement = getattr(engine, "placement", None)
    if _capped_device(placement) is None:
        return None
    return _room(placement, cap_bytes(placement) if cap is None else cap)


def _room(placement, cap: int) -> int:
    device = _capped_device(placement)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # what stays reserved is what the process really holds
    return cap - _headroom(hard_budget_plan(placement)) - torch.cuda.memory_reserved(device)


# --------------------------------------------------------------------------------------------- device caches
def register_device_cache(owner: Any) -> None:
    """Register ``owner`` (weakly): an object with ``release_device_memory(parts)`` that drops what it keeps on the
    device for that model (``GraphRunner``: its captured graphs)."""
    _device_caches.add(owner)


def release_device_caches(parts) -> None:
    """Every registered cache drops what it keeps for ``parts``; cached blocks go back to the driver."""
    for owner in list(_device_caches):
        owner.release_device_memory(parts)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def stage_weight_bytes(placement, stage: str) -> int:
    """Bytes the stage brings onto the device when it is entered (its weights when placed only while used)."""
    plan = hard_budget_plan(placement)
    if stage == "vae" and getattr(plan, "vae_mode", "") == "while used":
        return int(plan.vae_bytes)
    if stage == "text" and getattr(plan, "text_mode", "") == "while used":
        return int(plan.text_bytes)
    return 0


def make_room(placement, stage: str, cap: int) -> bool:
    """Release the registered device caches of the engine's model when the stage's weights and working floor would
    not fit under ``cap`` (less headroom) beside what the process holds; True if they were released."""
    if stage not in STAGE_FLOOR_BYTES:
        return False
    return _release_if_short(placement, stage_weight_bytes(placement, stage) + STAGE_FLOOR_BYTES[stage], cap,
                             f"{stage} stage")


def ensure_room(engine, need_bytes: int, what: str) -> bool:
    """Inside a running stage: release the model's registered device caches when ``need_bytes`` more would not fit
    under the budget beside what the process holds (an eager UNet run does not use the cached graphs; under a
    tight budget their pools would leave its activations no room); True if they were released."""
    placement = getattr(engine, "placement", None)
    if _capped_device(placement) is None:
        return False
    return _release_if_short(placement, need_bytes, cap_bytes(placement), what)


def _release_if_short(placement, need: int, cap: int, what: str) -> bool:
    if _capped_device(placement) is None:
        return False
    room = _room(placement, cap)
    if need <= room:
        return False
    held = cap - _headroom(hard_budget_plan(placement)) - room
    release_device_caches(placement.parts)
    logger.info("%s: released cached CUDA graphs of %s to fit under the %.2f GiB VRAM budget (held %.2f GiB, now "
                "%.2f GiB; the next CUDA-graph run captures again)", what, getattr(placement.parts, "name", "model"),
                hard_budget_plan(placement).budget_bytes / 2 ** 30, held / 2 ** 30,
                torch.cuda.memory_reserved(placement.device) / 2 ** 30)
    return True


@contextlib.contextmanager
def stage_budget(placement, stage: str) -> Iterator[int]:
    """Hold the process under the engine's budget for one stage (module docstring); yields the cap in bytes
    (``NO_CAP`` where nothing is capped). Enter before the stage places its weights."""
    if _capped_device(placement) is None:
        yield NO_CAP
        return
    cap = cap_bytes(placement)
    if stage != "unet":
        make_room(placement, stage, cap)
    with allocator_cap(placement.device, cap):
        yield cap

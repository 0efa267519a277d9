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
  captures its graphs again. A text stage told its call's ``(prompts, tokens)`` counts the activations of that
  call (``text_activation_at``), not of the plan's longest prompt, so a short prompt keeps the graphs. The UNet
  stage keeps them when it replays them; an eager UNet run releases them when
  they would leave its activations (the plan's estimate) no room (``ensure_room``).
- A graph runner remembers which of its graphs a release dropped (``GraphRunner.was_released``): a DiT sampler
  asked to capture such a graph again steps eagerly instead, since each later run would capture it only to lose
  it at the same stage (``sampling.dit_steps.prepare_dit_steps``).
- ``room_bytes``: what the cap leaves now for the running stage's working memory (after the loader's headroom);
  the Tiled VAE Decode / Encode size their tiles from it (``vae.targets``).

Why: a budget kept by the plan's estimates alone bounds what the UNet allocates, while every other stage (the
tiled VAE sizing its tiles from the free VRAM, a sampler's captured graph pools beside the VAE's weights) would go
over it; holding the allocator and releasing caches per stage makes the budget a limit on the whole process.
"""
from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Any, Iterator, Optional

import torch

from .cap import allocator_cap, device_storage_bytes
from .text_units import stage_activation_bytes

logger = logging.getLogger(__name__)

NO_CAP = 1 << 62
MiB = 2 ** 20
# Allocated memory outside the engine that still counts against its budget: small buffers and library workspaces
# (the Stream Scheduler first releases cuBLAS's).
SMALL_OTHERS_BYTES = 256 * MiB
# The least working memory a stage must find under the cap beside its weights before cached graphs are released:
# VAE: an exact tiled decode of 256 px tiles in fp32 with the reserved/estimate factor (vae.tiled); text: one
# prompt batch's embeddings and activations.
STAGE_FLOOR_BYTES = {"text": 128 * MiB, "vae": 512 * MiB}

_device_caches: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _capped_device(placement) -> Optional[torch.device]:
    """The CUDA device a hard budget caps, else ``None`` (no hard budget, or not on CUDA)."""
    if not placement.budget.hard or placement.device.type != "cuda":
        return None
    return torch.device(placement.device)


def engine_device_bytes(placement, device: torch.device) -> int:
    """Bytes of the engine's own storages on ``device``: its modules' weights and the block streamer's buffers."""
    parts, streamer = placement.parts, placement.streamer
    modules = (parts.unet, parts.vae, parts.text_encoder, parts.text_encoder_2)
    buffers = (streamer.arena, streamer.resident) if streamer is not None else ()
    return device_storage_bytes(modules, buffers, device)


def cap_bytes(placement) -> int:
    """The allocator cap for a session of ``placement``'s engine: the budget plus what the process already held
    outside this engine (other models, ComfyUI's own tensors: allocated memory minus the engine's storages)
    beyond ``SMALL_OTHERS_BYTES``; without a hard budget on a CUDA device, ``NO_CAP``."""
    device = _capped_device(placement)
    if device is None:
        return NO_CAP
    others = max(0, torch.cuda.memory_allocated(device) - engine_device_bytes(placement, device) - SMALL_OTHERS_BYTES)
    return placement.budget.limit_bytes + others


def run_cap_bytes(engine) -> int:
    """``cap_bytes`` of the engine's placement (``NO_CAP`` without a budget or off CUDA)."""
    return cap_bytes(engine.placement)


def room_bytes(engine, cap: Optional[int] = None) -> Optional[int]:
    """What the budget leaves now for the running stage's working memory: the cap less the loader's headroom less
    what the process holds once cached blocks are returned (weights, live tensors, graph pools); ``None`` without
    a hard budget on a CUDA device. May be negative when the process already holds more."""
    placement = engine.placement
    if _capped_device(placement) is None:
        return None
    return _room(placement, cap_bytes(placement) if cap is None else cap)


def _room(placement, cap: int) -> int:
    device = _capped_device(placement)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # what stays reserved is what the process really holds
    return cap - placement.budget.headroom_bytes - torch.cuda.memory_reserved(device)


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


def text_activation_at(placement, text_shape: Optional[tuple[int, int]]) -> Optional[int]:
    """The text stage's activation + workspace estimate for ``text_shape`` = ``(prompts, tokens)`` of its one
    encoder call (``memory.text_units``' formula, the plan's own at the plan's longest prompt), or ``None`` when
    the shape is not known or the encoder is not one the plan sizes that way."""
    encoder = getattr(placement.parts, "text_encoder", None)
    if text_shape is None or encoder is None:
        return None
    prompts, tokens = (int(v) for v in text_shape)
    dtype = getattr(placement, "text_dtype", torch.float32)
    return stage_activation_bytes(encoder, prompts, tokens, dtype, placement.device.type)


def make_room(placement, stage: str, cap: int, text_shape: Optional[tuple[int, int]] = None) -> bool:
    """Release the registered device caches of the engine's model when the stage's weights and working floor would
    not fit under ``cap`` (less headroom) beside what the process holds; True if they were released. The text
    stage's working memory is sized for ``text_shape`` when given (a short prompt leaves a sampler's cached
    graphs in place where the plan's longest prompt would not)."""
    if stage not in STAGE_FLOOR_BYTES:
        return False
    activations = text_activation_at(placement, text_shape) if stage == "text" else None
    need = placement.budget.entering_bytes(stage, activations) + STAGE_FLOOR_BYTES[stage]
    return _release_if_short(placement, need, cap, f"{stage} stage")


def ensure_room(engine, need_bytes: int, what: str) -> bool:
    """Inside a running stage: release the model's registered device caches when ``need_bytes`` more would not fit
    under the budget beside what the process holds (an eager UNet run does not use the cached graphs; under a
    tight budget their pools would leave its activations no room); True if they were released."""
    placement = engine.placement
    if _capped_device(placement) is None:
        return False
    return _release_if_short(placement, need_bytes, cap_bytes(placement), what)


def _release_if_short(placement, need: int, cap: int, what: str) -> bool:
    if _capped_device(placement) is None:
        return False
    room = _room(placement, cap)
    if need <= room:
        return False
    held = cap - placement.budget.headroom_bytes - room
    release_device_caches(placement.parts)
    logger.info("%s: released cached CUDA graphs of %s to fit under the %.2f GiB VRAM budget (held %.2f GiB, now "
                "%.2f GiB; the next CUDA-graph run captures again)", what, placement.parts.name or "model",
                placement.budget.limit_bytes / 2 ** 30, held / 2 ** 30,
                torch.cuda.memory_reserved(placement.device) / 2 ** 30)
    return True


@contextlib.contextmanager
def stage_budget(placement, stage: str, text_shape: Optional[tuple[int, int]] = None) -> Iterator[int]:
    """Hold the process under the engine's budget for one stage (module docstring); yields the cap in bytes
    (``NO_CAP`` where nothing is capped). Enter before the stage places its weights; ``text_shape`` as
    ``make_room``."""
    if _capped_device(placement) is None:
        yield NO_CAP
        return
    cap = cap_bytes(placement)
    if stage != "unet":
        make_room(placement, stage, cap, text_shape)
    with allocator_cap(placement.device, cap):
        yield cap

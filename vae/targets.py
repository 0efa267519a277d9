"""What a tiled VAE call runs on: the engine's VAE, ComfyUI's native ``VAE`` object, or a bare autoencoder module.

Invariant: a ``VaeTarget`` names the autoencoder module (diffusers or LDM ``AutoencoderKL``), the device and dtype
its weights run in (the loader's ``vae_dtype`` for an engine, ``VAE.vae_dtype`` for ComfyUI), how to enter the
stage (``engine.session("vae")``, ComfyUI's model loader) and, for an engine under the loader's hard budget
(``placement.budget.hard``, enforced by ``memory.budget``), how much working memory that budget leaves (``room``).
It never changes the module; the session (engine) or ComfyUI's patcher places the weights.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from .. import bridge
from ..memory.budget import room_bytes
from ..memory.families import check_node_runs


@dataclass(frozen=True, eq=False)
class VaeTarget:
    ae: torch.nn.Module
    device: torch.device
    dtype: torch.dtype
    enter: Callable[[], Any] = field(default=contextlib.nullcontext)  # context manager factory
    # what the loader's hard VRAM budget leaves now for the call's working memory (bytes; None: no budget)
    room: Optional[Callable[[], Optional[int]]] = None


def from_engine(engine) -> VaeTarget:
    """The engine's VAE, run inside ``engine.session("vae")`` on the stage device in ``engine.vae_dtype``."""
    vae = engine.parts.vae
    room = (lambda: room_bytes(engine)) if engine.placement.budget.hard else None
    return VaeTarget(vae, engine.stage_device("vae"), engine.vae_dtype, lambda: engine.session("vae"), room)


def from_comfy(vae) -> VaeTarget:
    """ComfyUI's ``VAE`` wrapper (``first_stage_model`` an LDM ``AutoencoderKL``), loaded by ComfyUI's manager."""
    ae = getattr(vae, "first_stage_model", None)
    if ae is None or not isinstance(ae, torch.nn.Module):
        raise TypeError(f"vae: expected ComfyUI's VAE object (with first_stage_model), got {type(vae).__name__}")
    device = torch.device(getattr(vae, "device", None) or next(ae.parameters()).device)
    dtype = getattr(vae, "vae_dtype", None) or next(ae.parameters()).dtype
    patcher = getattr(vae, "patcher", None)

    @contextlib.contextmanager
    def enter():
        bridge.load_comfy_model(patcher)
        yield

    return VaeTarget(ae, device, dtype, enter)


def from_module(ae: torch.nn.Module, device=None, dtype=None) -> VaeTarget:
    """A bare autoencoder module, used where it already sits (benchmarks, tests)."""
    p = next(ae.parameters())
    return VaeTarget(ae, torch.device(device) if device is not None else p.device, dtype or p.dtype)


def resolve_target(lean_model=None, vae=None) -> VaeTarget:
    """The node's model inputs -> a target; exactly one of ``lean_model`` / ``vae`` must be given."""
    if (lean_model is None) == (vae is None):
        given = "both" if lean_model is not None else "neither"
        raise ValueError(f"lean_model / vae: {given} given; connect exactly one: a LEAN_MODEL from the Memory Pool "
                         f"Loader, or a VAE from a ComfyUI loader")
    if lean_model is not None:
        if not hasattr(lean_model, "parts") or not hasattr(lean_model, "session"):
            raise TypeError(f"lean_model: expected a LEAN_MODEL engine, got {type(lean_model).__name__}")
        check_node_runs(lean_model.parts.family, "Tiled VAE Decode / Encode")
        return from_engine(lean_model)
    return from_comfy(vae)

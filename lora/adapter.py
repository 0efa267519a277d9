"""The LoRA adapter an engine view carries, and ``inject_lora``, the one public entry point.

Invariants
- ``inject_lora`` never touches a module: it reads and validates the file, refuses a LoRA made for another model
  architecture (``architectures.check_family``: SD on Z-Image or the reverse), resolves every key and shape,
  applies ``target_blocks`` and returns ``engine.with_adapter(adapter)``. Any error leaves the input engine (and
  its modules) exactly as they were. The LoRA acts only inside ``engine.session(...)`` of the returned view.
- ``LoraAdapter.graph_key`` identifies the adapter's *structure* (file identity, device/dtype, targeted modules,
  mode, occurrence in the view) and never its strength, so a CUDA graph captured with one strength replays
  correctly with another (``unmerged`` rewrites its scaled buffers at attach, ``merged`` re-merges in place).
- Views of the same (file, model, targets, mode) share one binding (one set of buffers); the same LoRA stacked
  twice in one view gets a second binding (``occurrence``), so the two strengths never share a buffer.
"""
from __future__ import annotations

import hashlib
import math
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from .architectures import check_family
from ..memory.families import check_node_runs
from ..memory.fp8_weights import is_fp8_layer, storage_name
from .keymap import Target, resolve
from .loader import load_lora
from .merged import MergedBinding
from .targets import filter_targets
from .unmerged import UnmergedBinding, resolve_strategy

MODES = ("unmerged", "merged")
STAGE_COMPONENTS = {"text": ("text_encoder", "text_encoder_2"), "unet": ("unet",), "vae": ()}
MAX_STRENGTH = 10.0

_BINDINGS_LOCK = threading.Lock()
_BINDINGS: "weakref.WeakKeyDictionary[Any, weakref.WeakValueDictionary]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True, eq=False)
class LoraAdapter:
    """One LoRA on one engine view (implements the engine's ``Adapter`` protocol)."""

    binding: Any  # UnmergedBinding | MergedBinding
    strengths: tuple  # ((component, strength), ...)
    name: str
    parts_ref: Any  # weakref to the ModelParts the binding was made for

    @property
    def mode(self) -> str:
        return self.binding.mode

    @property
    def graph_key(self) -> tuple:
        return ("lora",) + self.binding.key

    @property
    def affects_text(self) -> bool:
        """True when the LoRA has text-encoder layers (the prompt cache keys on it: ``sampling.prompt_encoder``)."""
        return any(c != "unet" for c in self.binding.components)

    @property
    def cache_key(self) -> tuple:
        """What the text encoders' output depends on: the binding's structure and the text strengths. Plain values
        only, so a cached prompt never keeps this adapter (its binding, LoRA factors and the model's targeted
        modules) alive, and a view re-made with another UNet strength reuses the cached prompts."""
        return ("lora",) + self.binding.key + tuple((c, s) for c, s in self.strengths if c != "unet")

    def _check(self, parts) -> None:
        if self.parts_ref() is not parts:
            raise RuntimeError(f"LoRA {self.name!r} was injected into another model; re-run the LoRA injector "
                               f"on this model")

    def _for(self, components) -> dict[str, float]:
        return {c: s for c, s in self.strengths if c in components}

    def attach(self, parts) -> None:
        self._check(parts)
        self.binding.attach(dict(self.strengths))

    def detach(self, parts) -> None:
        self.binding.detach(dict(self.strengths))

    def attach_stage(self, parts, stage: str) -> None:
        """Attach only the components ``stage`` runs (the engine calls this when present)."""
        self._check(parts)
        self.binding.attach(self._for(STAGE_COMPONENTS.get(stage, ())))

    def detach_stage(self, parts, stage: str) -> None:
        self.binding.detach(self._for(STAGE_COMPONENTS.get(stage, ())))

    def __repr__(self) -> str:
        strengths = ", ".join(f"{c}={s:g}" for c, s in self.strengths)
        return f"LoraAdapter({self.name!r}, {self.mode}, {strengths}, {len(self.binding.targets)} modules)"


def _check_strength(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a number between -{MAX_STRENGTH:g} and {MAX_STRENGTH:g}, "
                        f"got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or abs(value) > MAX_STRENGTH:
        raise ValueError(f"{name}={value!r}: expected a finite number between -{MAX_STRENGTH:g} and "
                         f"{MAX_STRENGTH:g}")
    return value


def _streams_unet(engine) -> bool:
    """True when the engine's placement streams UNet blocks from host memory (the loader's ``stream`` policy)."""
    return engine.placement.budget.streams_unet


def _targets_digest(targets: list[Target]) -> str:
    names = "\n".join(sorted(f"{t.component}.{t.module_name}" for t in targets))
    return hashlib.sha1(names.encode()).hexdigest()[:16]


def _binding(parts, key: tuple, mode: str, targets: list[Target], label: str, strategy: str, roots: dict):
    with _BINDINGS_LOCK:
        table = _BINDINGS.setdefault(parts, weakref.WeakValueDictionary())
        binding = table.get(key)
        if binding is None:
            if mode == "unmerged":
                binding = UnmergedBinding(key, targets, label, strategy=strategy, roots=roots)
            else:
                binding = MergedBinding(key, targets, label)
            table[key] = binding
        return binding


def inject_lora(engine, lora_path: str | Path, strength: float = 1.0, strength_text_encoder: float = 1.0,
                target_blocks: str = "", mode: str = "unmerged", name: Optional[str] = None, strategy: str = "auto"):
    """A new view of ``engine`` with the LoRA at ``lora_path`` (see the module docstring).

    ``strength`` scales the UNet layers, ``strength_text_encoder`` the text-encoder layers (both encoders on
    SDXL); ``target_blocks`` restricts the LoRA to module prefixes (``lora.targets``); ``mode`` is
    ``"unmerged"`` (computed at forward time, strength in device buffers) or ``"merged"`` (weights merged per
    session). ``strategy`` picks how ``unmerged`` injects (``lora.unmerged.STRATEGIES``; "auto" =
    ``$LEANDIFFUSION_LORA_STRATEGY`` or the default); it is part of the graph key (another strategy is another graph).
    """
    if not all(hasattr(engine, a) for a in ("parts", "placement", "adapters", "with_adapter", "stage_device")):
        raise TypeError(f"lean_model: expected a LEAN_MODEL from the Memory Pool Loader, got "
                        f"{type(engine).__name__}; connect the loader's (or another LoRA node's) lean_model output")
    check_node_runs(engine.family, "Dynamic LoRA Injector")
    strength = _check_strength("strength", strength)
    strength_text_encoder = _check_strength("strength_text_encoder", strength_text_encoder)
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: expected one of {', '.join(MODES)}")
    strategy = resolve_strategy(strategy)
    if not isinstance(target_blocks, str):
        raise TypeError(f"target_blocks: expected a string, got {type(target_blocks).__name__}")
    if mode == "merged" and _streams_unet(engine):
        raise ValueError("mode='merged' cannot be used while the model's VRAM policy streams UNet weights (streamed "
                         "blocks are re-copied from host memory every step, which would drop the merge); use "
                         "mode='unmerged', or a policy that keeps the UNet resident")
    parts = engine.parts
    roots = {"unet": parts.unet, "text_encoder": parts.text_encoder, "text_encoder_2": parts.text_encoder_2}
    path = Path(lora_path)
    # Load on the device/dtype each stage computes in (the text stage may run on the CPU under lowvram).
    unet_dev, text_dev = engine.stage_device("unet"), engine.stage_device("text")
    unet_dt, text_dt = engine.dtype_for("unet"), engine.dtype_for("text")
    if (unet_dev, unet_dt) == (text_dev, text_dt):
        loads = [load_lora(path, unet_dev, unet_dt)]
    else:
        loads = [load_lora(path, unet_dev, unet_dt, ["unet"]),
                 load_lora(path, text_dev, text_dt, ["text_encoder", "text_encoder_2"])]
    for loaded in loads:  # a LoRA made for another architecture, named before any key is resolved
        check_family(loaded.parsed, engine.family, name or path.name)
    targets: list[Target] = []
    for loaded in loads:
        if loaded.parsed.layers:
            targets += resolve(loaded.parsed, roots, engine.family)
    if not targets:
        raise ValueError(f"lora {path.name!r} holds no layer for this model")
    targets = filter_targets(targets, target_blocks, roots)
    if mode == "merged" and any(is_fp8_layer(t.module) for t in targets):
        raise ValueError(f"mode='merged' cannot be used on this model: its UNet weights are stored in "
                         f"{storage_name(parts.unet)} (the loader's weight_dtype), and merging into fp8 would round "
                         f"most of the LoRA's change away; use mode='unmerged' (exact on fp8 weights), or load the "
                         f"model with weight_dtype fp16/bf16 to merge")
    file_key = tuple(loaded.key for loaded in loads)
    base_key = (file_key, mode, _targets_digest(targets))
    occurrence = sum(1 for a in engine.adapters
                     if isinstance(a, LoraAdapter) and a.binding.key[:3] == base_key)
    key = base_key + (occurrence,) + ((strategy,) if mode == "unmerged" else ())
    binding = _binding(parts, key, mode, targets, name or path.name, strategy, roots)
    strengths = tuple((c, strength if c == "unet" else strength_text_encoder) for c in binding.components)
    adapter = LoraAdapter(binding, strengths, name or path.name, weakref.ref(parts))
    return engine.with_adapter(adapter)

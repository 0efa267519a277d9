"""The engine handle (``LEAN_MODEL``): a loaded model's modules plus how and where they run.

Invariants
- An engine is an immutable *view*: ``with_changes`` / ``with_adapter`` return a new engine that shares every
  module and weight with its parent; nothing a downstream node does changes an upstream engine (ComfyUI caches
  node outputs, GUIDE convention 2).
- Every model call of every node runs inside ``with engine.session(stage):`` (the text encoders through
  ``sampling/prompt_encoder.py``, the VAE through ``vae/``; ``unet`` here). The session is where the VRAM
  policy places weights (``placement``), where the UNet's GEGLUs run in one pass (``unet_patches``), its norms on
  the GroupNorm kernels (``unet_norms``) in the layout ``unet_layout`` picks, and where the view's adapters
  (unmerged LoRAs) are attached to the shared modules; all are undone on exit, so a view's LoRA never leaks into
  another view's run.
- Latents handed to ``unet`` are in the model's *scaled* latent space (``raw * scaling_factor``); a LATENT is raw
  (ComfyUI's convention).
- ``placement.budget`` (``memory/vram_budget.py``) says where the weights live and which hard limit holds; callers
  read it instead of asking which policy the placement implements.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Protocol

import torch

from .families import is_dit_family
from .unet_layout import layout_following_transformers, unet_input
from .unet_norms import fused_norms
from .unet_patches import fused_geglus
from .vram_budget import UNBUDGETED, VramBudget

logger = logging.getLogger(__name__)

STAGES = ("text", "unet", "vae")
# SDXL's added time ids (sizes in pixels) stay float32 whatever the weight dtype: the UNet's time projection embeds
# them in float32 anyway, and bf16 would round 3000 to 3008 (fp16: 2049 to 2048), a different sinusoid than the
# size ComfyUI's SDXL model (and diffusers in fp32) embeds
TIME_IDS_DTYPE = torch.float32


@dataclass(frozen=True, eq=False)
class ModelParts:
    """The modules of one checkpoint. Shared by every view of it; never replaced in place.

    ``unet`` holds the family's denoiser, whatever its architecture (a UNet, or a DiT such as Z-Image's
    transformer): the ``unet`` stage runs it, so policies, streaming and adapters treat every family alike."""

    family: str  # "sd1", "sd2", "sd2-v", "sdxl", "zimage", "qwen_image", "qwen_image_edit"
    unet: torch.nn.Module
    vae: torch.nn.Module
    text_encoder: torch.nn.Module
    tokenizer: Any
    scheduler_config: dict
    text_encoder_2: Optional[torch.nn.Module] = None
    tokenizer_2: Any = None
    name: str = ""
    image_processor: Any = None  # Qwen2-VL's, when the text encoder has a vision tower (Qwen-Image-Edit), else None

    @property
    def is_sdxl(self) -> bool:
        return self.text_encoder_2 is not None

    @property
    def prediction_type(self) -> str:
        return self.scheduler_config.get("prediction_type", "epsilon")

    @property
    def vae_scaling_factor(self) -> float:
        return float(self.vae.config.scaling_factor)

    @property
    def vae_shift_factor(self) -> float:
        """Subtracted before scaling (``(raw - shift) * scale``); 0 for the SD VAEs, which have none."""
        shift = getattr(self.vae.config, "shift_factor", None)
        return float(shift) if shift is not None else 0.0

    @property
    def denoiser(self) -> torch.nn.Module:
        """The family's denoiser (UNet or DiT); the same module as ``unet``."""
        return self.unet

    @property
    def is_flow(self) -> bool:
        """A flow-matching DiT family (Z-Image), sampled by the flow sampler rather than DDIM."""
        return is_dit_family(self.family)

    @property
    def latent_channels(self) -> int:
        """The VAE's latent channels (``z_dim`` in the config of Qwen-Image's ``AutoencoderKLQwenImage``)."""
        config = self.vae.config
        return int(config.latent_channels if hasattr(config, "latent_channels") else config.z_dim)


class Placement(Protocol):
    """Where weights live while a stage runs (a VRAM policy's runtime side; see ``memory/placement.py``)."""

    name: str
    budget: VramBudget  # where the weights live and the hard limit, if any
    epoch: int  # bumped whenever the weights move to new device addresses (a captured graph must be recaptured)

    def enter(self, engine: "LeanEngine", stage: str, text_shape: Optional[tuple[int, int]] = None) -> None: ...

    def exit(self, engine: "LeanEngine", stage: str) -> None: ...


class Adapter(Protocol):
    """Something attached to the shared modules for the duration of a session (an unmerged LoRA, say).

    Optional: ``attach_stage(parts, stage)`` / ``detach_stage(parts, stage)`` are used instead of
    ``attach``/``detach`` when present, so an adapter can touch only the modules of the running stage; and a
    hashable ``graph_key`` naming the adapter's structure (not values such as a strength kept in device
    tensors), for callers that cache CUDA graphs per set of adapters.
    """

    def attach(self, parts: ModelParts) -> None: ...

    def detach(self, parts: ModelParts) -> None: ...


def _attach_adapter(adapter, parts: ModelParts, stage: str) -> None:
    """Stage-aware adapters (``attach_stage``) attach only what ``stage`` runs; others attach everything."""
    hook = getattr(adapter, "attach_stage", None)
    if hook is not None:
        hook(parts, stage)
    else:
        adapter.attach(parts)


def _detach_adapter(adapter, parts: ModelParts, stage: str) -> None:
    hook = getattr(adapter, "detach_stage", None)
    if hook is not None:
        hook(parts, stage)
    else:
        adapter.detach(parts)


class ResidentPlacement:
    """Every module on ``engine.device`` for the whole life of the engine (the ``full`` policy, and the CPU)."""

    name = "full"
    budget = UNBUDGETED
    epoch = 0

    def enter(self, engine: "LeanEngine", stage: str, text_shape: Optional[tuple[int, int]] = None) -> None:
        module_for_stage(engine.parts, stage, engine.device, engine.dtype_for(stage))

    def exit(self, engine: "LeanEngine", stage: str) -> None:
        return None


def modules_of_stage(parts: ModelParts, stage: str) -> list[torch.nn.Module]:
    if stage == "text":
        return [m for m in (parts.text_encoder, parts.text_encoder_2) if m is not None]
    if stage == "unet":
        return [parts.unet]
    if stage == "vae":
        return [parts.vae]
    raise ValueError(f"stage={stage!r}: expected one of {STAGES}")


def module_for_stage(parts: ModelParts, stage: str, device: torch.device, dtype: torch.dtype) -> None:
    """Move the stage's modules to ``device``/``dtype`` (no-op when already there)."""
    if device.type == "cuda" and device.index is None:  # "cuda" means the current device: compare like with like
        device = torch.device("cuda", torch.cuda.current_device())  # (else every session re-runs module.to)
    for module in modules_of_stage(parts, stage):
        # the first floating parameter: fp8 weight storage (memory/fp8_weights.py) is integer-typed, never cast
        p = next((q for q in module.parameters() if q.is_floating_point()), None)
        p = next(module.parameters()) if p is None else p
        if p.device != device or p.dtype != dtype:
            module.to(device=device, dtype=dtype)


@dataclass(frozen=True, eq=False)
class PromptEmbeds:
    """Text conditioning: ``context`` [B, 77*k, C] for cross-attention, ``pooled`` [B, P] for SDXL (else None)."""

    context: torch.Tensor
    pooled: Optional[torch.Tensor] = None


_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


def _add_budget_hint(exc: BaseException, placement: Any, stage: str) -> None:
    """Append the placement's advice (``out_of_memory_hint``: which budget capped the stage and what to change) to
    an out-of-memory error's message, once; the error keeps its type, so callers that retry on it still do."""
    hint = getattr(placement, "out_of_memory_hint", None)
    note = hint(stage) if callable(hint) else None
    if not note or note in str(exc):
        return
    first = exc.args[0] if exc.args else ""
    exc.args = (f"{first}\n{note}" if first else note,) + tuple(exc.args[1:])


@dataclass(frozen=True, eq=False)
class LeanEngine:
    """A loaded model and the policy it runs under. See the module docstring for the invariants."""

    parts: ModelParts
    device: torch.device
    dtype: torch.dtype = torch.float32
    vae_dtype: torch.dtype = torch.float32
    text_dtype: Optional[torch.dtype] = None
    placement: Any = field(default_factory=ResidentPlacement)
    adapters: tuple = ()
    pool: Any = None
    plan: str = ""
    extras: dict = field(default_factory=dict)

    # ----------------------------------------------------------------- views
    def with_changes(self, **changes) -> "LeanEngine":
        """A new view sharing all modules; ``changes`` replace fields (never mutate this engine)."""
        return dataclasses.replace(self, **changes)

    def with_adapter(self, adapter) -> "LeanEngine":
        return dataclasses.replace(self, adapters=self.adapters + (adapter,))

    @property
    def family(self) -> str:
        return self.parts.family

    def dtype_for(self, stage: str) -> torch.dtype:
        if stage == "vae":
            return self.vae_dtype
        if stage == "text":
            return self.text_dtype or self.dtype
        return self.dtype

    # ----------------------------------------------------------------- sessions
    @contextlib.contextmanager
    def session(self, stage: str, text_shape: Optional[tuple[int, int]] = None) -> Iterator["LeanEngine"]:
        """Run ``stage`` ("text", "unet", "vae"): place its weights per policy and attach this view's adapters.
        ``text_shape``: ``(prompts, tokens)`` of the text stage's one encoder call, when the caller knows it (a hard
        budget then sizes the stage's working memory from it, not from the plan's longest prompt)."""
        if stage not in STAGES:
            raise ValueError(f"stage={stage!r}: expected one of {STAGES}")
        self.placement.enter(self, stage, text_shape)
        attached = []
        fast = contextlib.ExitStack()  # the one-pass GEGLUs and norms: entered before the adapters, closed after them
        try:
            if stage == "unet":
                fast.enter_context(fused_geglus(self.parts.unet))
                fast.enter_context(fused_norms(self.parts.unet))
                fast.enter_context(layout_following_transformers(self.parts.unet))
            for adapter in self.adapters:
                _attach_adapter(adapter, self.parts, stage)
                attached.append(adapter)
            yield self
        except _OOM as exc:
            _add_budget_hint(exc, self.placement, stage)
            raise
        finally:
            for adapter in reversed(attached):
                _detach_adapter(adapter, self.parts, stage)
            fast.close()
            self.placement.exit(self, stage)

    # ----------------------------------------------------------------- model calls
    def stage_device(self, stage: str) -> torch.device:
        """Device where the stage's inputs must be (the text stage may run on the CPU under ``lowvram``)."""
        hook = getattr(self.placement, "stage_device", None)
        return hook(self, stage) if hook is not None else self.device

    def unet(self, latents: torch.Tensor, timestep, context: torch.Tensor,
             added_cond_kwargs: Optional[dict] = None) -> torch.Tensor:
        """The UNet's raw prediction (epsilon or v), contiguous; the UNet runs in ``unet_layout``'s layout. Call
        inside ``session("unet")``."""
        kwargs = {"added_cond_kwargs": added_cond_kwargs} if added_cond_kwargs else {}
        unet = self.parts.unet
        out = unet(unet_input(unet, latents), timestep, encoder_hidden_states=context, return_dict=False, **kwargs)[0]
        return out.contiguous()

    def time_ids(self, height: int, width: int, batch: int) -> torch.Tensor:
        """SDXL added time ids: original size, crop top-left (0, 0), target size, as diffusers' pipeline does
        (float32 at every weight dtype, ``TIME_IDS_DTYPE``)."""
        ids = torch.tensor([[height, width, 0, 0, height, width]], dtype=TIME_IDS_DTYPE, device=self.device)
        return ids.repeat(batch, 1)


def engine_from_parts(parts: ModelParts, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                      vae_dtype: torch.dtype = torch.float32, **kwargs) -> LeanEngine:
    """An engine over ``parts`` with every module resident on ``device`` (the plain, reference configuration)."""
    engine = LeanEngine(parts=parts, device=torch.device(device), dtype=dtype, vae_dtype=vae_dtype, **kwargs)
    for stage in STAGES:
        module_for_stage(parts, stage, engine.device, engine.dtype_for(stage))
    return engine


def parts_from_components(components: dict, name: str = "") -> ModelParts:
    """ModelParts from a dict with diffusers module names (as ``memory.tiny.build_tiny_components`` or
    ``memory.tiny_zimage.build_tiny_zimage`` return; a DiT's ``transformer`` becomes the ``unet`` slot)."""
    denoiser = components["unet"] if "unet" in components else components["transformer"]
    return ModelParts(
        family=components["family"], unet=denoiser, vae=components["vae"],
        text_encoder=components["text_encoder"], tokenizer=components["tokenizer"],
        scheduler_config=dict(components["scheduler_config"]),
        text_encoder_2=components.get("text_encoder_2"), tokenizer_2=components.get("tokenizer_2"), name=name,
        image_processor=components.get("image_processor"))

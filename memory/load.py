"""The loader's package entry: a model choice -> modules -> an engine under a VRAM policy.

Model choices (the node's ``model`` COMBO): ``tiny-random (test)`` (``memory/tiny.py``'s SD1.x-like model, built
once per process and copied per load), ``tiny-random Z-Image (test)`` (``memory/tiny_zimage.py``, likewise), a ``.safetensors`` name in ComfyUI's ``checkpoints`` folder, or a folder
name in its ``diffusers`` folder (outside ComfyUI: ``$LEANDIFFUSION_MODELS/<folder>``).

Invariant: each load builds its own modules (a placement owns where its modules live, so two engines with
different policies never share modules); on any error nothing stays on the GPU (``apply_vram_policy``'s
guarantee, and the modules of a failed load are dropped with it).
"""
from __future__ import annotations

import copy
import functools
import logging
from pathlib import Path
from typing import Callable, Optional

import torch

from .. import bridge
from .engine import LeanEngine, ModelParts, parts_from_components
from .folders import load_diffusers_folder
from .fp8_feedforward import fuse_feedforwards
from .fp8_weights import STORAGE_NAMES, compute_dtype_for, quantize_module, resolve_fast
from .ldm import load_ldm_checkpoint
from .policies import DTYPES, apply_vram_policy, check_policy_args
from .pool import BufferPool

logger = logging.getLogger(__name__)

TINY_CHOICE = "tiny-random (test)"
TINY_ZIMAGE_CHOICE = "tiny-random Z-Image (test)"
# fp8_e4m3fn*: the denoiser's Linear/Conv2d weights stored in fp8 (``memory/fp8_weights.py``), computing in
# bf16 on CUDA / fp32 on the CPU; text encoders and VAE keep that compute dtype
WEIGHT_DTYPES = ("auto", "fp16", "bf16", "fp32") + STORAGE_NAMES
VAE_DTYPES = ("auto", "fp32", "fp16", "bf16")


def model_choices() -> list[str]:
    """The node's ``model`` COMBO: the tiny model, checkpoints (``.safetensors``) and diffusers folders (any
    sub-folder of ``diffusers/`` holding a ``model_index.json``, at any depth, as ComfyUI's DiffusersLoader)."""
    return [TINY_CHOICE, TINY_ZIMAGE_CHOICE] + bridge.list_models("checkpoints", (".safetensors",)) + \
        bridge.list_models("diffusers", marker="model_index.json")


@functools.lru_cache(maxsize=1)
def _tiny_cached() -> dict:
    from .tiny import build_tiny_components

    return build_tiny_components("sd1", seed=0)


@functools.lru_cache(maxsize=1)
def _tiny_zimage_cached() -> dict:
    from .tiny_zimage import build_tiny_zimage

    return build_tiny_zimage(seed=0)


def _copied(cached: dict) -> dict:
    return {k: (copy.deepcopy(v) if isinstance(v, torch.nn.Module) else v) for k, v in cached.items()}


def load_components(choice: str) -> tuple[dict, str]:
    """Modules for ``choice`` (CPU, file dtype) and a display name."""
    if not isinstance(choice, str) or not choice:
        raise ValueError(f"model={choice!r}: expected a name from the node's model list")
    if choice == TINY_CHOICE:
        return _copied(_tiny_cached()), "tiny-sd1"
    if choice == TINY_ZIMAGE_CHOICE:
        return _copied(_tiny_zimage_cached()), "tiny-zimage"
    if choice.lower().endswith(".safetensors"):
        return load_ldm_checkpoint(bridge.resolve_model("checkpoints", choice, "model")), Path(choice).stem
    path = bridge.resolve_model("diffusers", choice, "model")
    return load_diffusers_folder(path), Path(choice).name


def resolve_dtype(name: str, arg: str, device: torch.device, vae: bool = False) -> Optional[torch.dtype]:
    """``auto`` -> None (the policy's default); an fp8 storage choice -> its compute dtype on ``device`` (bf16 on
    CUDA, fp32 elsewhere); else the torch dtype. CPU runs always use fp32 for ``auto``."""
    allowed = VAE_DTYPES if vae else WEIGHT_DTYPES
    if not isinstance(name, str) or name not in allowed:
        raise ValueError(f"{arg}={name!r}: expected one of {', '.join(allowed)}")
    if name in STORAGE_NAMES:
        return compute_dtype_for(device)
    return None if name == "auto" else DTYPES[name]


def build_engine(parts: ModelParts, vram_policy: str = "auto", vram_budget_gb: float = 4.0,
                 weight_dtype: str = "auto", vae_dtype: str = "auto", device=None, **policy_kwargs) -> LeanEngine:
    """An engine over ``parts`` under ``vram_policy`` (see ``memory/policies.py``), with a buffer pool.

    ``weight_dtype`` ``fp8_e4m3fn`` / ``fp8_e4m3fn_fast`` store the denoiser's weights in fp8, in place, before the
    plan is made (so it counts 1 byte per fp8 weight); ``engine.dtype`` is then the compute dtype and the plan text
    names the storage. With fp8 matmuls, tanh-GELU feed-forwards quantize their hidden activation in one pass
    (``memory/fp8_feedforward.py``)."""
    dev = torch.device(device) if device is not None else bridge.default_device()
    dtype = resolve_dtype(weight_dtype, "weight_dtype", dev)
    vae = resolve_dtype(vae_dtype, "vae_dtype", dev, vae=True)
    if weight_dtype in STORAGE_NAMES:
        check_policy_args(vram_policy, vram_budget_gb)  # a typo must not leave the modules converted
        on_gpu = dev.type == "cuda" and torch.cuda.is_available()
        fast = resolve_fast(weight_dtype == "fp8_e4m3fn_fast", dev)
        quantize_module(parts.unet, dtype, fast=fast, work_device=dev if on_gpu else None)
        if fast:
            fuse_feedforwards(parts.unet, dev)
    placement = apply_vram_policy(parts, vram_policy, device=dev, vram_budget_gb=vram_budget_gb, dtype=dtype,
                                  vae_dtype=vae, **policy_kwargs)
    cfg = placement.config
    pool = BufferPool(placement.device)
    placement.pool = pool
    plan_text = placement.report()
    logger.info("%s", plan_text)
    return LeanEngine(parts=parts, device=placement.device, dtype=cfg.dtype, vae_dtype=cfg.vae_dtype,
                      text_dtype=placement.text_dtype, placement=placement, pool=pool,
                      plan=plan_text)


def load_engine(model: str, vram_policy: str = "auto", vram_budget_gb: float = 4.0, weight_dtype: str = "auto",
                vae_dtype: str = "auto", device=None) -> LeanEngine:
    """The node's whole job: load ``model`` and place it under the policy; returns the engine (see
    :func:`load_engine_from`)."""
    return load_engine_from(lambda: load_components(model), vram_policy, vram_budget_gb, weight_dtype, vae_dtype,
                            device)


def load_engine_from(read: Callable[[], tuple[dict, str]], vram_policy: str = "auto", vram_budget_gb: float = 4.0,
                     weight_dtype: str = "auto", vae_dtype: str = "auto", device=None) -> LeanEngine:
    """An engine over the components ``read()`` returns (with a display name), placed under the policy.

    Progress counts three stages (read and convert the files, assemble the parts, place them under the policy);
    Cancel is honoured between them. Nothing outlives a cancelled or failed load: the engine only exists once the
    last stage returns. Inputs that need no model (policy, budget, dtypes) are checked before ``read`` runs."""
    dev = torch.device(device) if device is not None else bridge.default_device()
    check_policy_args(vram_policy, vram_budget_gb)  # every input that needs no model, before the file is read
    resolve_dtype(weight_dtype, "weight_dtype", dev)
    resolve_dtype(vae_dtype, "vae_dtype", dev, vae=True)
    with bridge.ProgressBar(3, desc="load model") as bar:
        bridge.check_interrupted()
        components, name = read()
        bar.update(1)
        bridge.check_interrupted()
        parts = parts_from_components(components, name=name)
        del components
        bar.update(1)
        bridge.check_interrupted()
        engine = build_engine(parts, vram_policy, vram_budget_gb, weight_dtype, vae_dtype, device=dev)
        bar.update(1)
    return engine

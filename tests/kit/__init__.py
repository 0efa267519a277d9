"""Test kit: tiny random models, engines over them, and savers for the layouts users have on disk.

Importable by every test as ``leandiffusion.tests.kit``. Models are cached per (family, seed) because building
them takes a moment; callers that change a module must ``copy.deepcopy`` it first.
"""
from __future__ import annotations

import copy
import functools
from pathlib import Path

import torch

from ...memory.engine import LeanEngine, ModelParts, engine_from_parts, parts_from_components
from ...memory.tiny import build_tiny_components, write_tiny_clip_tokenizer


@functools.lru_cache(maxsize=None)
def _cached_components(family: str, seed: int) -> dict:
    # no tokenizer_dir: the tokenizer files go to a scratch folder removed once loaded (a folder made at import
    # was left in the temporary folder by every test run and every bench smoke worker, which ends by os._exit)
    return build_tiny_components(family, seed)


def tiny_components(family: str = "sd1", seed: int = 0) -> dict:
    """Fresh copies of the tiny model's components, modules and configs alike (safe to modify)."""
    cached = _cached_components(family, seed)
    return {k: copy.deepcopy(v) for k, v in cached.items()}


def tiny_parts(family: str = "sd1", seed: int = 0) -> ModelParts:
    return parts_from_components(tiny_components(family, seed), name=f"tiny-{family}")


def tiny_engine(family: str = "sd1", seed: int = 0, device: str = "cpu", dtype=torch.float32) -> LeanEngine:
    """A fully resident engine over a fresh copy of the tiny model (the plain reference configuration)."""
    return engine_from_parts(tiny_parts(family, seed), device=device, dtype=dtype, vae_dtype=dtype)


def assert_unet_call_passes_sdxl_conditioning(engine: LeanEngine, call) -> None:
    """``call(x, t, context, added)`` (``LeanEngine.unet``'s contract) inside a UNet session equals the SDXL UNet
    called directly with the same ``added_cond_kwargs`` (a dropped ``added`` fails: the UNet needs it)."""
    cfg = engine.parts.unet.config
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, cfg.in_channels, 8, 8, generator=g)
    ctx = torch.randn(1, 77, cfg.cross_attention_dim, generator=g)
    pooled = cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim
    added = {"text_embeds": torch.randn(1, pooled, generator=g), "time_ids": engine.time_ids(64, 64, 1)}
    with engine.session("unet"), torch.no_grad():
        out = call(x, torch.tensor(500), ctx, added)
        ref = engine.parts.unet(x, torch.tensor(500), encoder_hidden_states=ctx, added_cond_kwargs=added,
                                return_dict=False)[0]
    assert torch.equal(out, ref)


def tiny_tokenizer_dir(folder: str | Path) -> Path:
    return write_tiny_clip_tokenizer(folder)


def save_diffusers_folder(components: dict, folder: str | Path) -> Path:
    """Save a tiny model as a diffusers pipeline folder (model_index.json + one sub-folder per component)."""
    import json

    from diffusers import DDIMScheduler

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    sdxl = "text_encoder_2" in components
    index = {"_class_name": "StableDiffusionXLPipeline" if sdxl else "StableDiffusionPipeline",
             "_diffusers_version": "0.30.0"}
    for key in ("unet", "vae", "text_encoder", "text_encoder_2"):
        if key in components and components[key] is not None:
            components[key].save_pretrained(folder / key, safe_serialization=True)
            lib = "diffusers" if key in ("unet", "vae") else "transformers"
            index[key] = [lib, type(components[key]).__name__]
    for key in ("tokenizer", "tokenizer_2"):
        if key in components and components[key] is not None:
            components[key].save_pretrained(folder / key)
            index[key] = ["transformers", "CLIPTokenizer"]
    DDIMScheduler(**components["scheduler_config"]).save_pretrained(folder / "scheduler")
    index["scheduler"] = ["diffusers", "DDIMScheduler"]
    (folder / "model_index.json").write_text(json.dumps(index, indent=2))
    return folder
from .ldm import save_ldm_checkpoint, ldm_state_dict  # noqa: E402,F401  (loader helper: LDM single-file writer)

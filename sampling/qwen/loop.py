"""The Qwen-Image text-to-image loop: prompts + seed -> LATENT, as ``QwenImagePipeline``.

Invariants (what makes the output equal ``QwenImagePipeline(prompt, negative_prompt, true_cfg_scale=cfg,
num_inference_steps=steps, width, height, num_images_per_prompt=batch, generator=torch.Generator("cpu")
.manual_seed(seed), output_type="latent")``, unpacked and converted to raw VAE space, ``latent * latents_std +
latents_mean`` per channel):
- Prompts: ``text.encode_prompts`` / ``text.prompt_batch`` (the pipeline's ``encode_prompt``), the batch's rows
  all of the one prompt (and of the negative when guided).
- Noise: one ``torch.Generator("cpu").manual_seed(seed)`` draw of the whole ``[B, 16, h, w]`` float32 shape, packed
  into 2x2 patches (``latents.pack``).
- Schedule: ``flow.schedule.flow_sigmas`` (``linspace(1, 1/steps, steps)`` through diffusers'
  ``FlowMatchEulerDiscreteScheduler`` with ``mu`` from the packed sequence length, the config's exponential shift
  and terminal stretch); the transformer's timestep is ``1000 sigma / 1000`` in the model dtype.
- Guidance (``cfg`` is ``true_cfg_scale``): ``cfg > 1`` runs the transformer on the prompt and on the negative
  (two calls, each as the pipeline makes it) and combines ``u + cfg (c - u)`` rescaled per token to the norm of
  ``c``; otherwise one call on the prompt. Euler: ``x + (sigma_next - sigma) v``; the state stays float32.
- Every model call runs inside ``engine.session(...)``; ``bridge.check_interrupted()`` runs before every step.
- img2img (``latent_image``, ``denoise`` < 1): ``start.qwen_start``, the Z-Image flow sampler's meaning of
  ``denoise``; CONDITIONING (``positive_cond`` / ``negative_cond``, Qwen2.5-VL hidden states) replaces its side's
  prompt string: ``conditioning.qwen_conditioning``.

Not yet: CUDA-graph acceleration (the loop is eager; ``acceleration`` is accepted and logged). Why hand-written
rather than calling the pipeline (the tests' reference): the VRAM policy's sessions and the pack's LATENT
conventions do not fit its ``__call__``.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from ... import bridge
from ...memory.engine import LeanEngine
from ..flow.schedule import TRAIN_TIMESTEPS
from ..flow.settings import FlowSettings
from .conditioning import qwen_conditioning
from .latents import pack, to_raw, unpack
from .start import qwen_start

logger = logging.getLogger(__name__)

FAMILY = "qwen_image"


def is_qwen_image(engine: Any) -> bool:
    """Whether ``engine`` is a LEAN_MODEL of the ``qwen_image`` family (this loop's, not the Z-Image sampler's)."""
    return isinstance(engine, LeanEngine) and engine.family == FAMILY


def check_qwen_inputs(engine: Any) -> LeanEngine:
    """The engine, or an error naming ``lean_model`` when it is not a Qwen-Image model."""
    if not is_qwen_image(engine):
        got = engine.family if isinstance(engine, LeanEngine) else type(engine).__name__
        raise ValueError(f"lean_model: expected a Qwen-Image model (family {FAMILY}), got {got}")
    return engine


def sample_qwen_image(engine: LeanEngine, settings: FlowSettings, latent_image: Optional[dict] = None,
                      positive_cond: Any = None, negative_cond: Any = None, quiet: bool = False) -> dict:
    """Run the loop; returns ``{"samples": raw latents [B, 16, h, w] float32 on the CPU}`` (module docstring)."""
    s = settings.validated()
    check_qwen_inputs(engine)
    if s.acceleration != "none":
        logger.info("Qwen-Image runs eager in this version; acceleration=%r is ignored", s.acceleration)
    start, sigmas, batch_index = qwen_start(engine, s, latent_image)
    h, w = start.shape[2], start.shape[3]
    bridge.check_interrupted()
    sides = 2 if s.guided else 1
    conds = qwen_conditioning(engine, [s.positive, s.negative][:sides], [positive_cond, negative_cond][:sides],
                              ["positive_cond", "negative_cond"][:sides], start.shape[0])
    with engine.session("unet"), torch.no_grad():
        x = _denoise(engine, conds, pack(start).to(engine.device), sigmas, (h, w), s, quiet)
    out = {"samples": to_raw(unpack(x.cpu(), h, w), engine.parts.vae)}
    if batch_index is not None:
        out["batch_index"] = batch_index
    return out


def _denoise(engine: LeanEngine, conds: list, x: torch.Tensor, sigmas: torch.Tensor, size: tuple[int, int],
             s: FlowSettings, quiet: bool) -> torch.Tensor:
    """The Euler steps over packed float32 latents ``x``; call inside ``engine.session("unet")``."""
    img_shapes = [[(1, size[0] // 2, size[1] // 2)]] * x.shape[0]
    timesteps = sigmas[:-1].to(torch.float32) * TRAIN_TIMESTEPS
    sigmas = sigmas.to(engine.device)
    with bridge.ProgressBar(timesteps.shape[0], desc="Qwen-Image", quiet=quiet) as bar:
        for i in range(timesteps.shape[0]):
            bridge.check_interrupted()
            model_input = x.to(engine.dtype)
            t = timesteps[i].expand(x.shape[0]).to(device=engine.device, dtype=engine.dtype) / TRAIN_TIMESTEPS
            preds = [_transformer(engine, model_input, t, embeds, mask, img_shapes) for embeds, mask in conds]
            x = x + (sigmas[i + 1] - sigmas[i]) * _guided(preds, s.cfg)
            bar.update(1)
    return x


def _transformer(engine: LeanEngine, x: torch.Tensor, t: torch.Tensor, embeds: torch.Tensor,
                 mask: Optional[torch.Tensor], img_shapes: list) -> torch.Tensor:
    return engine.parts.unet(hidden_states=x, timestep=t, guidance=None, encoder_hidden_states=embeds,
                             encoder_hidden_states_mask=mask, img_shapes=img_shapes, attention_kwargs={},
                             return_dict=False)[0]


def _guided(preds: list, cfg: float) -> torch.Tensor:
    """The prompt's prediction, or with a negative's: ``u + cfg (c - u)`` rescaled per token to ``|c|``."""
    if len(preds) == 1:
        return preds[0]
    cond, uncond = preds
    combined = uncond + cfg * (cond - uncond)
    return combined * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))

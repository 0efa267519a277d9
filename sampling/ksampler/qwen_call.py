"""The Fused KSampler's denoiser for Qwen-Image: ComfyUI's QwenImage model (``model_base.QwenImage`` under
ModelSamplingFlux + CONST) on the engine's diffusers transformer.

Math: the latent ``[B, 16, h, w]`` (model space) goes in unscaled, packed into 2x2 patches (``qwen.latents.pack``);
the transformer's timestep is sigma itself in the model dtype (its time projection scales by 1000, as ComfyUI's
does); it predicts the velocity ``noise - x0``, so ``D = x - out sigma`` (the denoiser's ``velocity`` prediction),
each side turned into ``D`` before ComfyUI's plain ``u + cfg (c - u)`` (no norm rescale: that is the diffusers
pipeline's ``true_cfg_scale``, not KSampler's cfg). Conditioning: ``qwen.conditioning.qwen_conditioning`` (the
prompt strings encoded as ``QwenImagePipeline`` does, or CONDITIONING of Qwen2.5-VL hidden states), positive then
negative, one transformer call each, as the pipeline makes them (each side with its own length and mask).

Invariant: eager, like the Fused Flow Sampler's Qwen-Image loop (``acceleration`` is accepted and logged); the
program reads only its buffers and the sides bound at preparation, so a later captured variant can keep the shape.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from ...memory.engine import LeanEngine
from ..loop import step_allocator
from ..qwen.conditioning import Side, conditioning_rows, qwen_conditioning
from ..qwen.latents import PATCH, pack, unpack
from .denoiser import Denoiser, DenoiserProgram
from .settings import KSamplerSettings

logger = logging.getLogger(__name__)

Prediction = tuple[torch.Tensor, Optional[torch.Tensor]]


def transformer_fn(engine: LeanEngine) -> Callable:
    """``fn(tokens, t, embeds, mask, img_shapes) -> velocity tokens``: the engine's Qwen-Image transformer."""
    dit = engine.parts.unet

    def fn(tokens, t, embeds, mask, img_shapes):
        return dit(hidden_states=tokens, timestep=t, guidance=None, encoder_hidden_states=embeds,
                   encoder_hidden_states_mask=mask, img_shapes=img_shapes, attention_kwargs={}, return_dict=False)[0]

    return fn


class QwenModelCall:
    """The transformer on each side's conditioning at sigma; returns ``(cond, uncond or None)`` velocities
    ``[B, 16, h, w]`` in float32."""

    def __init__(self, sides: list[Side], model_dtype: torch.dtype):
        self.fn: Optional[Callable] = None  # bound per run (a cached program must not keep its engine alive)
        self.sides = sides
        self.dtype = model_dtype

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor) -> Prediction:
        b, _, h, w = x.shape
        tokens = pack(x).to(self.dtype)
        t = sigma.reshape(-1)[:1].expand(b).to(self.dtype)
        img_shapes = [[(1, h // PATCH, w // PATCH)]] * b
        preds = [unpack(self.fn(tokens, t, embeds, mask, img_shapes).float(), h, w) for embeds, mask in self.sides]
        return preds[0], (preds[1] if len(preds) > 1 else None)


def check_qwen_inputs(engine: LeanEngine, s: KSamplerSettings, batch: int, positive: Any, negative: Any) -> None:
    """Refuse a CONDITIONING the run would refuse, by input name, before any stage opens."""
    sides = 2 if s.guided else 1
    conditioning_rows(engine, [positive, negative][:sides], ["positive", "negative"][:sides], batch)


def prepare_qwen_denoiser(engine: LeanEngine, s: KSamplerSettings, x: torch.Tensor, sigmas: torch.Tensor,
                          positive: Any, negative: Any) -> tuple[Denoiser, Callable[[], None]]:
    """``(denoiser, release)`` for a Qwen-Image run; call inside ``engine.session("unet")`` under ``no_grad``."""
    if s.acceleration != "none":
        logger.info("Qwen-Image runs eager in the Fused KSampler in this version; acceleration=%r is ignored",
                    s.acceleration)
    sides = 2 if s.guided else 1
    conds = qwen_conditioning(engine, [s.positive_prompt, s.negative_prompt][:sides], [positive, negative][:sides],
                              ["positive", "negative"][:sides], x.shape[0])
    model = QwenModelCall(conds, engine.dtype)
    model.fn = transformer_fn(engine)
    program = DenoiserProgram(model, tuple(x.shape), "velocity", None, step_allocator(engine))
    program.cfg.copy_(torch.tensor(float(s.cfg), dtype=torch.float32))
    program.set_call(x, sigmas[0])

    def release() -> None:
        model.fn = None

    return Denoiser(program, program.step), release

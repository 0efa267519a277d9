"""The Stream Scheduler's stages for a flow-matching family (Z-Image): Qwen3 captions and the Fused Flow Sampler's
steps, in the pipeline ``scheduler.py`` runs for every family.

Invariants
- Image n equals the Fused Flow Sampler's run for its prompt with seed ``seed + n`` and batch size 1
  (``StreamSettings.flow_settings``): its noise is the scheduler's per-image CPU draw (``[1, 16, h, w]`` from
  ``torch.Generator().manual_seed(seed + n)``), which is also the model-space start at sigma 1; the steps are
  ``flow.loop.denoise_flow_batch`` over the sampler's ``flow_sigmas`` and ``ImageGrid``; the captions are what
  ``flow.captions.flow_captions`` gives that run, one ``[L, C]`` row per image (its positive, then, when
  ``cfg > 1``, its negative). Rows of different lengths share a batch through the static caption layout
  (``flow.dit_forward``), which gives each row its one-prompt result.
- Prompt strings go through ``flow.text.encode_prompts`` (the Qwen3 chat template, no weight syntax); the prompts
  still missing for a batch and the negative are encoded in one call (one ``text`` session, which matters when the
  4B encoder streams), each prompt once per run. The encoder is causal and the padding rows are dropped, so a
  prompt's rows do not depend on its neighbours beyond floating-point rounding.
- CONDITIONING inputs (Qwen3 hidden states, ``flow.captions``' rules per row, the attention mask honoured) map to
  prompts as for the UNet families (``stream.conditioning.checked_rows``); anything else, an SD CONDITIONING
  included, is refused naming the input before any model runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ...memory.engine import LeanEngine
from ..flow.captions import conditioning_captions
from ..flow.dit_forward import ImageGrid
from ..flow.loop import denoise_flow_batch
from ..flow.schedule import flow_sigmas
from ..flow.text import check_prompt, encode_prompts
from ..graph_runner import GraphRunner
from .conditioning import checked_rows
from .settings import StreamSettings
from .text import TextStage


@dataclass(frozen=True, eq=False)
class FlowConditioningInputs:
    """The connected CONDITIONING inputs of a flow run as caption rows on the engine's device (``None`` = text)."""

    positive: Optional[list] = None  # [L_p, C] per prompt
    negative: Optional[list] = None  # 1 row (shared) or one per prompt

    def positive_row(self, prompt_index: int) -> torch.Tensor:
        return self.positive[prompt_index]

    def negative_row(self, prompt_index: int) -> torch.Tensor:
        return self.negative[0 if len(self.negative) == 1 else prompt_index]


def read_flow_conditioning(engine: LeanEngine, positive_cond: Any, negative_cond: Any, n_prompts: int, *,
                           width: int, height: int, guided: bool) -> FlowConditioningInputs:
    """``stream.conditioning.read_conditioning_inputs`` for a flow family (module docstring); ``width`` and
    ``height`` are unused (Z-Image has no size conditioning)."""
    rows, negative_rows = checked_rows(positive_cond, negative_cond, n_prompts, guided)

    def side(value: Any, name: str) -> list:
        return [r.to(engine.device, engine.dtype) for r in conditioning_captions(engine, value, name)]

    return FlowConditioningInputs(side(positive_cond, "positive_cond") if rows else None,
                                  side(negative_cond, "negative_cond") if negative_rows else None)


class FlowTextStage(TextStage):
    """``TextStage`` (its batching, negatives, release and stream hand-over) with Qwen3 captions."""

    def _encode(self, texts: list[str]) -> list[torch.Tensor]:
        self.encoded_texts += len(texts)
        return encode_prompts(self.engine, texts)

    def _batch(self, rows: list[torch.Tensor], negs: list[torch.Tensor]) -> list[torch.Tensor]:
        return rows + negs


def flow_denoiser(engine: LeanEngine, s: StreamSettings, latent_shape: tuple,
                  runner: Optional[GraphRunner]) -> Callable:
    """``denoise(captions, x_init, on_step) -> final model-space latents`` for every batch of the run; refuses a
    prompt that is not valid text before any model runs."""
    for i, prompt in enumerate(s.prompts):
        check_prompt(f"prompts (prompt {i + 1})", prompt)
    check_prompt("negative", s.negative)
    h, w = latent_shape[1:]
    sigmas = flow_sigmas(engine.parts.scheduler_config, s.steps, h, w)
    grid = ImageGrid.of(h, w, int(engine.parts.unet.config.all_patch_size[0]))
    settings = s.flow_settings("", s.seed).validated()

    def denoise(captions: list, x_init: torch.Tensor, on_step: Callable[[int], None]) -> torch.Tensor:
        return denoise_flow_batch(engine, captions, x_init, sigmas, grid, settings, on_step, runner)

    return denoise

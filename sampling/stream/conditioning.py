"""The Stream Scheduler Sampler's CONDITIONING inputs: one prompt per batch row of ``positive_cond``.

ComfyUI's CONDITIONING reaches the stream as it reaches the Fused DDIM Sampler: a single ``[cond, extras]`` pair,
parsed and validated by ``sampling.conditioning`` (``single_pair`` / ``from_conditioning``: several entries, areas,
masks, ControlNet, hooks, wrong widths and a missing SDXL ``pooled_output`` are refused there, naming the input).
What this module adds is the mapping from rows to prompts:

- ``positive_cond`` with B rows ``[B, L, C]`` is B prompts, row i = prompt i (CLIPTextEncode gives 1 row, so 1
  prompt; a batched CONDITIONING gives B). It replaces the ``prompts`` lines, which are then ignored.
- ``negative_cond`` with 1 row is shared by every prompt; with P rows (P = the number of prompts, from
  ``positive_cond`` or from the ``prompts`` lines) row i goes with prompt i; any other count is a ``ValueError``.
- Each row keeps what ``from_conditioning`` reads for its pair: the context row, SDXL's ``pooled_output`` row and
  the size conditioning (``width``/``height``/crops/targets, defaulting to the image size) as time ids.
- When cfg is 1 the negative side is never used, so ``negative_cond`` is not read (the Fused DDIM Sampler does the
  same).

Invariant: row i of a side, as returned by :meth:`ConditioningInputs.positive_row` / ``negative_row``, equals
(bit for bit) what ``from_conditioning`` gives for a 1-row CONDITIONING holding row i of the pair (and its pooled
row) with batch 1 -- so image n is the Fused DDIM Sampler's image for that 1-row CONDITIONING and seed ``seed + n``.
Rows are converted to the engine's device and dtype once, before the pipeline starts; validation errors are raised
there, before any model runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ...memory.engine import LeanEngine
from ..conditioning import SamplerConditioning, from_conditioning, single_pair


def conditioning_rows(conditioning: Any, input_name: str) -> int:
    """How many batch rows (prompts) a CONDITIONING holds; refuses what the samplers refuse, and empty batches."""
    cond, _ = single_pair(conditioning, input_name)
    rows = int(cond.shape[0])
    if rows < 1:
        raise ValueError(f"{input_name}: the CONDITIONING has 0 rows (shape {tuple(cond.shape)}); connect a "
                         f"text-encode node's output")
    return rows


def row(side: SamplerConditioning, i: int) -> SamplerConditioning:
    """Row ``i`` of a batched side as a batch-1 :class:`SamplerConditioning` (views, no copy)."""
    return SamplerConditioning(side.context[i:i + 1], None if side.pooled is None else side.pooled[i:i + 1],
                               None if side.time_ids is None else side.time_ids[i:i + 1])


@dataclass(frozen=True, eq=False)
class ConditioningInputs:
    """The connected CONDITIONING inputs of one run, on the engine's device (``None`` = that side uses its text)."""

    positive: Optional[SamplerConditioning] = None  # [P, L, C]: row i is prompt i
    negative: Optional[SamplerConditioning] = None  # [1 or P, L', C]: shared, or row i with prompt i

    def positive_row(self, prompt_index: int) -> SamplerConditioning:
        return row(self.positive, prompt_index)

    def negative_row(self, prompt_index: int) -> SamplerConditioning:
        shared = self.negative.context.shape[0] == 1
        return row(self.negative, 0 if shared else prompt_index)


def checked_rows(positive_cond: Any, negative_cond: Any, n_prompts: int, guided: bool) -> tuple[int, int]:
    """The row counts of the connected sides (0 = not connected, or the negative when not ``guided``), refused when
    they do not map onto the ``n_prompts`` prompts (module docstring)."""
    positive = negative = 0
    if positive_cond is not None:
        positive = conditioning_rows(positive_cond, "positive_cond")
        if positive != n_prompts:
            raise ValueError(f"positive_cond has {positive} rows but the run has {n_prompts} prompts (run_stream sets "
                             f"StreamSettings.positive_rows from positive_cond; pass the same CONDITIONING)")
    if negative_cond is not None and guided:
        negative = conditioning_rows(negative_cond, "negative_cond")
        if negative not in (1, n_prompts):
            source = "positive_cond's rows" if positive_cond is not None else "the prompts lines"
            raise ValueError(
                f"negative_cond has {negative} rows but there are {n_prompts} prompts (from {source}); give it 1 row "
                f"(one negative shared by every prompt) or {n_prompts} rows (row i is the negative of prompt i), "
                f"e.g. one CLIPTextEncode")
    return positive, negative


def read_conditioning_inputs(engine: LeanEngine, positive_cond: Any, negative_cond: Any, n_prompts: int, *,
                             width: int, height: int, guided: bool) -> ConditioningInputs:
    """Validate and convert the stream's CONDITIONING inputs (module docstring); ``n_prompts`` is the run's prompt
    count (``positive_cond``'s rows when it is connected). ``negative_cond`` is ignored when not ``guided``."""
    rows, negative_rows = checked_rows(positive_cond, negative_cond, n_prompts, guided)
    positive = negative = None
    if rows:
        positive = from_conditioning(positive_cond, engine, rows, width=width, height=height,
                                     input_name="positive_cond")
    if negative_rows:
        negative = from_conditioning(negative_cond, engine, negative_rows, width=width, height=height,
                                     input_name="negative_cond")
    return ConditioningInputs(positive, negative)

"""The Stream Scheduler Sampler's settings and the order of its images.

Invariants
- ``StreamSettings.validated()`` checks every input once, at the public entry point; the inputs the two sampler
  nodes share are ``SamplerSettingsBase``'s, checked by its rules, so a value one node accepts the other accepts
  too.
- Prompts: one per non-empty line of the ``prompts`` text, surrounding whitespace stripped -- or, when
  ``positive_rows`` > 0 (set by ``run_stream`` from a connected ``positive_cond``), that CONDITIONING's rows, one
  prompt per row (``stream.conditioning``); ``prompts`` is then ignored and may be empty.
- Image order is prompt-major: image ``n`` is copy ``i`` of prompt ``p`` with ``n = p * images_per_prompt + i``,
  and it is sampled with seed ``seed + n`` -- exactly the Fused DDIM Sampler's run for that prompt with that
  seed and ``batch_size`` 1 (eta 0, batched CFG, denoise 1), or for a flow-matching family (``flow``, set by
  ``run_stream`` from the engine) the Fused Flow Sampler's (``flow_settings``). ``seed + n`` must stay within the
  seed range.
- Guidance follows the family's sampler: DDIM guides unless ``cfg == 1``; flow guides only for ``cfg > 1`` (ComfyUI's
  meaning for Z-Image: ``cfg <= 1`` is one pass without the negative), and its sides must be multiples of 16.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

from ...vae.tiled import MIN_TILE, validate_tiling
from ..flow.settings import FlowSettings, check_side
from ..settings import MAX_SEED, MAX_SIDE_PX, SamplerSettings, SamplerSettingsBase, check_int

MAX_IMAGES_PER_PROMPT = 64
MAX_BATCH = 64


def split_prompts(text) -> tuple[str, ...]:
    """``prompts`` text -> the prompts, one per non-empty line (stripped)."""
    if not isinstance(text, str):
        raise TypeError(f"prompts: expected text with one prompt per line, got {type(text).__name__}")
    return tuple(line.strip() for line in text.splitlines() if line.strip())


@dataclass(frozen=True)
class ImageJob:
    """Image ``index`` of the run: copy ``copy`` of prompt ``prompt_index``, sampled with ``seed``."""

    index: int
    prompt_index: int
    copy: int
    seed: int


@dataclass(frozen=True)
class StreamSettings(SamplerSettingsBase):
    """What one run of the Stream Scheduler Sampler does (the node's inputs, minus the model)."""

    prompts: tuple
    images_per_prompt: int = 1
    max_batch: int = 0  # 0 = auto
    decode_tile_size: int = 0  # 0 = auto (untiled when it fits)
    positive_rows: int = 0  # > 0: the prompts are positive_cond's rows (run_stream sets it); 0: the prompts lines
    flow: bool = False  # the engine is a flow-matching family (run_stream sets it from engine.parts.is_flow)

    @classmethod
    def from_text(cls, prompts: str, **kwargs) -> "StreamSettings":
        return cls(prompts=split_prompts(prompts), **kwargs)

    @property
    def n_prompts(self) -> int:
        return self.positive_rows or len(self.prompts)

    @property
    def n_images(self) -> int:
        return self.n_prompts * self.images_per_prompt

    @property
    def guided(self) -> bool:
        """Whether the negative pass runs: as the family's sampler decides it (module docstring)."""
        return self.cfg > 1.0 if self.flow else self.cfg != 1.0

    def sampler_settings(self, prompt: str, seed: int) -> SamplerSettings:
        """The Fused DDIM Sampler run that image (``prompt``, ``seed``) must equal: the shared inputs as they are,
        one image, eta 0, batched CFG, denoise 1."""
        shared = {f.name: getattr(self, f.name) for f in fields(SamplerSettingsBase)}
        return SamplerSettings(**{**shared, "seed": seed}, positive=prompt, eta=0.0, batch_size=1,
                               cfg_mode="batched", denoise=1.0)

    def flow_settings(self, prompt: str, seed: int) -> FlowSettings:
        """The Fused Flow Sampler run that image (``prompt``, ``seed``) of a flow family must equal: the shared
        inputs as they are, one image, denoise 1."""
        return FlowSettings(positive=prompt, negative=self.negative, seed=seed, steps=self.steps, cfg=self.cfg,
                            width=self.width, height=self.height, batch_size=1, acceleration=self.acceleration)

    def validated(self) -> "StreamSettings":
        if not isinstance(self.prompts, tuple) or not all(isinstance(p, str) for p in self.prompts):
            raise TypeError("prompts: expected a tuple of prompt strings (use StreamSettings.from_text for the "
                            "node's one-prompt-per-line text)")
        check_int("positive_rows", self.positive_rows, 0, MAX_SEED,
                  "0 = prompts from the text, else the number of rows of positive_cond")
        if not self.positive_rows and (not self.prompts or not all(p.strip() for p in self.prompts)):
            raise ValueError("prompts: no prompt given (the text is empty or only blank lines); write one prompt "
                             "per line, or connect positive_cond")
        check_int("images_per_prompt", self.images_per_prompt, 1, MAX_IMAGES_PER_PROMPT, "images sampled per prompt")
        check_int("max_batch", self.max_batch, 0, MAX_BATCH, "0 = automatic from free VRAM, else images per UNet batch")
        if isinstance(self.decode_tile_size, bool) or not isinstance(self.decode_tile_size, int):
            raise TypeError(f"decode_tile_size={self.decode_tile_size!r}: expected an int (0 = auto, else pixels)")
        if self.decode_tile_size and self.decode_tile_size < MIN_TILE:  # named as the node's input, not 'tile_size'
            raise ValueError(f"decode_tile_size={self.decode_tile_size} is below the minimum {MIN_TILE} px; use 0 "
                             f"(auto) or >= {MIN_TILE}")
        validate_tiling(self.decode_tile_size, 0, "exact")
        if self.flow:  # before the shared multiple-of-8 check, so the sizes its message proposes fit
            for name in ("width", "height"):
                check_side(name, check_int(name, getattr(self, name), 64, MAX_SIDE_PX))
        cfg = self._validated_shared()
        last = self.seed + self.n_images - 1
        if last > MAX_SEED:
            raise ValueError(f"seed={self.seed}: image n uses seed + n and this run has {self.n_images} images, so "
                             f"the last seed {last} exceeds {MAX_SEED}; use a seed <= {MAX_SEED - self.n_images + 1}")
        return replace(self, cfg=cfg)

    def jobs(self) -> list[ImageJob]:
        k = self.images_per_prompt
        return [ImageJob(n, n // k, n % k, self.seed + n) for n in range(self.n_images)]

"""Qwen-Image prompt encoding: the last hidden state of Qwen2.5-VL's language model over the templated prompt.

Invariant: ``encode_prompts`` returns, per prompt, exactly the ``[L, C]`` rows ``QwenImagePipeline.encode_prompt``
feeds its transformer: the prompt put into the pipeline's system + user template (``PROMPT_TEMPLATE``), tokenized
with at most ``TEMPLATE_TOKENS + MAX_TOKENS`` tokens, the encoder's last hidden state, then the first
``TEMPLATE_TOKENS`` rows (the system turn) dropped and at most ``max_sequence_length`` rows kept. Each prompt runs
through the encoder on its own, unpadded, as the pipeline's ``encode_prompt`` and ComfyUI's text encode run it: a
padded batch changes the float rounding, which the multistep samplers amplify at Qwen-Image's small last sigmas.
``prompt_batch`` lays rows out as the pipeline does: each prompt's rows ``copies`` times in a row, zero-padded to the
longest, with a 0/1 mask, and no mask at all when every slot is real (the transformer then attends unmasked).

The language model runs alone (``memory/folders.py`` keeps no vision tower or LM head): for text, Qwen2.5-VL's
multimodal positions are ``0 .. n-1`` on all three axes for a right-padded row's real tokens, the language model's
own default, and causal attention keeps padding from reaching them, so the rows kept are the full model's.

Encoding runs inside ``engine.session("text")`` on the stage's device and dtype (the VRAM policy decides where),
told its largest forward pass, ``(1, tokens)``.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ...memory.engine import LeanEngine
from ..flow.text import check_prompt

PROMPT_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
                   "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n"
                   "{prompt}<|im_end|>\n<|im_start|>assistant\n")
TEMPLATE_TOKENS = 34  # the system turn and "<|im_start|>user\n" in Qwen2.5's vocabulary
MAX_TOKENS = 1024  # the pipeline's tokenizer_max_length (after the template)
MAX_SEQUENCE_LENGTH = 512  # the pipeline's default max_sequence_length: rows kept per prompt


@torch.no_grad()
def encode_prompts(engine: LeanEngine, prompts: Sequence[str],
                   max_sequence_length: int = MAX_SEQUENCE_LENGTH) -> list[torch.Tensor]:
    """One ``[L_i, C]`` tensor per prompt (engine device, engine dtype); see the module docstring."""
    texts = [PROMPT_TEMPLATE.format(prompt=check_prompt(f"prompt {i}", p)) for i, p in enumerate(prompts)]
    batches = [engine.parts.tokenizer([t], max_length=TEMPLATE_TOKENS + MAX_TOKENS, truncation=True,
                                      return_tensors="pt") for t in texts]
    with engine.session("text", (1, max(int(b.input_ids.shape[1]) for b in batches))):
        device = engine.stage_device("text")
        rows = []
        for batch in batches:
            hidden = engine.parts.text_encoder(input_ids=batch.input_ids.to(device),
                                               attention_mask=batch.attention_mask.to(device),
                                               use_cache=False).last_hidden_state
            rows.append(hidden[0][TEMPLATE_TOKENS:][:max_sequence_length].to(engine.device, engine.dtype))
        return rows


def prompt_batch(rows: Sequence[torch.Tensor], copies: int = 1) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(embeds [P * copies, L, C], mask [P * copies, L] int64 or None)`` from one ``[L_i, C]`` row per prompt
    (module docstring). The pipeline tiles its mask prompt-major for several prompts with ``copies`` > 1 while it
    repeats the embeddings row by row; here both repeat row by row, so each row keeps its own mask."""
    longest = max(int(r.shape[0]) for r in rows)
    embeds = torch.stack([torch.cat([r, r.new_zeros(longest - r.shape[0], r.shape[1])]) for r in rows])
    mask = torch.stack([torch.arange(longest, device=r.device) < r.shape[0] for r in rows]).long()
    embeds, mask = embeds.repeat_interleave(copies, dim=0), mask.repeat_interleave(copies, dim=0)
    return embeds, (None if bool(mask.all()) else mask)

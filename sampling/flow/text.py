"""Z-Image prompt encoding: a Qwen3 text encoder's second-to-last hidden state over the chat-formatted prompt.

Invariant: ``encode_prompts`` returns, per prompt, exactly the ``[L, C]`` caption features ``ZImagePipeline``
feeds its transformer: the prompt wrapped as one user turn of Qwen's chat format with the assistant turn opened
(what ``apply_chat_template(..., add_generation_prompt=True, enable_thinking=True)`` renders), tokenized with at
most ``MAX_TOKENS`` tokens, ``hidden_states[-2]`` of the encoder, the padding rows dropped. The template is
rendered here rather than through the tokenizer's own template, so a tokenizer without one (ComfyUI's Qwen
tokenizer files) encodes the same ids. Prompts are padded to the longest of the call, not to ``MAX_TOKENS``: the
encoder is causal, so right padding never changes the rows kept.

Encoding runs inside ``engine.session("text")`` on the stage's device and dtype (the VRAM policy decides where),
told the call's ``(prompts, tokens)``: under a hard VRAM budget the stage then keeps a sampler's cached CUDA graphs
when this call's working memory fits beside them (a recapture costs two eager steps). Should the call still run
out of memory under the budget, the graphs are released and it runs once more (``memory/budget.py``).
"""
from __future__ import annotations

from typing import Sequence

import torch

from ...memory.budget import release_device_caches
from ...memory.engine import LeanEngine

MAX_TOKENS = 512
CHAT_TEMPLATE = "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


def chat_text(prompt: str) -> str:
    return CHAT_TEMPLATE.format(prompt=prompt)


def check_prompt(name: str, value) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected a string, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{name} contains a character that is not valid text ({exc.reason} at position "
                         f"{exc.start}); retype or paste the prompt again") from exc
    return value


@torch.no_grad()
def encode_prompts(engine: LeanEngine, prompts: Sequence[str]) -> list[torch.Tensor]:
    """One ``[L_i, C]`` tensor per prompt (engine device, engine dtype); see the module docstring."""
    tokenizer = engine.parts.tokenizer
    texts = [chat_text(p) for p in prompts]
    batch = tokenizer(texts, padding="longest", max_length=MAX_TOKENS, truncation=True, return_tensors="pt")
    shape = (len(texts), int(batch.input_ids.shape[1]))
    try:
        return _encode(engine, batch, shape)
    except torch.cuda.OutOfMemoryError:
        if not engine.placement.budget.hard:
            raise
    # retried outside the handler, whose traceback would keep the failed attempt's tensors alive
    release_device_caches(engine.parts)
    return _encode(engine, batch, None)


def _encode(engine: LeanEngine, batch, text_shape) -> list[torch.Tensor]:
    with engine.session("text", text_shape):
        device = engine.stage_device("text")
        ids = batch.input_ids.to(device)
        mask = batch.attention_mask.to(device).bool()
        hidden = engine.parts.text_encoder(input_ids=ids, attention_mask=mask,
                                           output_hidden_states=True).hidden_states[-2]
        return [hidden[i][mask[i]].to(engine.device, engine.dtype) for i in range(hidden.shape[0])]

"""Qwen-Image prompt encoding (``sampling/qwen/text.py``) equals ``QwenImagePipeline.encode_prompt`` (embeddings
and mask) on the tiny model, CPU fp32, with the text stage resident (``full``) and on the CPU (``lowvram``): one
prompt repeated (no mask), prompts of different lengths (a mask), the empty prompt, and a prompt longer than
``max_sequence_length``; it runs inside one ``text`` session."""
import pytest
import torch

from leandiffusion.sampling.qwen.text import encode_prompts, prompt_batch

TOL = 1e-5
CASES = [(["a red cat"], 2), (["a red cat", "a lighthouse on a cliff at dusk, waves"], 1), ([""], 1),
         (["a long walk " * 60], 1)]


@pytest.mark.parametrize("prompts,copies", CASES)
def test_equals_the_pipelines_encode_prompt(qwen_pipe, qwen_engine, prompts, copies, opened_sessions):
    ref, ref_mask = qwen_pipe.encode_prompt(prompts, device="cpu", num_images_per_prompt=copies,
                                            max_sequence_length=512)
    embeds, mask = prompt_batch(encode_prompts(qwen_engine, prompts), copies)
    assert opened_sessions == ["text"]
    assert embeds.shape == ref.shape and embeds.dtype == ref.dtype == torch.float32
    assert (embeds - ref).abs().max().item() <= TOL
    assert ref.abs().max().item() > 0.1  # real features, not zeros any output would match
    if ref_mask is None:
        assert mask is None
    else:
        assert mask is not None and torch.equal(mask, ref_mask)


def test_a_long_prompt_keeps_max_sequence_length_rows(qwen_engine):
    rows = encode_prompts(qwen_engine, ["a long walk " * 60, "a cat"])
    prompt_tokens = len(qwen_engine.parts.tokenizer("a cat").input_ids)
    assert rows[0].shape[0] == 512 and rows[1].shape[0] == prompt_tokens + 5  # + "<|im_end|>\n<|im_start|>assistant\n"


def test_several_prompts_repeated_keep_each_rows_mask(qwen_pipe, qwen_engine):
    """For several prompts with copies > 1 the pipeline repeats embeddings row by row; each copy keeps its own
    prompt's mask here (the pipeline's own mask repeat is prompt-major there, so the reference mask is its
    one-copy mask, each row repeated)."""
    prompts = ["a red cat", "a lighthouse on a cliff at dusk"]
    ref, _ = qwen_pipe.encode_prompt(prompts, device="cpu", num_images_per_prompt=2)
    _, one_mask = qwen_pipe.encode_prompt(prompts, device="cpu", num_images_per_prompt=1)
    embeds, mask = prompt_batch(encode_prompts(qwen_engine, prompts), 2)
    assert (embeds - ref).abs().max().item() <= TOL
    assert torch.equal(mask, one_mask.repeat_interleave(2, dim=0))


def test_a_prompt_that_is_not_text_names_the_input(qwen_engine, opened_sessions):
    with pytest.raises(TypeError, match="prompt 1: expected a string, got int"):
        encode_prompts(qwen_engine, ["a cat", 3])
    assert opened_sessions == []

"""A LoRA view and the process-wide prompt cache (``sampling.prompt_encoder.PROMPT_CACHE``).

Guards two bugs of a LoRA view whose adapter declared no ``cache_key`` / ``affects_text``, so the prompt cache
keyed on the adapter object itself:
- a leak: every cached prompt kept its LoRA adapter alive, hence the binding, the LoRA factors (on the GPU) and the
  model's targeted modules with their weights, after the LoRA node was removed from the workflow and even after the
  model itself was dropped (switching checkpoints left the old model's attention/feed-forward weights in VRAM);
- a needless re-encode: re-running the LoRA node (any strength change makes a new view) missed the cache, also when
  only the UNet strength changed or the LoRA has no text-encoder layer at all.
The reference for "same embeddings" is an uncached encode through the same view (``cache=None``).
"""
import gc
import weakref

import pytest
import torch

from leandiffusion.lora import inject_lora
from leandiffusion.sampling.prompt_encoder import PromptCache, encode_texts
from leandiffusion.tests.kit import tiny_engine
from leandiffusion.tests.lora import lorafiles as lf

TEXTS = ["a cat", "(a dog:1.3)"]


def _files(engine, tmp_path):
    roots = {"unet": engine.parts.unet, "text_encoder": engine.parts.text_encoder}
    both = lf.write(lf.kohya_state_dict(roots, {"unet": lf.ATTN_FF, "text_encoder": lf.TE_LINEARS}, seed=1),
                    tmp_path / "both.safetensors")
    unet_only = lf.write(lf.kohya_state_dict(roots, {"unet": lf.ATTN_FF}, seed=2), tmp_path / "unet.safetensors")
    return both, unet_only


@pytest.mark.parametrize("mode", ["unmerged", "merged"])
def test_cached_prompts_do_not_keep_the_lora_or_the_model_alive(tmp_path, mode):
    engine = tiny_engine("sd1")
    both, _ = _files(engine, tmp_path)
    cache = PromptCache()
    view = inject_lora(engine, both, 0.7, 0.5, mode=mode)
    encode_texts(view, TEXTS, cache=cache)
    assert len(cache) == 2
    binding = weakref.ref(view.adapters[0].binding)
    targeted = weakref.ref(view.adapters[0].binding.targets[0].module)
    del view
    gc.collect()
    assert binding() is None, "the prompt cache keeps the removed LoRA's binding (and its factors) alive"
    del engine
    gc.collect()
    assert targeted() is None, "the prompt cache keeps the dropped model's LoRA-targeted modules alive"


def test_cache_hits_follow_what_the_text_encoders_compute(tmp_path):
    engine = tiny_engine("sd1")
    both, unet_only = _files(engine, tmp_path)
    cache = PromptCache()

    def encode(view):
        misses = cache.misses
        out = encode_texts(view, TEXTS, cache=cache)
        plain = encode_texts(view, TEXTS, cache=None)
        for a, b in zip(out, plain):
            assert torch.equal(a.context, b.context)
        return cache.misses - misses, out

    base_misses, base = encode(engine)
    assert base_misses == 2
    first_misses, first = encode(inject_lora(engine, both, 0.7, 0.5))
    assert first_misses == 2 and not torch.equal(first[0].context, base[0].context)
    # the LoRA node run again with another UNet strength: same text encoders, no re-encode
    assert encode(inject_lora(engine, both, -1.3, 0.5))[0] == 0
    # another text strength: encoded again (and equal to an uncached encode, checked in ``encode``)
    other_misses, other = encode(inject_lora(engine, both, 0.7, 0.9))
    assert other_misses == 2 and not torch.equal(other[0].context, first[0].context)
    # a LoRA without text-encoder layers leaves the base model's entries valid
    assert encode(inject_lora(engine, unet_only, 0.8, 1.0))[0] == 0
    # the same file stacked twice is another text function than once
    assert encode(inject_lora(inject_lora(engine, both, 0.7, 0.5), both, 0.7, 0.5))[0] == 2


def test_outside_conditioning_with_a_text_lora_is_named_in_the_log(tmp_path, caplog):
    """A CONDITIONING from ComfyUI's CLIPTextEncode was not encoded with the LoRA's text-encoder part; the sampler
    cannot apply it, and says so instead of dropping it silently. No warning when the text part is off or absent."""
    import logging

    from leandiffusion.sampling.conditioning import from_conditioning, to_conditioning

    engine = tiny_engine("sd1")
    both, unet_only = _files(engine, tmp_path)
    cond = to_conditioning(encode_texts(engine, ["a cat"], cache=None)[0])
    cases = [(inject_lora(engine, both, 0.7, 0.5), True), (inject_lora(engine, both, 0.7, 0.0), False),
             (inject_lora(engine, unet_only, 0.7, 0.5), False), (engine, False)]
    for view, warned in cases:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="leandiffusion.sampling.conditioning"):
            from_conditioning(cond, view, 1, input_name="positive_cond")
        hits = [r.getMessage() for r in caplog.records if "text-encoder part" in r.getMessage()]
        assert bool(hits) == warned, (view.adapters, hits)
        if warned:
            assert "positive_cond" in hits[0] and "text_encoder=0.5" in hits[0]

"""Stream Scheduler Sampler: image n equals the Fused DDIM Sampler's image for its prompt, for weighted, extended-
syntax and over-77-token prompts of different chunk counts.

Reference: the Fused DDIM Sampler (``loop.sample``, which encodes through ``prompts.encode_for_sampler``) run for
that one prompt with seed ``seed + n`` and batch size 1. The stream batches prompts of 1, 2 and 3 chunks (77, 154,
231 tokens) with a 1-chunk negative: each batch's rows are repeated along the sequence axis to the lcm of their
lengths, which is exact for attention but not bit-identical, hence the batched bound (relative, as in
``test_stream_scheduler``); with ``max_batch`` 1 the context is the fused sampler's own lcm(prompt, negative), so
the result must be bit-identical. Guards: the stream reading prompts with a different encoder (plain tokenization
ignores weights, truncates at 77 tokens or reads ``[x]``/``BREAK`` literally: O(1) differences on the tiny model),
a row repeated to the wrong length, and a prompt encoded twice in a run or again across runs (the prompt cache).
"""
import pytest

from leandiffusion.sampling.loop import sample
from leandiffusion.sampling.prompt_encoder import PROMPT_CACHE, PromptCache, encode_texts
from leandiffusion.sampling.settings import SamplerSettings
from leandiffusion.sampling.stream.scheduler import run_stream
from leandiffusion.sampling.stream.settings import StreamSettings
from leandiffusion.tests.kit import tiny_engine

LONG = ", ".join(f"word{i}" for i in range(15))  # ~95 tokens with the tiny tokenizer: 2 chunks
LONGER = "(glossy ceramic vase:0.8), " + ", ".join(f"item{i}" for i in range(25))  # 3 chunks
PROMPTS = ("(red cube:1.3), studio light", LONG, "((studio light)), [blur] BREAK a cat", LONGER)
NEGATIVE = "(blurry:1.2), lowres"
BATCHED_REL = 1e-5


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("sd1")


def _settings(**kw):
    base = dict(prompts=PROMPTS, negative=NEGATIVE, seed=3, steps=2, cfg=6.0, width=64, height=64,
                acceleration="none")
    base.update(kw)
    return StreamSettings(**base)


def _fused(engine, prompt, seed, negative=NEGATIVE, cfg=6.0):
    s = SamplerSettings(positive=prompt, negative=negative, seed=seed, steps=2, cfg=cfg, width=64, height=64,
                        batch_size=1, acceleration="none")
    return sample(engine, s, quiet=True)["samples"]


def _compare(engine, settings, result, rel):
    s = settings.validated()
    for n in range(len(s.prompts) * s.images_per_prompt):
        job = s.jobs()[n]
        assert job.prompt_index == n // s.images_per_prompt  # prompt-major, written out independently
        ref = _fused(engine, s.prompts[n // s.images_per_prompt], s.seed + n, s.negative, s.cfg)
        err = (result.latents[n:n + 1] - ref).abs().max().item()
        bound = 0.0 if rel is None else rel * max(1.0, ref.abs().max().item())
        assert err <= bound, f"image {n} ({s.prompts[job.prompt_index][:30]!r}): max abs diff {err:.3g} > {bound:.3g}"


def test_prompts_really_have_different_chunk_counts(engine):
    """Guards the test itself: the prompts must span 1-3 chunks and the weighted ones must differ from plain text."""
    embeds = encode_texts(engine, list(PROMPTS) + ["red cube, studio light"], cache=PromptCache())
    assert [e.context.shape[1] for e in embeds] == [77, 154, 77, 231, 77]
    assert (embeds[0].context - embeds[4].context).abs().max().item() > 1e-3


def test_max_batch_1_is_bit_identical_to_the_fused_sampler(engine):
    s = _settings(max_batch=1)
    result = run_stream(engine, s, quiet=True)
    assert result.batch_sizes == (1, 1, 1, 1)
    _compare(engine, s, result, rel=None)


@pytest.mark.parametrize("max_batch,ipp,sizes", [(3, 1, (3, 1)), (4, 2, (4, 4))])
def test_batched_rows_of_different_lengths_equal_the_fused_sampler(engine, max_batch, ipp, sizes):
    s = _settings(max_batch=max_batch, images_per_prompt=ipp)
    result = run_stream(engine, s, quiet=True)
    assert result.batch_sizes == sizes
    _compare(engine, s, result, rel=BATCHED_REL)


def test_unguided_long_prompts(engine):
    s = _settings(cfg=1.0, max_batch=2, prompts=PROMPTS[:2])
    _compare(engine, s, run_stream(engine, s, quiet=True), rel=BATCHED_REL)


def test_sdxl_long_and_weighted_prompts():
    eng = tiny_engine("sdxl")
    s = _settings(prompts=PROMPTS[:2], max_batch=2)
    _compare(eng, s, run_stream(eng, s, quiet=True), rel=BATCHED_REL)


def test_comfyui_syntax_is_passed_through(engine):
    s = _settings(prompts=(PROMPTS[2],), max_batch=1, prompt_syntax="comfyui")
    got = run_stream(engine, s, quiet=True).latents
    ref = sample(engine, SamplerSettings(positive=PROMPTS[2], negative=NEGATIVE, seed=3, steps=2, cfg=6.0, width=64,
                                         height=64, acceleration="none", prompt_syntax="comfyui"), quiet=True)
    extended = _fused(engine, PROMPTS[2], 3)
    assert (got - ref["samples"]).abs().max().item() == 0.0
    assert (got - extended).abs().max().item() > 1e-3  # the syntaxes really differ on this prompt


def test_prompts_go_through_the_shared_prompt_cache(engine):
    """The stream encodes through the samplers' cache: a rerun, and the fused sampler on the same prompt, encode
    nothing (the old per-run encoder bypassed the cache, so the fused run below missed)."""
    prompts = ("(cache probe stream:1.2), " + LONG, "cache probe two")
    s = _settings(prompts=prompts, max_batch=2)
    run_stream(engine, s, quiet=True)
    misses = PROMPT_CACHE.misses
    run_stream(engine, s, quiet=True)
    _fused(engine, prompts[0], 11)
    assert PROMPT_CACHE.misses == misses


def test_each_text_is_encoded_once_and_only_prompts_still_needed_are_held(engine, monkeypatch):
    """4 prompts x 2 images in batches of 3: images [0, 3) are prompts 0-1, [3, 6) prompts 1-2, [6, 8) prompt 3.
    Each batch's conditioning is prepared once, one batch ahead (batch k + 1 while batch k waits to be denoised);
    each text, the negative included, goes to the encoder once per run; after batch k is denoised only the prompts
    of later images are kept. So the held prompts when each batch is prepared are 0-1, 0-2 and 1-3."""
    from leandiffusion.sampling.stream import text as stream_text

    real_prepare, real_encode = stream_text.TextStage.prepare, stream_text.TextStage._encode
    prepared, held, encoded = [], [], []

    def prepare(self, start, stop):
        out = real_prepare(self, start, stop)
        prepared.append((start, stop))
        held.append(sorted(self._embeds))
        return out

    def encode(self, texts):
        encoded.extend(texts)
        return real_encode(self, texts)

    monkeypatch.setattr(stream_text.TextStage, "prepare", prepare)
    monkeypatch.setattr(stream_text.TextStage, "_encode", encode)
    prompts = ("held zero", "held one", "held two", "held three")
    run_stream(engine, _settings(prompts=prompts, images_per_prompt=2, max_batch=3), quiet=True)
    assert prepared == [(0, 3), (3, 6), (6, 8)]
    assert held == [[0, 1], [0, 1, 2], [1, 2, 3]]
    assert sorted(encoded) == sorted(prompts + (NEGATIVE,))


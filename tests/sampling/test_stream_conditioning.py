"""Stream Scheduler Sampler with CONDITIONING inputs: each batch row of ``positive_cond`` is one prompt.

Promise: image n (prompt-major) equals the Fused DDIM Sampler's image for that prompt's conditioning row given as a
1-row CONDITIONING, with seed ``seed + n`` and batch size 1 -- bit-identical with ``max_batch`` 1, within the batched
UNet's rounding otherwise (fp32 CPU, tiny models; bound relative to the reference's magnitude as in
``test_stream_scheduler``: <= 1e-5 * max|ref|). ``negative_cond`` has 1 row (shared) or one row per prompt (row i with
prompt i); other counts are refused.
Reference: ``loop.sample`` (the Fused DDIM Sampler) fed ``positive_cond``/``negative_cond`` through the same
``conditioning.from_conditioning`` the node uses, itself checked against diffusers in ``test_sampler_prompts``.
CONDITIONING values are built as CLIPTextEncode builds them: the pack's own encoder output wrapped by
``conditioning.to_conditioning`` (float32 CPU, ``pooled_output``), batched rows stacked along dim 0.
Guards: rows mapped to the wrong prompt or seed, a 1-row negative read per prompt (or a B-row one shared), the
``prompts`` text still counted when a CONDITIONING replaces it, SDXL pooled rows or size keys dropped or given to
the wrong side, and bad inputs refused only after a model ran.
"""
import dataclasses

import pytest
import torch

from leandiffusion.nodes.stream import LeanStreamSampler
from leandiffusion.sampling.conditioning import to_conditioning
from leandiffusion.sampling.loop import sample
from leandiffusion.sampling.prompt_encoder import PromptCache, encode_texts
from leandiffusion.sampling.settings import SamplerSettings
from leandiffusion.sampling.stream.scheduler import run_stream
from leandiffusion.sampling.stream.settings import StreamSettings
from leandiffusion.tests.kit import tiny_engine

PROMPTS = ("a red boat", "a lighthouse at dusk", "snowy forest")
NEGATIVES = ("blurry", "lowres, text", "oversaturated")
BATCHED_REL = 1e-5
SEED, STEPS, CFG = 5, 2, 6.0
SDXL_SIZES = {"width": 1024, "height": 768, "crop_w": 16, "crop_h": 8, "target_width": 512, "target_height": 640}


def _cond(engine, texts, extras=None):
    """A CONDITIONING of len(texts) rows: each text encoded by the pack (as CLIPTextEncode would), rows stacked."""
    embeds = encode_texts(engine, list(texts), syntax="extended", cache=PromptCache())
    pairs = [to_conditioning(e, extras)[0] for e in embeds]
    info = dict(pairs[0][1])
    if info["pooled_output"] is not None:
        info["pooled_output"] = torch.cat([p[1]["pooled_output"] for p in pairs])
    return [[torch.cat([p[0] for p in pairs]), info]]


def _row(conditioning, i):
    """Row ``i`` of a CONDITIONING as its own 1-row CONDITIONING (what one CLIPTextEncode would give)."""
    cond, info = conditioning[0]
    info = dict(info)
    if info.get("pooled_output") is not None:
        info["pooled_output"] = info["pooled_output"][i:i + 1]
    return [[cond[i:i + 1], info]]


def _settings(prompts="", **kw):
    base = dict(negative="blurry", seed=SEED, steps=STEPS, cfg=CFG, width=64, height=64, acceleration="none")
    base.update(kw)
    return StreamSettings.from_text(prompts, **base)


def _fused(engine, seed, positive="", negative="blurry", positive_cond=None, negative_cond=None, cfg=CFG,
           width=64, height=64, acceleration="none"):
    s = SamplerSettings(positive=positive, negative=negative, seed=seed, steps=STEPS, cfg=cfg, width=width,
                        height=height, batch_size=1, acceleration=acceleration)
    return sample(engine, s, positive_cond=positive_cond, negative_cond=negative_cond, quiet=True)["samples"]


def _compare(got, refs, rel):
    """Per image: bit-identical (``rel`` None) or max abs diff <= rel * max(1, max|ref|)."""
    assert got.shape[0] == len(refs)
    for n, ref in enumerate(refs):
        err = (got[n:n + 1] - ref).abs().max().item()
        bound = 0.0 if rel is None else rel * max(1.0, ref.abs().max().item())
        assert err <= bound, f"image {n}: max abs diff {err:.3g} > {bound:.3g}"


def _refs(engine, s, positive_cond=None, negative_cond=None, negative_row=lambda p: p, **kw):
    """The Fused DDIM Sampler's image for every job: prompt p's row of positive_cond (or line p), negative row."""
    refs = []
    s = dataclasses.replace(s, positive_rows=0 if positive_cond is None else positive_cond[0][0].shape[0])
    s = s.validated()
    for n in range(s.n_prompts * s.images_per_prompt):
        p = n // s.images_per_prompt  # prompt-major with seed + n, written out (not read from ``s.jobs()``)
        refs.append(_fused(engine, s.seed + n, positive="" if positive_cond is not None else s.prompts[p],
                           negative=s.negative,
                           positive_cond=None if positive_cond is None else _row(positive_cond, p),
                           negative_cond=None if negative_cond is None else _row(negative_cond, negative_row(p)),
                           cfg=s.cfg, width=s.width, height=s.height, **kw))
    return refs


# --------------------------------------------------------------------------------------------- SD1
def test_rows_are_prompts_and_match_the_fused_sampler_exactly(sd1):
    """3 rows x 2 images, max_batch 1: image n is the fused run of its row with seed + n, bit for bit; and a
    CONDITIONING holding the pack's encoding of the lines gives exactly the lines' images."""
    pos = _cond(sd1, PROMPTS)
    s = _settings(images_per_prompt=2, max_batch=1)
    got = run_stream(sd1, s, positive_cond=pos, quiet=True)
    assert got.latents.shape[0] == 6 and got.batch_sizes == (1,) * 6
    _compare(got.latents, _refs(sd1, s, pos), rel=None)
    lines = run_stream(sd1, _settings("\n".join(PROMPTS), images_per_prompt=2, max_batch=1), quiet=True)
    assert torch.equal(got.latents, lines.latents) and torch.equal(got.images, lines.images)


def test_batched_rows_match_within_the_batched_bound(sd1):
    pos = _cond(sd1, PROMPTS)
    s = _settings(images_per_prompt=2, max_batch=4)
    got = run_stream(sd1, s, positive_cond=pos, quiet=True)
    assert got.batch_sizes == (4, 2)  # a batch size that does not divide the image count
    _compare(got.latents, _refs(sd1, s, pos), rel=BATCHED_REL)


def test_one_clip_text_encode_is_one_prompt(sd1):
    pos = _cond(sd1, PROMPTS[1:2])
    s = _settings(images_per_prompt=3, max_batch=2)
    got = run_stream(sd1, s, positive_cond=pos, quiet=True)
    assert got.latents.shape[0] == 3
    _compare(got.latents, _refs(sd1, s, pos), rel=BATCHED_REL)


def test_negative_one_row_is_shared_and_b_rows_go_with_their_prompt(sd1):
    pos = _cond(sd1, PROMPTS)
    shared, per_prompt = _cond(sd1, NEGATIVES[:1]), _cond(sd1, NEGATIVES)
    s = _settings(max_batch=2)
    one = run_stream(sd1, s, positive_cond=pos, negative_cond=shared, quiet=True)
    _compare(one.latents, _refs(sd1, s, pos, shared, negative_row=lambda p: 0), rel=BATCHED_REL)
    many = run_stream(sd1, s, positive_cond=pos, negative_cond=per_prompt, quiet=True)
    _compare(many.latents, _refs(sd1, s, pos, per_prompt), rel=BATCHED_REL)
    # prompt 0's negative is the same row in both runs; prompts 1 and 2 get a different one (O(1) change)
    assert (one.latents[0] - many.latents[0]).abs().max().item() <= BATCHED_REL * one.latents[0].abs().max().item()
    assert (one.latents[1:] - many.latents[1:]).abs().max().item() > 1e-2


def test_only_negative_cond_keeps_the_prompt_lines(sd1):
    neg = _cond(sd1, NEGATIVES[:2])
    s = _settings("a red boat\nsnowy forest", negative="ignored: negative_cond is connected", max_batch=2)
    got = run_stream(sd1, s, negative_cond=neg, quiet=True)
    _compare(got.latents, _refs(sd1, s, None, neg), rel=BATCHED_REL)


def test_only_positive_cond_uses_the_negative_text(sd1):
    pos = _cond(sd1, PROMPTS[:2])
    s = _settings(negative="(lowres:1.2), text", max_batch=2)
    got = run_stream(sd1, s, positive_cond=pos, quiet=True)
    _compare(got.latents, _refs(sd1, s, pos), rel=BATCHED_REL)


def test_prompts_text_is_ignored_when_positive_cond_is_connected(sd1):
    """Empty prompts are allowed; lines present change nothing (not even the image count)."""
    pos = _cond(sd1, PROMPTS[:2])
    empty = run_stream(sd1, _settings("", max_batch=2), positive_cond=pos, quiet=True)
    lines = run_stream(sd1, _settings("one\ntwo\nthree\nfour", max_batch=2), positive_cond=pos, quiet=True)
    assert empty.latents.shape[0] == 2
    assert torch.equal(empty.latents, lines.latents)


def test_unguided_run_ignores_negative_cond(sd1):
    """cfg 1 never reads the negative side (as the Fused DDIM Sampler), so even a bad row count is not an error."""
    pos = _cond(sd1, PROMPTS)
    s = _settings(cfg=1.0, max_batch=3)
    got = run_stream(sd1, s, positive_cond=pos, negative_cond=_cond(sd1, NEGATIVES[:2]), quiet=True)
    _compare(got.latents, _refs(sd1, s, pos), rel=BATCHED_REL)


class _CountingUNet(torch.nn.Module):
    def __init__(self, unet):
        super().__init__()
        self.inner, self.config, self.calls = unet, unet.config, 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)


@pytest.mark.parametrize("inputs,exc,match", [
    (dict(positive_cond="positive", negative_cond="neg"), ValueError,
     r"negative_cond has 2 rows but there are 3 prompts \(from positive_cond's rows\); give it 1 row"),
    (dict(negative_cond="neg"), ValueError, r"negative_cond has 2 rows but there are 4 prompts \(from the prompts"),
    (dict(positive_cond="two pairs"), ValueError, "positive_cond: got a CONDITIONING with 2 entries"),
    (dict(negative_cond="two pairs"), ValueError, "negative_cond: got a CONDITIONING with 2 entries"),
    (dict(positive_cond="empty"), ValueError, "positive_cond: the CONDITIONING has 0 rows"),
    (dict(positive_cond="text"), TypeError, "positive_cond: expected a CONDITIONING"),
    (dict(positive_cond="area"), ValueError, "positive_cond: the CONDITIONING carries 'area'"),
])
def test_bad_conditioning_is_refused_before_any_model_runs(sd1, inputs, exc, match):
    pos, neg = _cond(sd1, PROMPTS), _cond(sd1, NEGATIVES[:2])
    values = {"positive": pos, "neg": neg, "two pairs": pos + neg, "empty": [[pos[0][0][:0], pos[0][1]]],
              "text": "a red boat", "area": [[pos[0][0], {**pos[0][1], "area": (8, 8, 0, 0)}]]}
    unet = _CountingUNet(sd1.parts.unet)
    eng = sd1.with_changes(parts=dataclasses.replace(sd1.parts, unet=unet))
    with pytest.raises(exc, match=match):
        run_stream(eng, _settings("a\nb\nc\nd"), quiet=True, **{k: values[v] for k, v in inputs.items()})
    assert unet.calls == 0


# --------------------------------------------------------------------------------------------- SDXL
def test_sdxl_rows_carry_pooled_and_size_keys_per_side(sdxl):
    """Positive rows with CLIPTextEncodeSDXL-style size keys, a 1-row negative with its own: every image equals
    the fused run of its row (pooled row, size keys as time ids, the negative's own time ids)."""
    pos = _cond(sdxl, PROMPTS[:2], SDXL_SIZES)
    neg = _cond(sdxl, NEGATIVES[:1], {"width": 256, "height": 320})
    exact = _settings(width=64, height=80, max_batch=1)
    got = run_stream(sdxl, exact, positive_cond=pos, negative_cond=neg, quiet=True)
    refs = _refs(sdxl, exact, pos, neg, negative_row=lambda p: 0)
    _compare(got.latents, refs, rel=None)
    batched = _settings(width=64, height=80, images_per_prompt=2, max_batch=3)
    got = run_stream(sdxl, batched, positive_cond=pos, negative_cond=neg, quiet=True)
    _compare(got.latents, _refs(sdxl, batched, pos, neg, negative_row=lambda p: 0), rel=BATCHED_REL)
    # the size keys matter: without them (image-size defaults) image 0 changes by O(1), so the check above can fail
    plain = _fused(sdxl, SEED, positive_cond=_row(_cond(sdxl, PROMPTS[:1]), 0),
                   negative_cond=_cond(sdxl, NEGATIVES[:1]), width=64, height=80)
    assert (plain - refs[0]).abs().max().item() > 1e-2


def test_sdxl_per_prompt_negative_rows_and_text_negative(sdxl):
    pos, neg = _cond(sdxl, PROMPTS[:2]), _cond(sdxl, NEGATIVES[:2])
    s = _settings(width=64, height=64, max_batch=2)
    got = run_stream(sdxl, s, positive_cond=pos, negative_cond=neg, quiet=True)
    _compare(got.latents, _refs(sdxl, s, pos, neg), rel=BATCHED_REL)
    got = run_stream(sdxl, s, positive_cond=pos, quiet=True)  # negative from the text
    _compare(got.latents, _refs(sdxl, s, pos), rel=BATCHED_REL)


# --------------------------------------------------------------------------------------------- node
def test_node_passes_the_conditioning_through(sd1):
    pos, neg = _cond(sd1, PROMPTS[:2]), _cond(sd1, NEGATIVES[:1])
    image, latent = LeanStreamSampler().run(sd1, "", "ignored", SEED, STEPS, CFG, 64, 64, "leading", "none", 1, 2, 0,
                                            positive_cond=pos, negative_cond=neg)
    want = run_stream(sd1, _settings(max_batch=2), positive_cond=pos, negative_cond=neg, quiet=True)
    assert torch.equal(latent["samples"], want.latents) and torch.equal(image, want.images)
    spec = LeanStreamSampler.INPUT_TYPES()
    assert {k: v[0] for k, v in spec["optional"].items()} == {"positive_cond": "CONDITIONING",
                                                              "negative_cond": "CONDITIONING"}
    assert "positive_cond" in spec["required"]["prompts"][1]["tooltip"]


# --------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_conditioning_rows_through_real_streams():
    """On CUDA the rows are converted on the text stream and read there, then handed to the UNet by event: a missing
    ordering shows up as rows differing from the fused run. Batch of one: the fused sampler's own cached graph,
    bit-identical; batched: fp16 rounding of a batched UNet call (5e-3 relative, as test_stream_gpu)."""
    eng = tiny_engine("sd1", device="cuda", dtype=torch.float16)
    pos, neg = _cond(eng, PROMPTS), _cond(eng, NEGATIVES)
    exact = _settings(width=128, height=128, acceleration="cuda_graph", max_batch=1)
    got = run_stream(eng, exact, positive_cond=pos, negative_cond=neg, quiet=True)
    refs = _refs(eng, exact, pos, neg, acceleration="cuda_graph")
    _compare(got.latents, refs, rel=None)
    batched = _settings(width=128, height=128, acceleration="cuda_graph", max_batch=2, images_per_prompt=2)
    got = run_stream(eng, batched, positive_cond=pos, negative_cond=neg, quiet=True)
    refs = _refs(eng, batched, pos, neg, acceleration="cuda_graph")
    for n, ref in enumerate(refs):
        rel = ((got.latents[n:n + 1] - ref).abs().max() / ref.abs().max()).item()
        assert rel <= 5e-3, f"image {n}: relative diff {rel:.3g}"

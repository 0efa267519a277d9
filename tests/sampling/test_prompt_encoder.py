"""Prompt encoding equals ComfyUI's CLIPTextEncode rules (plain reference in _prompt_reference) and, for plain
prompts, diffusers' own ``encode_prompt``; embeddings, errors and the cache behave as documented."""
import dataclasses

import pytest
import torch
from safetensors.torch import save_file

from leandiffusion.sampling import prompt_encoder
from leandiffusion.sampling.prompt_encoder import PromptCache, encode_texts
from leandiffusion.tests.kit import tiny_components, tiny_engine
from leandiffusion.tests.sampling._prompt_reference import ref_encode

TOL = 1e-5
LONG = ", ".join(f"word{i} (thing{i}:1.2)" for i in range(12))  # ~200 tiny tokens: 3 chunks, weights across chunks
PROMPTS = [
    "a red cube on a table",
    "(red cube:1.3), ((studio light)), (((x))), plain",
    "((nested (deeper:0.7) text)) end",
    "escaped \\(not weighted\\) and (weighted \\(inner\\):0.8)",
    "(cat:abc) malformed weight falls back to 1.1",
    "[blur] a BREAK b",  # ComfyUI: literal brackets and the literal word BREAK
    "",
    LONG,
    "x" * 70 + " (" + "y" * 30 + ":1.4)",  # a large weighted piece split across the chunk boundary
    "a " * 40 + "(tiny:1.2)",  # a short piece that moves whole to the next chunk
    # the packing rule's two edges (tiny tokenizers: "a" one token, "b".."i" one token each):
    "a " * 71 + "(b c d e:1.2)",  # start + 71 + 4 = 76 items: the piece fills the first chunk exactly
    "a " * 70 + "(b c d e f g h i:1.2)",  # an 8-token piece (the smallest that splits) across the boundary
]


@pytest.fixture(scope="module", params=["sd1", "sdxl"])
def family(request):
    return request.param


@pytest.fixture(scope="module")
def comps(family):
    return tiny_components(family)


@pytest.fixture(scope="module")
def engine(family):
    return tiny_engine(family)


def _encode(engine, text, **kw):
    return encode_texts(engine, [text], cache=None, **kw)[0]


@pytest.mark.parametrize("text", PROMPTS)
def test_matches_comfyui_reference(engine, comps, text):
    got = _encode(engine, text)
    cond, pooled = ref_encode(comps, text)
    assert got.context.shape == cond.shape
    assert (got.context - cond).abs().max().item() <= TOL
    if pooled is None:
        assert got.pooled is None
    else:
        assert (got.pooled - pooled).abs().max().item() <= TOL


def test_long_prompt_has_several_chunks(engine):
    assert _encode(engine, LONG).context.shape[1] == 3 * 77


def test_sd2_matches_reference():
    text = "(red cube:1.3), ((light)) " + "z" * 90
    got = _encode(tiny_engine("sd2"), text)
    cond, _ = ref_encode(tiny_components("sd2"), text)
    assert got.context.shape == cond.shape == (1, 154, 128)
    assert (got.context - cond).abs().max().item() <= TOL


@pytest.mark.parametrize("text,negative", [("a photo of a red cube", ""), ("studio light, 4k", "blurry, ugly")])
def test_plain_prompt_equals_diffusers_encode_prompt(family, comps, engine, text, negative):
    """The sampler's acceptance test compares with diffusers' pipelines: plain prompts must encode identically."""
    from diffusers import DDIMScheduler, StableDiffusionPipeline, StableDiffusionXLPipeline

    sched = DDIMScheduler(**comps["scheduler_config"])
    cond, uncond = encode_texts(engine, [text, negative], cache=None)
    if family == "sdxl":
        pipe = StableDiffusionXLPipeline(vae=comps["vae"], text_encoder=comps["text_encoder"],
                                         text_encoder_2=comps["text_encoder_2"], tokenizer=comps["tokenizer"],
                                         tokenizer_2=comps["tokenizer_2"], unet=comps["unet"], scheduler=sched)
        pe, ne, pp, npool = pipe.encode_prompt(text, device="cpu", num_images_per_prompt=1,
                                               do_classifier_free_guidance=True, negative_prompt=negative)
        assert (cond.pooled - pp).abs().max().item() <= 1e-6
        assert (uncond.pooled - npool).abs().max().item() <= 1e-6
    else:
        pipe = StableDiffusionPipeline(vae=comps["vae"], text_encoder=comps["text_encoder"],
                                       tokenizer=comps["tokenizer"], unet=comps["unet"], scheduler=sched,
                                       safety_checker=None, feature_extractor=None, requires_safety_checker=False)
        pe, ne = pipe.encode_prompt(text, "cpu", 1, True, negative_prompt=negative)
    assert (cond.context - pe).abs().max().item() <= 1e-6
    assert (uncond.context - ne).abs().max().item() <= 1e-6


def test_extended_break_and_brackets(engine):
    """Extended syntax: BREAK = chunks encoded separately and concatenated; [x] = (x:1/1.1)."""
    parts = ["a red cube", "(studio light:1.2), dark", "blue"]
    got = _encode(engine, " BREAK ".join(parts), syntax="extended")
    ref = torch.cat([_encode(engine, p).context for p in parts], dim=1)
    assert got.context.shape == ref.shape
    assert (got.context - ref).abs().max().item() <= TOL
    trailing = _encode(engine, "a red cube BREAK", syntax="extended")
    assert (trailing.context - _encode(engine, "a red cube").context).abs().max().item() <= TOL
    br = _encode(engine, "[blur] [[x]] y", syntax="extended")
    explicit = _encode(engine, f"(blur:{1 / 1.1!r}) (x:{(1 / 1.1) * (1 / 1.1)!r}) y")
    assert (br.context - explicit.context).abs().max().item() <= TOL


# ------------------------------------------------------------------------------------------ embeddings
@pytest.fixture
def models_dir(tmp_path, monkeypatch):
    (tmp_path / "embeddings" / "sub").mkdir(parents=True)
    monkeypatch.setenv("LEANDIFFUSION_MODELS", str(tmp_path))
    return tmp_path / "embeddings"


def _vectors(n, width, seed):
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed)) * 0.5


def test_textual_inversion_files(family, engine, comps, models_dir):
    if family == "sdxl":
        l1, g1 = _vectors(2, 64, 1), _vectors(2, 128, 2)
        l2, g2 = _vectors(3, 64, 3), _vectors(3, 128, 4)
        save_file({"clip_l": l1, "clip_g": g1}, str(models_dir / "style.safetensors"))
        torch.save({"clip_l": l2, "clip_g": g2}, str(models_dir / "sub" / "old.pt"))
        vl, vg = {"style": l1, "old": l2}, {"style": g1, "old": g2}
    else:
        v1, v2 = _vectors(2, 64, 1), _vectors(3, 64, 3)
        save_file({"emb_params": v1}, str(models_dir / "style.safetensors"))
        torch.save({"string_to_param": {"*": v2}, "name": "old", "step": 10}, str(models_dir / "sub" / "old.pt"))
        vl, vg = {"style": v1, "old": v2}, None
    text = "a photo embedding:style of (a cat embedding:old:1.2), " + "long " * 20
    got = _encode(engine, text)
    cond, pooled = ref_encode(comps, text, vl, vg)
    assert got.context.shape == cond.shape
    assert (got.context - cond).abs().max().item() <= TOL
    if pooled is not None:
        assert (got.pooled - pooled).abs().max().item() <= TOL


def test_textual_inversion_list_and_lora_bundled_files(family, engine, comps, models_dir):
    """The list-of-dicts layout and LoRA-bundled embeddings (``bundle_emb.*``).
    ComfyUI's ``load_embed``: a list keeps every tensor of the encoder's width, in order; a bundle concatenates
    its ``bundle_emb.*.string_to_param.*`` (else ``bundle_emb.*.<encoder key>``) tensors."""
    a, b, c = (_vectors(2, 64, 11), _vectors(1, 64, 12), _vectors(1, 128, 13))
    torch.save([{"a": a}, {"wide": _vectors(1, 768, 14)}, {"b": b, "c": c}], str(models_dir / "listed.pt"))
    if family == "sdxl":
        g1, g2 = _vectors(1, 128, 15), _vectors(2, 128, 16)
        bundle = {"lora_unet_x.lora_down.weight": torch.zeros(4, 8), "bundle_emb.s1.clip_l": a,
                  "bundle_emb.s1.clip_g": g1, "bundle_emb.s2.clip_l": b, "bundle_emb.s2.clip_g": g2}
        vl = {"listed": torch.cat([a, b]), "bundled": torch.cat([a, b])}
        vg = {"listed": c, "bundled": torch.cat([g1, g2])}
    else:
        bundle = {"lora_unet_x.lora_down.weight": torch.zeros(4, 8), "bundle_emb.s1.string_to_param.*": a,
                  "bundle_emb.s2.string_to_param.*": b}
        vl, vg = {"listed": torch.cat([a, b]), "bundled": torch.cat([a, b])}, None
    save_file(bundle, str(models_dir / "bundled.safetensors"))
    text = "a photo embedding:listed of embedding:bundled and " + "long " * 10
    got = _encode(engine, text)
    cond, pooled = ref_encode(comps, text, vl, vg)
    assert (got.context - cond).abs().max().item() <= TOL
    if pooled is not None:
        assert (got.pooled - pooled).abs().max().item() <= TOL


def test_sd2_reads_the_clip_h_vectors_of_a_file_that_has_several(models_dir):
    """SD2's OpenCLIP-H encoder takes an embedding file's ``clip_h`` tensor (ComfyUI's SD2 key),
    never its ``clip_l`` one, also when both have the encoder's width."""
    h, l_ = _vectors(2, 128, 21), _vectors(2, 128, 22)
    save_file({"clip_l": l_, "clip_h": h}, str(models_dir / "both.safetensors"))
    text = "a photo embedding:both of a cat"
    got = _encode(tiny_engine("sd2"), text)
    cond, _ = ref_encode(tiny_components("sd2"), text, {"both": h})
    assert (got.context - cond).abs().max().item() <= TOL


@pytest.mark.parametrize("content,match", [
    ({"name": "old", "step": 10}, r"embedding:empty.pt: the file holds no textual-inversion tensor ComfyUI would "
                                  r"read \(expected emb_params, string_to_param, clip_l or a list of tensors\)"),
    ([{"wide": torch.zeros(1, 768)}], r"embedding:empty.pt: the file holds no textual-inversion tensor"),
    ({"clip_l": [0.5, 0.25]}, r"embedding:empty.pt: expected a tensor under the selected key, got list"),
])
def test_embedding_files_without_usable_vectors_are_named(models_dir, content, match):
    torch.save(content, str(models_dir / "empty.pt"))
    with pytest.raises(ValueError, match=match):
        _encode(tiny_engine("sd1"), "a embedding:empty cat")


def test_unknown_embedding_errors_or_is_ignored(engine, comps, models_dir):
    with pytest.raises(ValueError, match="embedding:nosuch was not found"):
        _encode(engine, "a embedding:nosuch cat")
    got = _encode(engine, "a embedding:nosuch cat", missing_embedding="ignore")  # ComfyUI's fallback: dropped
    cond, _ = ref_encode(comps, "a embedding:nosuch cat")
    assert (got.context - cond).abs().max().item() <= TOL


def test_embedding_of_wrong_width_errors(models_dir):
    save_file({"emb_params": _vectors(1, 768, 0)}, str(models_dir / "big.safetensors"))
    with pytest.raises(ValueError, match="width 768"):
        _encode(tiny_engine("sd1"), "embedding:big")


def test_corrupt_embedding_file_errors_in_one_line(models_dir):
    (models_dir / "bad.pt").write_bytes(b"PK\x03\x04 not really a zip archive")  # cut-short download
    with pytest.raises(ValueError, match=r"embedding file 'bad\.pt' could not be read") as info:
        _encode(tiny_engine("sd1"), "embedding:bad")
    assert "\n" not in str(info.value) and "weights_only" not in str(info.value)


# ------------------------------------------------------------------------------------------ cache
class _Counter:
    def __init__(self, engine):
        self.calls = 0
        self.handles = [m.register_forward_pre_hook(self._hit)
                        for m in (engine.parts.text_encoder, engine.parts.text_encoder_2) if m is not None]

    def _hit(self, module, args):
        self.calls += 1


class _Lora:
    def __init__(self, key, affects_text=True):
        self.cache_key, self.affects_text = key, affects_text

    def attach(self, parts):
        pass

    def detach(self, parts):
        pass


def test_cache_counts_text_encoder_calls():
    engine = tiny_engine("sd1")
    cache = PromptCache(maxsize=3)
    count = _Counter(engine)
    first = encode_texts(engine, ["(a:1.2) cat", "dog"], cache=cache)
    assert count.calls == 2
    again = encode_texts(engine.with_changes(plan="next run"), ["dog", "(a:1.2) cat"], cache=cache)
    assert count.calls == 2  # same parts, same text: no encoder call, in any order, in a new view
    assert torch.equal(again[1].context, first[0].context)
    encode_texts(engine.with_adapter(_Lora(("unet-only.safetensors", 0.8), affects_text=False)), ["dog"],
                 cache=cache)
    assert count.calls == 2  # an adapter that leaves the text encoder alone keeps the entry
    encode_texts(engine.with_adapter(_Lora(("te.safetensors", 0.8))), ["dog"], cache=cache)
    assert count.calls == 3  # a text-encoder LoRA is part of the key
    encode_texts(engine.with_adapter(_Lora(("te.safetensors", 0.5))), ["dog"], cache=cache)
    assert count.calls == 4  # ... with its strength
    encode_texts(engine, ["x", "y"], cache=cache)
    assert count.calls == 6 and len(cache) == 3  # bounded LRU
    other = engine.with_changes(parts=dataclasses.replace(engine.parts, name="another checkpoint"))
    encode_texts(other, ["dog"], cache=cache)
    assert count.calls == 7  # another model (other parts object) never shares entries


def test_cache_is_used_by_default_and_invalidated_by_embedding_edit(models_dir):
    engine = tiny_engine("sd1")
    prompt_encoder.PROMPT_CACHE.clear()
    count = _Counter(engine)
    save_file({"emb_params": _vectors(1, 64, 5)}, str(models_dir / "e.safetensors"))
    a = encode_texts(engine, ["embedding:e cat"])[0]
    encode_texts(engine, ["embedding:e cat"])
    assert count.calls == 1
    import os
    save_file({"emb_params": _vectors(1, 64, 6)}, str(models_dir / "e.safetensors"))
    st = os.stat(models_dir / "e.safetensors")
    os.utime(models_dir / "e.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    b = encode_texts(engine, ["embedding:e cat"])[0]
    assert count.calls == 2 and not torch.equal(a.context, b.context)
    st = os.stat(models_dir / "e.safetensors")  # a copy that kept size and mtime (cp -p): still a new key
    save_file({"emb_params": _vectors(1, 64, 7)}, str(models_dir / "e.safetensors"))
    os.utime(models_dir / "e.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(models_dir / "e.safetensors").st_size == st.st_size
    c = encode_texts(engine, ["embedding:e cat"])[0]
    assert count.calls == 3 and not torch.equal(b.context, c.context)


def test_the_syntax_and_an_undeclared_adapter_are_part_of_the_cache_key():
    """One text reads differently in the two syntaxes ([x] and BREAK), so a cached "comfyui"
    encoding must not answer an "extended" request; and an adapter that does not say whether it touches the text
    encoders (no ``affects_text``) is assumed to."""
    engine = tiny_engine("sd1")
    cache = PromptCache()
    count = _Counter(engine)
    text = "[blur] a BREAK b"
    comfy = encode_texts(engine, [text], syntax="comfyui", cache=cache)[0]
    extended = encode_texts(engine, [text], syntax="extended", cache=cache)[0]
    assert count.calls == 2
    assert comfy.context.shape != extended.context.shape  # BREAK: two chunks in the extended syntax
    assert torch.equal(extended.context, encode_texts(engine, [text], syntax="extended", cache=None)[0].context)

    class Undeclared:
        cache_key = ("te-lora.safetensors", 1.0)

        def attach(self, parts):
            pass

        def detach(self, parts):
            pass

    encode_texts(engine.with_adapter(Undeclared()), [text], syntax="extended", cache=cache)
    assert count.calls == 4  # (the uncached reference above was the third) the undeclared adapter's key missed

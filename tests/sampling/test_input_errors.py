"""Inputs that used to fail deep inside a library, each now refused before any model runs by a ``ValueError`` /
``TypeError`` that names the input, the bad value and the fix.

Guards: a lone surrogate in a prompt (the tokenizer's ``TypeError: TextEncodeInput must be Union[...]``); prompt
groups nested past the limit (``RecursionError``); a CONDITIONING with 0 tokens (``ZeroDivisionError``); a LoRA file
named as ``embedding:`` (``IndexError`` on its scalar alpha); bool and complex latents.
"""
import pytest
import torch
from safetensors.torch import save_file

from leandiffusion.nodes.sampler import LeanFusedDDIMSampler
from leandiffusion.sampling.prompt_encoder import PROMPT_CACHE
from leandiffusion.sampling.prompt_parser import MAX_NESTING, parse_weights


def _args(engine, **overrides):
    args = dict(lean_model=engine, positive="a boat", negative="fog", seed=1, steps=1, cfg=5.0, eta=0.0, width=64,
                height=64, batch_size=1, timestep_spacing="leading", cfg_mode="batched", acceleration="none")
    args.update(overrides)
    return args


@pytest.mark.parametrize("side", ["positive", "negative"])
def test_lone_surrogate_names_the_prompt_and_the_position(sd1, opened_sessions, side):
    PROMPT_CACHE.clear()
    with pytest.raises(ValueError, match=r"prompt: character 2 is a lone surrogate \('\\udc80'\).*remove it"):
        LeanFusedDDIMSampler().run(**_args(sd1, **{side: "a \udc80 boat"}))
    assert opened_sessions == [], f"sessions opened before the error: {opened_sessions}"


@pytest.mark.parametrize("syntax,text", [("comfyui", "(" * 1500 + "cat" + ")" * 1500),
                                         ("extended", "[" * 1500 + "cat" + "]" * 1500)])
def test_deep_nesting_names_the_limit(syntax, text):
    with pytest.raises(ValueError, match=rf"prompt: .* nested more than {MAX_NESTING} levels.*\(word:1.5\)"):
        parse_weights(text, syntax)


def test_nesting_up_to_the_limit_and_unclosed_parentheses_still_parse():
    depth = MAX_NESTING
    assert parse_weights("(" * depth + "cat" + ")" * depth) == [("cat", pytest.approx(1.1 ** depth))]
    assert parse_weights("(" * 3000 + "cat") == [("(" * 3000 + "cat", 1.0)]  # unbalanced: literal, as ComfyUI


def test_deep_nesting_in_the_sampler_is_a_value_error(sd1, opened_sessions):
    PROMPT_CACHE.clear()
    with pytest.raises(ValueError, match=rf"nesting limit is {MAX_NESTING}"):
        LeanFusedDDIMSampler().run(**_args(sd1, positive="(" * 1200 + "cat" + ")" * 1200))
    assert opened_sessions == []


@pytest.mark.parametrize("side", ["positive_cond", "negative_cond"])
@pytest.mark.parametrize("shape,what", [((1, 0, 64), "0 tokens"), ((0, 77, 64), "0 rows")])
def test_empty_conditioning_names_the_input(sd1, opened_sessions, side, shape, what):
    PROMPT_CACHE.clear()
    with pytest.raises(ValueError, match=rf"{side}: the CONDITIONING has {what} \(shape .*\); connect a text-encode"):
        LeanFusedDDIMSampler().run(**_args(sd1, **{side: [[torch.zeros(shape), {}]]}))
    assert opened_sessions == []


def test_lora_file_used_as_embedding_says_so(sd1, tmp_path, monkeypatch):
    (tmp_path / "embeddings").mkdir()
    prefix = "lora_unet_down_blocks_0_attentions_0_proj_in"
    save_file({f"{prefix}.alpha": torch.tensor(4.0), f"{prefix}.lora_down.weight": torch.zeros(4, 32),
               f"{prefix}.lora_up.weight": torch.zeros(32, 4)}, str(tmp_path / "embeddings" / "style_lora.safetensors"))
    monkeypatch.setenv("LEANDIFFUSION_MODELS", str(tmp_path))
    PROMPT_CACHE.clear()
    with pytest.raises(ValueError, match=r"embedding:style_lora.safetensors is a LoRA file \(keys such as "
                                         rf"{prefix}.alpha.*\), not a textual-inversion embedding;.*LoRA injector"):
        LeanFusedDDIMSampler().run(**_args(sd1, positive="a boat, embedding:style_lora"))


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64])
def test_non_floating_latents_are_refused_by_name(sd1, dtype):
    with pytest.raises(ValueError, match=r"latent_image\['samples'\]: expected a float tensor"):
        LeanFusedDDIMSampler().run(**_args(sd1), latent_image={"samples": torch.zeros(1, 4, 8, 8, dtype=dtype)})

"""``sampling.cfg.conditioning_from_embeds``: one prompt's embeddings per side, repeated to the batch, refused by name
when the model cannot use them (the benchmark suite is its caller)."""
import pytest
import torch

from leandiffusion.memory.engine import PromptEmbeds
from leandiffusion.sampling.cfg import conditioning_from_embeds, unet_calls
from leandiffusion.tests.kit import tiny_engine


@pytest.fixture(scope="module")
def sdxl():
    return tiny_engine("sdxl")


def _embeds(engine, pooled=True, rows=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    cfg = engine.parts.unet.config
    width = cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim
    return PromptEmbeds(torch.randn(rows, 77, cfg.cross_attention_dim, generator=g),
                        torch.randn(rows, width, generator=g) if pooled else None)


@pytest.mark.parametrize("side", ["cond", "uncond"])
def test_sdxl_embeddings_without_pooled_are_refused_on_either_side(sdxl, side):
    sides = {"cond": _embeds(sdxl), "uncond": _embeds(sdxl, seed=1)}
    sides[side] = _embeds(sdxl, pooled=False)
    with pytest.raises(ValueError, match=r"SDXL needs pooled text embeddings for both prompts"):
        conditioning_from_embeds(sdxl, sides["cond"], sides["uncond"], 2, 64, 64)


def test_embeddings_of_several_prompts_are_refused(sdxl):
    with pytest.raises(ValueError, match=r"uncond embeddings have batch 2; pass one prompt's embeddings"):
        conditioning_from_embeds(sdxl, _embeds(sdxl), _embeds(sdxl, rows=2), 2, 64, 64)


def test_batched_layout_is_uncond_rows_then_cond_rows(sdxl):
    cond, uncond = _embeds(sdxl), _embeds(sdxl, seed=1)
    conditioning = conditioning_from_embeds(sdxl, cond, uncond, 2, height=80, width=64)
    [call], copies = unet_calls(conditioning, "batched")
    assert copies == 2
    assert torch.equal(call.context, torch.cat([uncond.context] * 2 + [cond.context] * 2))
    assert torch.equal(call.added["text_embeds"], torch.cat([uncond.pooled] * 2 + [cond.pooled] * 2))
    assert call.added["time_ids"].tolist() == [[80.0, 64.0, 0.0, 0.0, 80.0, 64.0]] * 4  # (h, w, top, left, h, w)

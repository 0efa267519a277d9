"""``sampling/qwen/forward.py`` equals ``QwenImageTransformer2DModel.forward`` (diffusers' own module, the
reference) row by row, CPU fp32, tiny random model.

Guards the batched-CFG promise: rows of different prompts zero-padded to one text bucket and masked give, each,
the prediction of that row's own unpadded call (a text RoPE position moved by padding, or a padded key that still
gets attention weight, moves it by far more than ``TOL``); the edit seam: reference tokens after the noise tokens,
with their ``img_shapes`` entries, give the module's prediction for ``cat([noise, reference])`` sliced to the noise
tokens; a ``zero_cond_t`` transformer (Qwen-Image-Edit 2511's timestep-zero reference modulation); and the bucket
and input checks."""
import pytest
import torch
from diffusers import QwenImageTransformer2DModel

from leandiffusion.memory.tiny_qwen_image import transformer_config
from leandiffusion.sampling.qwen.forward import (QwenReference, qwen_forward, qwen_layout, text_capacity)

TOL = 2e-5
H, W = 6, 4  # token grid of the noise image (a 12 x 8 latent)


def _dit(**overrides):
    torch.manual_seed(0)
    dit = QwenImageTransformer2DModel(**{**transformer_config(), **overrides}).eval().requires_grad_(False)
    with torch.no_grad():
        dit.proj_out.weight.normal_(std=0.2)
    return dit


def _module(dit, x, t, text, shapes):
    """The module's own call for one row: unpadded text, no mask (as the pipeline calls it for one prompt)."""
    return dit(hidden_states=x, timestep=t, encoder_hidden_states=text, encoder_hidden_states_mask=None,
               img_shapes=[shapes] * x.shape[0], return_dict=False)[0]


@pytest.fixture(scope="module")
def dit():
    return _dit()


def _rows(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 32, generator=g) for n in lengths]


def test_padded_batched_rows_equal_their_own_unpadded_calls(dit):
    rows = _rows([7, 7, 19, 19])  # [cond x 2, uncond x 2] of two prompts of different lengths
    x = torch.randn(4, H * W, 64, generator=torch.Generator().manual_seed(2))
    t = torch.full((4,), 0.7)
    layout = qwen_layout(dit, rows, text_capacity([7, 19]), (1, H, W), None, torch.float32, torch.device("cpu"))
    assert layout.text.shape[1] == 64 and layout.text_lengths == (7, 7, 19, 19)
    with torch.no_grad():
        out = qwen_forward(dit, x, t, layout)
        for i, row in enumerate(rows):
            ref = _module(dit, x[i:i + 1], t[i:i + 1], row[None], [(1, H, W)])
            assert (out[i:i + 1] - ref).abs().max().item() <= TOL
        assert (out[0] - out[2]).abs().max().item() > 1e-2  # the prompts matter


def test_reference_tokens_ride_after_the_noise_and_are_dropped(dit):
    shapes = ((1, 3, 5), (1, 2, 2))
    reference = QwenReference(torch.randn(1, 19, 64, generator=torch.Generator().manual_seed(3)), shapes)
    rows = _rows([5, 11])
    x = torch.randn(2, H * W, 64, generator=torch.Generator().manual_seed(4))
    t = torch.full((2,), 0.4)
    layout = qwen_layout(dit, rows, 64, (1, H, W), reference.checked(1), torch.float32, torch.device("cpu"))
    with torch.no_grad():
        out = qwen_forward(dit, x, t, layout)
        no_ref = qwen_forward(dit, x, t, qwen_layout(dit, rows, 64, (1, H, W), None, torch.float32,
                                                     torch.device("cpu")))
        assert out.shape == (2, H * W, 64)
        for i, row in enumerate(rows):
            full = torch.cat([x[i:i + 1], reference.tokens], dim=1)
            ref = _module(dit, full, t[i:i + 1], row[None], [(1, H, W), *shapes])[:, :H * W]
            assert (out[i:i + 1] - ref).abs().max().item() <= TOL
    assert (out - no_ref).abs().max().item() > 1e-2  # the reference really conditions the prediction


def test_zero_cond_t_transformer_equals_its_module():
    dit = _dit(zero_cond_t=True)
    shapes = ((1, 2, 3),)
    reference = QwenReference(torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(5)), shapes)
    rows = _rows([9, 9])
    x = torch.randn(2, H * W, 64, generator=torch.Generator().manual_seed(6))
    t = torch.full((2,), 0.9)
    layout = qwen_layout(dit, rows, 64, (1, H, W), reference.checked(2), torch.float32, torch.device("cpu"))
    with torch.no_grad():
        out = qwen_forward(dit, x, t, layout)
        full = torch.cat([x, reference.tokens], dim=1)
        ref = dit(hidden_states=full, timestep=t, encoder_hidden_states=torch.stack(rows),
                  encoder_hidden_states_mask=None, img_shapes=[[(1, H, W), *shapes]] * 2,
                  return_dict=False)[0][:, :H * W]
    assert (out - ref).abs().max().item() <= TOL


def test_buckets_and_bad_inputs():
    lengths = (1, 64, 65, 200, 263, 512, 700, 2048)
    assert [text_capacity([n]) for n in lengths] == [64, 64, 128, 256, 320, 512, 768, 2048]
    with pytest.raises(ValueError, match="2049 tokens exceeds the longest supported"):
        text_capacity([3, 2049])
    with pytest.raises(ValueError, match=r"reference tokens of shape \(3, 6, 64\) do not match"):
        QwenReference(torch.zeros(3, 6, 64), ((1, 2, 3),)).checked(2)
    with pytest.raises(ValueError, match=r"reference tokens of shape \(1, 5, 64\) do not match"):
        QwenReference(torch.zeros(1, 5, 64), ((1, 2, 3),)).checked(2)

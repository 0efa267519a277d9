"""Guards the full-size random-weight builders: buffers survive materialisation (CLIP's position_ids once came
back as uninitialised memory, so every prompt encode indexed out of range), weights are finite and scaled."""
import torch

from leandiffusion.bench.models import CLIP_L, full_text_encoder


def test_clip_position_ids_survive_and_encoding_runs():
    te = full_text_encoder("clip_l", device="cpu", dtype=torch.float32)
    ids = next(b for name, b in te.named_buffers() if name.endswith("position_ids"))
    assert torch.equal(ids.flatten(), torch.arange(CLIP_L["max_position_embeddings"]))
    out = te(torch.randint(0, CLIP_L["vocab_size"], (1, 77))).last_hidden_state
    assert out.shape == (1, 77, CLIP_L["hidden_size"]) and torch.isfinite(out).all()
    assert 0.1 < out.std().item() < 10  # N(0, 1/fan_in) keeps activations O(1)

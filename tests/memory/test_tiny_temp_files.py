"""The tiny model leaves nothing in the temporary folder: ``build_tiny_components`` without ``tokenizer_dir`` (what
the loader's ``tiny-random (test)`` choice calls once per ComfyUI process) writes its tokenizer files into a temporary
folder and removes it once the tokenizers are loaded; the tokenizers still work afterwards (they hold their vocabulary
in memory) and the model is the same as with an explicit ``tokenizer_dir``."""
import tempfile

import torch

from leandiffusion.memory.tiny import build_tiny_components


def _entries(folder):
    return {p.name for p in folder.iterdir()}


def test_tiny_model_leaves_no_temporary_folder(tmp_path, monkeypatch):
    reference = build_tiny_components("sdxl", seed=0, tokenizer_dir=tmp_path / "tok")  # imports done before
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    parts = build_tiny_components("sdxl", seed=0)
    assert _entries(scratch) == set(), "build_tiny_components left files in the temporary folder"
    for key in ("tokenizer", "tokenizer_2"):
        ids = parts[key]("a red cube, studio light", padding="max_length", max_length=77).input_ids
        assert ids == reference[key]("a red cube, studio light", padding="max_length", max_length=77).input_ids
        assert parts[key].pad_token == reference[key].pad_token
    for name, p in parts["unet"].state_dict().items():
        assert torch.equal(p, reference["unet"].state_dict()[name])
    assert _entries(tmp_path / "tok")  # an explicit folder is the caller's and is kept

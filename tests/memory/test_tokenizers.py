"""Where CLIP's BPE files are found (``memory/tokenizers.py``), beside the loaders' tests that use it.

Guards: a folder needs both ``vocab.json`` and ``merges.txt``; the checkpoint's own ``<stem>.tokenizer/`` wins
over the shared ``tokenizer/``; ComfyUI's folder is used only when it holds the files. The pad-token and
maximum-length check pins ``load_clip_tokenizer``'s parameters (no caller passes another length).
"""
from __future__ import annotations

import pytest

from leandiffusion import bridge
from leandiffusion.memory.tiny import write_tiny_clip_tokenizer
from leandiffusion.memory.tokenizers import OPENCLIP_PAD, find_tokenizer_dir, load_clip_tokenizer


@pytest.fixture
def no_comfy(monkeypatch):
    monkeypatch.setattr(bridge, "comfy_tokenizer_dir", lambda: None)


def test_the_checkpoints_own_tokenizer_folder_wins_and_needs_both_files(tmp_path, no_comfy):
    ckpt = tmp_path / "m.v2.safetensors"
    shared = write_tiny_clip_tokenizer(tmp_path / "tokenizer")
    own = write_tiny_clip_tokenizer(tmp_path / "m.v2.tokenizer")
    assert find_tokenizer_dir(ckpt) == own
    (own / "merges.txt").unlink()  # vocab.json alone is no tokenizer
    assert find_tokenizer_dir(ckpt) == shared
    (shared / "merges.txt").unlink()
    with pytest.raises(ValueError, match=r"model='m.v2.safetensors': no CLIP tokenizer files found \(single-file"):
        find_tokenizer_dir(ckpt)


def test_comfyuis_folder_counts_only_with_the_files_and_a_diffusers_folder_looks_inside(tmp_path, monkeypatch):
    empty = tmp_path / "comfy" / "sd1_tokenizer"
    empty.mkdir(parents=True)
    monkeypatch.setattr(bridge, "comfy_tokenizer_dir", lambda: empty)
    folder = tmp_path / "diffusers" / "model"
    folder.mkdir(parents=True)
    with pytest.raises(ValueError, match=r"this diffusers folder has none.* in .*model/tokenizer$"):
        find_tokenizer_dir(folder)
    own = write_tiny_clip_tokenizer(folder / "tokenizer")
    assert find_tokenizer_dir(folder) == own


def test_the_pad_token_and_maximum_length_are_applied(tmp_path):
    folder = write_tiny_clip_tokenizer(tmp_path / "tok")
    plain = load_clip_tokenizer(folder)
    openclip = load_clip_tokenizer(folder, pad_token=OPENCLIP_PAD, max_length=40)
    assert plain.model_max_length == 77 and openclip.model_max_length == 40
    assert openclip.pad_token == "!" and openclip.pad_token_id == 0
    assert plain.pad_token != "!"
    assert len(openclip("a", padding="max_length").input_ids) == 40

"""``prompt_embeddings.find_embedding``: which file ``embedding:NAME`` names when two candidates exist. The order is the
module docstring's: the top-level folder before sub-folders (in sorted order), in each folder the exact name before
``.safetensors``, ``.pt``, ``.bin`` appended (ComfyUI 0.3.64 ``load_embed``)."""
import pytest

from leandiffusion.sampling.prompt_embeddings import find_embedding


@pytest.mark.parametrize("name,available,want", [
    ("style", ["a/style.safetensors", "style.pt"], "style.pt"),  # the top level before any sub-folder
    ("style", ["b/style.pt", "a/style.bin"], "a/style.bin"),  # sub-folders in sorted order
    ("style", ["style.bin", "style.pt", "style.safetensors"], "style.safetensors"),  # extensions in ComfyUI's order
    ("style.pt", ["style.pt.safetensors", "style.pt"], "style.pt"),  # the exact name first
    ("sub/style", ["sub/style.pt"], "sub/style.pt"),
    ("nope", ["style.pt"], None),
    ("", ["style.pt"], None),
])
def test_the_first_candidate_in_the_documented_order_is_found(name, available, want):
    assert find_embedding(name, available) == want

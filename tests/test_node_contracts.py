"""Every pack node is a well-formed ComfyUI V1 node: category, description, tooltips on every input.

Guards GUIDE conventions 1 and 11 for all nodes at once, including ones added later.
"""
import pytest

from leandiffusion import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

NODES = sorted(NODE_CLASS_MAPPINGS.items())


def test_mappings_consistent():
    assert set(NODE_DISPLAY_NAME_MAPPINGS) <= set(NODE_CLASS_MAPPINGS)


@pytest.mark.parametrize("node_id,cls", NODES, ids=[n for n, _ in NODES])
def test_node_declaration(node_id, cls):
    assert node_id in NODE_DISPLAY_NAME_MAPPINGS
    assert cls.CATEGORY.startswith("LeanDiffusion/")
    assert isinstance(cls.DESCRIPTION, str) and cls.DESCRIPTION
    assert callable(getattr(cls, cls.FUNCTION))
    assert len(cls.RETURN_TYPES) == len(getattr(cls, "RETURN_NAMES", cls.RETURN_TYPES))
    spec = cls.INPUT_TYPES()
    assert "required" in spec
    for section in ("required", "optional"):
        for name, decl in spec.get(section, {}).items():
            assert isinstance(decl, tuple) and 1 <= len(decl) <= 2, name
            opts = decl[1] if len(decl) == 2 else {}
            assert opts.get("tooltip"), f"{node_id}.{name} has no tooltip"

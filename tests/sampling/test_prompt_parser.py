"""Prompt syntax: the pack reads weights, nesting, escapes and embedding words as ComfyUI 0.3.64 does."""
import random

import pytest

from leandiffusion.sampling.prompt_parser import Piece, parse_prompt, parse_weights
from leandiffusion.tests.sampling._prompt_reference import ref_token_weights

# Expected values derived by hand from comfy/sd1_clip.py's rules (not produced by the code under test).
CASES = [
    ("a cat", [("a cat", 1.0)]),
    ("(red cube:1.3), x", [("red cube", 1.3), (", x", 1.0)]),
    ("((studio light))", [("studio light", 1.1 * 1.1)]),
    ("(((a)))", [("a", 1.1 * 1.1 * 1.1)]),
    ("((a:1.5))", [("a", 1.5)]),                       # an explicit weight is absolute, not multiplied
    ("((a:1.5) b)", [("a", 1.5), (" b", 1.1)]),
    ("(a (b:0.5))", [("a ", 1.1), ("b", 0.5)]),
    ("\\(not a group\\)", [("(not a group)", 1.0)]),
    ("(x \\(y\\))", [("x (y)", 1.1)]),
    ("(cat:abc)", [("cat:abc", 1.1)]),                  # malformed weight: ComfyUI's fallback, 1.1 and literal
    ("(:1.5)", [(":1.5", 1.1)]),                        # colon at position 0 is no weight
    ("(time 12:30)", [("time 12", 30.0)]),              # last colon wins, as in ComfyUI
    ("(a b", [("(a b", 1.0)]),                          # unbalanced: literal
    ("a) (b)", [("a) (b)", 1.0)]),                      # stray ')' drives the depth negative: rest is literal
    ("[blur]", [("[blur]", 1.0)]),                      # ComfyUI has no [] de-emphasis
    ("a BREAK b", [("a BREAK b", 1.0)]),                # ComfyUI has no BREAK
    ("(a:1e-1)", [("a", 0.1)]),
]


@pytest.mark.parametrize("text,expected", CASES)
def test_comfyui_weights(text, expected):
    got = parse_weights(text)
    assert [s for s, _ in got] == [s for s, _ in expected]
    assert [w for _, w in got] == pytest.approx([w for _, w in expected], rel=1e-12)


def test_fuzz_against_reference():
    """Random strings over the syntax alphabet parse exactly like the plain reference (unbalanced input included)."""
    rng = random.Random(0)
    alphabet = ["(", ")", "\\(", "\\)", ":", "1.2", "0.5", "abc", " ", "x", ",", "[", "]", "e", "::"]
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 14)))
        assert parse_weights(text) == ref_token_weights(text), text


def test_extended_syntax():
    got = parse_weights("[blur] [[x]] (a [b]) \\[lit\\]", "extended")
    d = 1 / 1.1
    assert got == [("blur", d), (" ", 1.0), ("x", d * d), (" ", 1.0), ("a ", 1.1), ("b", 1.1 * d), (" [lit]", 1.0)]
    pieces = parse_prompt("a BREAK (b BREAK c) BREAKFAST", "extended")
    assert [(p.kind, p.text.strip()) for p in pieces] == [
        ("text", "a"), ("break", ""), ("text", ""), ("text", "b"), ("break", ""), ("text", "c"),
        ("text", "BREAKFAST")]
    assert [p.weight for p in pieces if p.text.strip() in ("b", "c")] == [1.1, 1.1]


def test_embedding_words():
    known = {"style", "sub/thing"}
    pieces = parse_prompt("a photo embedding:style  of\nembedding:sub/thing,x y, embedding:nope z",
                          exists=known.__contains__)
    assert pieces == [
        Piece("text", "a photo", 1.0),
        Piece("embedding", "style", 1.0, True), Piece("text", "of", 1.0),
        Piece("embedding", "sub/thing,x", 1.0, False), Piece("text", "y,", 1.0),
        Piece("embedding", "nope", 1.0, False), Piece("text", "z", 1.0),
    ]
    # trailing comma: retried without it, the comma goes back into the text (ComfyUI's rule)
    pieces = parse_prompt("(embedding:style, red:1.2)", exists=known.__contains__)
    assert pieces == [Piece("embedding", "style", 1.2, True), Piece("text", ", red", 1.2)]
    # commas on both sides are stripped for the retry, and ComfyUI gives back name[len(stripped):] (the name's tail,
    # not the commas, when one led: ComfyUI 0.3.64 sd1_clip.py _try_get_embedding)
    pieces = parse_prompt("a embedding:,style, x", exists=known.__contains__)
    assert pieces == [Piece("text", "a", 1.0), Piece("embedding", "style", 1.0, True), Piece("text", "e, x", 1.0)]
    # no space before 'embedding:' -> plain text, as in ComfyUI
    assert parse_prompt("a,embedding:style") == [Piece("text", "a,embedding:style", 1.0)]


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="embedding:"):
        parse_prompt("a embedding:")
    with pytest.raises(ValueError, match="syntax"):
        parse_weights("a", "a1111")
    with pytest.raises(TypeError, match="text"):
        parse_weights(None)

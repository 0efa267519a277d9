"""Plain reference of ComfyUI 0.3.64's CLIPTextEncode rules, written for the tests only.

Independent of ``leandiffusion.sampling.prompt_*``: it re-derives the rules from ComfyUI's documented behaviour
(``comfy/sd1_clip.py``: parentheses groups, 1.1 per level, absolute ``:w``, escapes, ``embedding:`` words, 77-token
chunks, interpolation from the empty prompt) in the most direct way: one text-encoder call per chunk, textual
inversion through an enlarged copy of the token-embedding table.
"""
from __future__ import annotations

import copy
import re

import torch


def ref_token_weights(text: str) -> list[tuple[str, float]]:
    text = text.replace("\\)", "\x00\x01").replace("\\(", "\x00\x02")

    def groups(s):
        out, cur, level = [], "", 0
        for ch in s:
            if ch == "(":
                if level == 0:
                    if cur:
                        out.append(cur)
                    cur = "("
                else:
                    cur += ch
                level += 1
            elif ch == ")":
                level -= 1
                if level == 0:
                    out.append(cur + ")")
                    cur = ""
                else:
                    cur += ch
            else:
                cur += ch
        if cur:
            out.append(cur)
        return out

    def weights(s, w):
        res = []
        for g in groups(s):
            if len(g) >= 2 and g.startswith("(") and g.endswith(")"):
                inner = g[1:-1]
                nw = w * 1.1
                pos = inner.rfind(":")
                if pos > 0:
                    try:
                        nw = float(inner[pos + 1:])
                        inner = inner[:pos]
                    except ValueError:
                        pass
                res += weights(inner, nw)
            else:
                res.append((g, w))
        return res

    return [(s.replace("\x00\x01", ")").replace("\x00\x02", "("), w) for s, w in weights(text, 1.0)]


def ref_groups(text: str, tokenizer, embeddings: dict | None = None) -> list[list[tuple[object, float]]]:
    """Token groups [(token id or ('emb', name, row), weight)] per ComfyUI's word splitting."""
    embeddings = embeddings or {}
    out = []
    for seg, w in ref_token_weights(text):
        words = re.split(" embedding:|\nembedding:", seg)
        words = [words[0]] + ["embedding:" + x for x in words[1:]]
        for word in [x for x in words if x]:
            if word.startswith("embedding:"):
                parts = word[len("embedding:"):].strip("\n").split()
                name, rest = parts[0], " ".join(parts[1:])
                if name in embeddings:
                    out.append([(("emb", name, i), w) for i in range(embeddings[name])])
                if not rest:
                    continue
                word = rest
            out.append([(t, w) for t in tokenizer(word)["input_ids"][1:-1]])
    return out


def ref_chunks(groups, start, end, pad, length=77):
    chunks, cur = [], [(start, 1.0)]
    chunks.append(cur)
    for g in groups:
        big = len(g) >= 8
        while g:
            if len(g) + len(cur) > length - 1:
                left = length - len(cur) - 1
                if big:
                    cur += g[:left]
                    cur.append((end, 1.0))
                    g = g[left:]
                else:
                    cur.append((end, 1.0))
                    cur += [(pad, 1.0)] * left
                cur = [(start, 1.0)]
                chunks.append(cur)
            else:
                cur += g
                g = []
    cur.append((end, 1.0))
    cur += [(pad, 1.0)] * (length - len(cur))
    return chunks


def _with_vectors(model, vectors: dict[str, torch.Tensor]):
    """A copy of ``model`` whose token table has the embedding vectors appended; returns (model, name->first id)."""
    if not vectors:
        return model, {}
    model = copy.deepcopy(model)
    emb = model.get_input_embeddings()
    base = emb.weight.shape[0]
    rows, first, n = [emb.weight.data], {}, base
    for name, vec in vectors.items():
        first[name] = n
        rows.append(vec.to(emb.weight.dtype))
        n += vec.shape[0]
    new = torch.nn.Embedding(n, emb.weight.shape[1])
    new.weight.data = torch.cat(rows)
    model.set_input_embeddings(new)
    return model, first


@torch.no_grad()
def ref_encode_one(model, tokenizer, text, layer, vectors=None, projected=False):
    """ComfyUI's encoding of ``text`` with one CLIP: (cond [1, 77k, C], pooled of chunk 0 or None)."""
    vectors = vectors or {}
    model, first = _with_vectors(model, vectors)
    start, end, pad = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    groups = ref_groups(text, tokenizer, {k: v.shape[0] for k, v in vectors.items()})
    chunks = ref_chunks(groups, start, end, pad)

    def run(ids):
        out = model(torch.tensor([ids]), output_hidden_states=True)
        h = out.last_hidden_state if layer == "last" else out.hidden_states[-2]
        return h[0].float(), (out.text_embeds if projected else None)

    empty, _ = run([start, end] + [pad] * 75)
    conds, pooled = [], None
    for k, chunk in enumerate(chunks):
        ids = [first[t[1]] + t[2] if isinstance(t, tuple) else t for t, _ in chunk]
        z, p = run(ids)
        if k == 0:
            pooled = p
        z = z.clone()
        for j, (_, w) in enumerate(chunk):
            if w != 1.0:
                z[j] = (z[j] - empty[j]) * w + empty[j]
        conds.append(z)
    return torch.cat(conds)[None], pooled


def ref_encode(components: dict, text: str, vectors_l=None, vectors_g=None):
    """ComfyUI's CLIPTextEncode of ``text`` for a tiny model's components: (cond, pooled or None)."""
    if "text_encoder_2" in components:
        zl, _ = ref_encode_one(components["text_encoder"], components["tokenizer"], text, "penultimate", vectors_l)
        zg, pg = ref_encode_one(components["text_encoder_2"], components["tokenizer_2"], text, "penultimate",
                                vectors_g, projected=True)
        n = min(zl.shape[1], zg.shape[1])
        return torch.cat([zl[:, :n], zg[:, :n]], dim=-1), pg
    return ref_encode_one(components["text_encoder"], components["tokenizer"], text, "last", vectors_l)[0], None

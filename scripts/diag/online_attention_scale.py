"""The tiled VAE's online TF32 attention (``vae.attention_bands._online_attention``) with the softmax scale in the
score GEMM's epilogue (session 23) against the old form that scaled ``q`` first (emulated here): error vs fp64 on
inputs with large scores (the GPU test ``test_online_tf32_attention_keeps_half_queries_exact``'s) and on random ones,
and ms per call at the SD VAE mid block's 2048 px map (256 x 256 = 65536 tokens, one head of 512), fp16 and bf16,
keys in 16 chunks (a resident plan's bands).
Usage (device machine, repository root, pack importable as ``leandiffusion``):
python scripts/diag/online_attention_scale.py; writes $OUT/online_attention_scale.json. About a minute on an H100.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from diag_timing import Recorder, timed  # noqa: E402
from leandiffusion.vae import attention_bands  # noqa: E402
from leandiffusion.vae.attention import tf32_matmuls  # noqa: E402

rec = Recorder("online_attention_scale.json")
dev = torch.device("cuda")


def old_online(q, chunks, tf32):
    """The session-22 code: ``q`` scaled in fp32 before the (TF32) matmuls."""
    q = q.float() * (q.shape[-1] ** -0.5)
    m = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    norm = torch.zeros_like(m)
    acc = torch.zeros_like(q)
    with tf32_matmuls() if tf32 else torch.no_grad():
        for k, v in chunks:
            s = torch.matmul(q, k.float().transpose(-1, -2))
            m_new = torch.maximum(m, s.amax(dim=-1))
            s.sub_(m_new.unsqueeze(-1)).exp_()
            keep = torch.exp(m - m_new)
            norm.mul_(keep).add_(s.sum(dim=-1))
            acc.mul_(keep.unsqueeze(-1)).add_(torch.matmul(s, v.float()))
            m = m_new
    return acc.div_(norm.unsqueeze(-1))


FORMS = {"new": attention_bands._online_attention, "old": old_online}


def inputs(n, d, dtype, large, gen):
    if large:
        u = torch.randn(d, generator=gen)
        q, k = ((8 * u + 2 * torch.randn(n, d, generator=gen)).to(dtype) for _ in range(2))
        v = (torch.randn(n, d, generator=gen) + 3).to(dtype)
    else:
        q, k, v = (torch.randn(n, d, generator=gen).to(dtype) for _ in range(3))
    return q, k, v


def chunked(k, v, parts):
    u = k.shape[2] // parts
    return [(k[:, :, a:a + u], v[:, :, a:a + u]) for a in range(0, k.shape[2], u)]


@torch.no_grad()
def main():
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float16, torch.bfloat16):
        name = str(dtype).split(".")[-1]
        for large in (True, False):
            q, k, v = inputs(2048, 512, dtype, large, gen)
            ref = torch.softmax((q.double() @ k.double().T) * 512 ** -0.5, dim=-1) @ v.double()
            qc, kc, vc = (t.to(dev)[None, None] for t in (q, k, v))
            row = {f: float((FORMS[f](qc, chunked(kc, vc, 4), True)[0, 0].double().cpu() - ref).abs().max())
                   for f in FORMS}
            sdpa = torch.nn.functional.scaled_dot_product_attention(qc, kc, vc)[0, 0].double().cpu()
            row["sdpa_same_dtype"] = float((sdpa - ref).abs().max())
            rec(f"max_err_vs_fp64_{name}_{'large_scores' if large else 'random'}", row)
        q, k, v = (torch.randn(1, 1, 65536, 512, generator=gen).to(dev, dtype) for _ in range(3))
        chunks = chunked(k, v, 16)
        row = {f: round(timed(lambda f=f: FORMS[f](q[:, :, :4096], chunks, True), 5), 2) for f in FORMS}
        row["queries"] = 4096
        rec(f"ms_{name}_2048px_map_4096_queries", row)


if __name__ == "__main__":
    main()

"""Would a fused GEGLU without a LoRA term change the SDXL UNet's CUDA-graph time at 1 and 8 images (CFG batch 2 /
16), and by how much its output? A probe, not pack code: it patches diffusers' ``GEGLU.forward`` in this process
with a one-pass Triton kernel (``a * gelu(g)`` read from the projection once) and times graph replays with and
without it. Usage (device machine, pack importable): python scripts/diag/geglu_probe.py; writes
$OUT/geglu_probe.json (``fused`` is importable: nothing runs on import). Session 5 (H100): 43.0 -> 39.5 ms per
image-step at one image, 35.9 -> 33.2 at eight.
"""
import json, os, gc
import torch, triton, triton.language as tl
from diffusers.models.activations import GEGLU
from leandiffusion.bench.models import full_unet, unet_inputs
OUT = os.environ.get("OUT", "/tmp"); dev = torch.device("cuda"); res = {}
def rec(k, v):
    res[k] = v; print(k, v, flush=True); json.dump(res, open(f"{OUT}/geglu_probe.json", "w"), indent=1)

@triton.jit
def _geglu(p_ptr, o_ptr, total, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < total
    row = offs // N; col = offs - row * N
    a = tl.load(p_ptr + row * 2 * N + col, mask=m).to(tl.float32)
    g = tl.load(p_ptr + row * 2 * N + N + col, mask=m).to(tl.float32)
    ge = (g * 0.5 * (1.0 + tl.math.erf(g * 0.7071067811865476))).to(o_ptr.dtype.element_ty).to(tl.float32)
    tl.store(o_ptr + offs, (a * ge).to(o_ptr.dtype.element_ty), mask=m)

def fused(self, hidden_states, *args, **kwargs):
    p = self.proj(hidden_states)
    n = p.shape[-1] // 2
    out = torch.empty(p.shape[:-1] + (n,), device=p.device, dtype=p.dtype)
    total = out.numel()
    _geglu[(triton.cdiv(total, 2048),)](p, out, total, n, BLOCK=2048, num_warps=8)
    return out

from diag_timing import graph_of, timed


def main():
    unet = full_unet("sdxl", device=dev)
    # kernel vs torch on a real-sized tensor: bitwise?
    p = torch.randn(2, 4096, 5120, device=dev, dtype=torch.float16) * 3
    a, g = p.chunk(2, dim=-1); ref = a * torch.nn.functional.gelu(g)
    class _M: proj = staticmethod(lambda x: x)
    ours = fused(_M(), p)
    rec("kernel_vs_torch", {"max_abs": (ours.float() - ref.float()).abs().max().item(),
                            "n_diff": int((ours != ref).sum()),
                            "numel": ref.numel()})
    orig = GEGLU.forward
    with torch.no_grad():
        for B in (1, 8):
            inp = unet_inputs("sdxl", 2 * B, 128, device=dev)
            for name in ("native", "fused", "native2"):
                GEGLU.forward = fused if name == "fused" else orig
                gr, out = graph_of(lambda: unet(**inp, return_dict=False)[0])
                ms = timed(gr.replay, 10 if B == 1 else 4)
                rec(f"B{B}_{name}", {"ms_per_image": round(ms / B, 2), "out_absmax": out.abs().max().item()})
                if name == "native": ref_out = out.clone()
                if name == "fused":
                    rec(f"B{B}_fused_vs_native", {"max_abs": (out.float() - ref_out.float()).abs().max().item()})
                del gr, out; gc.collect(); torch.cuda.empty_cache()
            GEGLU.forward = orig


if __name__ == "__main__":
    main()

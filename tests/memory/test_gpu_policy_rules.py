"""The VRAM policies' CUDA-only rules (``memory/policies.py``), which a CPU run cannot reach (``-m gpu``).

On the CPU the VAE is always fp32 and every stage's device is the CPU, so two rules only show on a GPU:
- the VAE's default dtype: fp32 where the family's VAE overflows in fp16 (SDXL) *and* the weights are fp16; bf16
  weights keep a bf16 VAE (bf16 has fp32's range), and a family whose VAE does not overflow follows the weights;
- ``lowvram`` encodes text on the CPU in fp32: the text encoders stay off the GPU and the embeddings equal the
  fp32 ``full`` placement's, delivered on the GPU in the weight dtype.
"""
import pytest
import torch

from leandiffusion.memory import load
from leandiffusion.memory.engine import modules_of_stage
from leandiffusion.sampling.prompt_encoder import encode_texts
from leandiffusion.tests.kit import tiny_parts

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family, weight_dtype, expected", [
    ("sdxl", "fp16", torch.float32), ("sdxl", "bf16", torch.bfloat16), ("sdxl", "fp32", torch.float32),
    ("sd1", "fp16", torch.float16), ("sd1", "bf16", torch.bfloat16)])
def test_default_vae_dtype_on_cuda(family, weight_dtype, expected):
    engine = load.build_engine(tiny_parts(family), "full", weight_dtype=weight_dtype, device="cuda")
    try:
        assert engine.vae_dtype == expected
        with engine.session("vae") as live:
            dtypes = {p.dtype for p in live.parts.vae.parameters()}
            devices = {p.device.type for p in live.parts.vae.parameters()}
        assert dtypes == {expected} and devices == {"cuda"}
    finally:
        engine.placement.release()


def test_lowvram_encodes_text_on_the_cpu_in_fp32():
    low = load.build_engine(tiny_parts("sd1"), "lowvram", device="cuda")
    ref = load.build_engine(tiny_parts("sd1"), "full", weight_dtype="fp32", device="cuda")
    try:
        assert low.stage_device("text") == torch.device("cpu")
        assert low.stage_device("unet").type == "cuda"
        got = encode_texts(low, ["a lighthouse at dusk"], cache=None)[0]
        for module in modules_of_stage(low.parts, "text"):
            assert {p.device.type for p in module.parameters()} == {"cpu"}
            assert {p.dtype for p in module.parameters()} == {torch.float32}
        want = encode_texts(ref, ["a lighthouse at dusk"], cache=None)[0]
        assert got.context.device.type == "cuda" and got.context.dtype == low.dtype == torch.float16
        # the CPU fp32 encode rounded once to fp16, against the GPU's fp32 encode rounded once: <= 1 fp16 ulp apart
        diff = (got.context.float() - want.context.float()).abs()
        assert diff.max().item() <= 2e-3 * max(1.0, want.context.abs().max().item())
    finally:
        low.placement.release()
        ref.placement.release()

"""GPU: the Qwen-Image step captured in a real CUDA graph (``CudaGraphBackend``), tiny random model in bf16.

Guards: a captured step that reads or writes outside its static buffers, or syncs with the host (the capture fails
or a replay differs from the eager step: ``cuda_graph`` must equal ``none`` bit for bit, since both run the same
kernels on the same buffers); another seed of the same prompt recapturing instead of replaying, or a prompt of
other token counts replaying instead of capturing (each must give its own eager latent); ``compile+cuda_graph``
(inductor over every ``QwenImageTransformerBlock``) drifting beyond bf16 rounding; ``fp8_e4m3fn_fast`` (fp8
tensor-core GEMMs, captured and compiled too, its MLPs' GELU fused with their per-row quantization) failing on
Qwen-Image or moving far from bf16. The references are the eager program (bit equality) and the bf16 eager latent
(tolerances).
"""
import pytest
import torch

from leandiffusion.sampling.flow.settings import FlowSettings
from leandiffusion.sampling.graph_runner import GraphRunner
from leandiffusion.sampling.qwen import accel
from leandiffusion.sampling.qwen.loop import sample_qwen_image

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

COMPILE_REL = 2e-2  # bf16: inductor fuses differently; a wrong block is O(1) away
FP8_REL = 0.1  # fp8 activations and weights against bf16 (the CPU test measures storage alone at 0.04)
# inductor quantizes each fp8 layer's input in fp32 where eager rounds it to bf16 first: a few fp8 values a step off,
# which this tiny model's four guided steps amplify (measured 5.9e-2 on an H200); a wrong block is O(1) away
FP8_COMPILE_REL = 0.1


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module")
def engine(load_qwen_gpu):
    return load_qwen_gpu("bf16")


@pytest.fixture(scope="module")
def load_qwen_gpu(qwen_folder):
    from leandiffusion.memory.load import load_engine

    def load(weight_dtype):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("LEANDIFFUSION_MODELS", str(qwen_folder.parent.parent))
            return load_engine(qwen_folder.name, "full", weight_dtype=weight_dtype, device="cuda")

    return load


def _run(engine, prompt="a red cat", acceleration="cuda_graph", runner=None, seed=1):
    settings = FlowSettings(prompt, "blurry, dark", seed=seed, steps=4, cfg=4.0, width=64, height=48, batch_size=2,
                            acceleration=acceleration)
    return sample_qwen_image(engine, settings, runner=runner, quiet=True)["samples"]


def test_cuda_graph_equals_eager_bit_for_bit_and_a_second_seed_replays(engine):
    runner = GraphRunner()
    for prompt, seed, captures in (("a red cat", 1, 1), ("a red cat", 2, 1), ("two green birds on a wire", 3, 2)):
        graph = _run(engine, prompt, runner=runner, seed=seed)
        eager = _run(engine, prompt, acceleration="none", seed=seed)
        assert torch.equal(graph, eager), (graph - eager).abs().max().item()
        assert eager.abs().max().item() > 0.5
        assert runner.captures(engine) == captures


def test_compile_cuda_graph_is_close_to_eager(engine):
    eager = _run(engine, acceleration="none")
    out = _run(engine, acceleration="compile+cuda_graph", runner=GraphRunner())
    assert engine.parts in accel._COMPILED  # the compiled regions ran, not a fallback
    assert _rel(out, eager) <= COMPILE_REL


def test_fp8_fast_captures_and_stays_near_bf16(engine, load_qwen_gpu):
    from leandiffusion.memory.fp8_weights import fp8_matmul_supported

    if not fp8_matmul_supported(torch.device("cuda")):
        pytest.skip("this GPU has no fp8 tensor cores")
    from leandiffusion.memory.fp8_feedforward import is_fused
    from leandiffusion.memory.fp8_matmul import rows_supported

    fast = load_qwen_gpu("fp8_e4m3fn_fast")
    fused = sum(is_fused(m) for m in fast.parts.unet.modules())
    assert fused == (2 * len(fast.parts.unet.transformer_blocks) if rows_supported("cuda") else 0)
    graph = _run(fast, runner=GraphRunner())
    assert torch.equal(graph, _run(fast, acceleration="none"))
    assert _rel(graph, _run(engine, acceleration="none")) <= FP8_REL
    compiled = _run(fast, acceleration="compile+cuda_graph", runner=GraphRunner())
    print(f"fp8_e4m3fn_fast compile+cuda_graph vs cuda_graph {_rel(compiled, graph):.2e}")
    assert _rel(compiled, graph) <= FP8_COMPILE_REL

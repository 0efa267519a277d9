"""Qwen-Image with its transformer stored in fp8 (``weight_dtype`` ``fp8_e4m3fn`` / ``fp8_e4m3fn_fast``), tiny
random model, CPU (compute in fp32 there).

Guards: nothing Z-Image-specific in the fp8 path blocking Qwen-Image (every Linear of the transformer converted and
run through its own ``__call__``: reaching a weight around the module would skip the fp8 matmul path, LoRA terms and
hooks); the fp8 latent against an independent reference, a plain engine whose Linear weights are replaced by their
e4m3fn round trip written in plain torch (``s = amax / 448``, ``round_e4m3fn(W / s) * s``); its distance from the
unquantized run (fp32 and bf16 weights) stated and bounded; ``fp8_e4m3fn_fast`` on a device without fp8 tensor cores
taking the dequantizing path (same latent); the CUDA-graph path (stand-in backend) equal to eager."""
import pytest
import torch

from leandiffusion.memory import fp8_weights as fp8
from leandiffusion.sampling.flow.settings import FlowSettings
from leandiffusion.sampling.graph_runner import GraphRunner
from leandiffusion.sampling.qwen.loop import sample_qwen_image
from leandiffusion.tests.kit.fp8_reference import rel_l2, round_trip_linears
from leandiffusion.tests.kit.graph_backend import StandInBackend

FULL_BOUND = 0.08  # relative L2 of the fp8 latent from the unquantized one (measured 0.031 fp32, 0.040 bf16;
#                    bf16 itself is 0.025 from fp32)


def _run(engine, acceleration="none"):
    settings = FlowSettings("a red cat on a wall", "blurry", seed=3, steps=3, cfg=4.0, width=32, height=48,
                            batch_size=2, acceleration=acceleration)
    runner = None if acceleration == "none" else GraphRunner(backend=StandInBackend())
    return sample_qwen_image(engine, settings, runner=runner, quiet=True)["samples"]


@pytest.fixture(scope="module")
def fp8_engine(load_qwen):
    return load_qwen(weight_dtype="fp8_e4m3fn")


@pytest.fixture(scope="module")
def fp8_latent(fp8_engine):
    return _run(fp8_engine)


def test_every_linear_is_fp8_and_runs_through_its_module(fp8_engine):
    layers = dict(fp8.fp8_layers(fp8_engine.parts.unet))
    linears = [n for n, m in fp8_engine.parts.unet.named_modules() if isinstance(m, torch.nn.Linear)]
    assert len(layers) == len(linears) > 30
    called = set()
    hooks = [m.register_forward_hook(lambda mod, args, out, name=name: called.add(name)) for name, m in layers.items()]
    try:
        _run(fp8_engine)
    finally:
        for h in hooks:
            h.remove()
    assert called == set(layers), sorted(set(layers) - called)


def test_fp8_latent_equals_the_dequantized_plain_model_and_stays_near_fp32_and_bf16(load_qwen, fp8_latent):
    dequantized = load_qwen(weight_dtype="fp32")
    round_trip_linears(dequantized.parts.unet)
    assert rel_l2(fp8_latent, _run(dequantized)) <= 1e-5
    fp32 = _run(load_qwen(weight_dtype="fp32"))
    bf16 = _run(load_qwen(weight_dtype="bf16"))
    assert 1e-3 < rel_l2(fp8_latent, fp32) <= FULL_BOUND  # really quantized, and within the stated distance
    assert rel_l2(fp8_latent, bf16) <= FULL_BOUND


def test_fast_falls_back_to_the_same_latent_without_fp8_tensor_cores(load_qwen, fp8_latent):
    assert torch.equal(_run(load_qwen(weight_dtype="fp8_e4m3fn_fast")), fp8_latent)


def test_graph_path_equals_eager_with_fp8(fp8_engine, fp8_latent):
    assert torch.equal(_run(fp8_engine, "cuda_graph"), fp8_latent)

"""The Fused Flow Sampler on a Z-Image DiT stored in fp8 (``weight_dtype="fp8_e4m3fn"``), tiny random model, fp32 CPU.

Guards: the lean blocks and the lean attention reaching a Linear's weights around the module (``F.linear(x,
layer.weight)`` would still compute, through the dequantizing ``weight`` property, but would skip LoRA terms, hooks
and the fp8 matmul path): every fp8 layer must run through its own ``__call__``; ``stream`` moving fp8 blocks
differently from ``full`` (on the CPU the same bytes give bit-identical latents); the CUDA-graph path (stand-in
backend) and the regional compile path (dynamo with the ``aot_eager`` backend, which traces the fp8 layers' byte
reinterpretation without needing a C++ compiler) changing the result. The fp8 latent is checked against an
independent reference, a plain fp32 engine whose Linear weights are replaced by their e4m3fn round trip written in
plain torch (``s = amax / 448``, ``round_e4m3fn(W / s) * s``; within 1e-5 relative), and its distance from the
unquantized fp32 run is stated: a few % (measured 0.029 for 2 steps at cfg 4), bounded by ``FP32_BOUND``.
"""
import pytest
import torch

from leandiffusion.memory import fp8_weights as fp8
from leandiffusion.memory.engine import parts_from_components
from leandiffusion.memory.load import build_engine
from leandiffusion.memory.policies import stream_working_minimum_gb
from leandiffusion.memory.tiny_zimage import build_tiny_zimage
from leandiffusion.sampling.flow import accel
from leandiffusion.sampling.flow.loop import sample_flow
from leandiffusion.sampling.flow.settings import FlowSettings
from leandiffusion.sampling.graph_runner import GraphRunner
from leandiffusion.tests.kit.fp8_reference import rel_l2, round_trip_linears
from leandiffusion.tests.kit.graph_backend import StandInBackend

FP32_BOUND = 0.08  # relative L2 of the fp8 latent from the fp32 latent (measured 0.029)


def _parts():
    return parts_from_components(build_tiny_zimage(seed=0))


def _run(engine, acceleration="cuda_graph"):
    settings = FlowSettings("a red cat on a wall", "blurry", seed=3, steps=2, cfg=4.0, width=32, height=48,
                            batch_size=2, acceleration=acceleration)
    runner = None if acceleration == "none" else GraphRunner(backend=StandInBackend())
    return sample_flow(engine, settings, runner=runner, quiet=True)["samples"]


@pytest.fixture(scope="module")
def fp8_full():
    return build_engine(_parts(), "full", weight_dtype="fp8_e4m3fn", device="cpu")


@pytest.fixture(scope="module")
def fp8_full_latent(fp8_full):
    return _run(fp8_full, "none")


def test_every_fp8_layer_runs_through_its_module(fp8_full):
    layers = dict(fp8.fp8_layers(fp8_full.parts.unet))
    assert len(layers) > 30  # every Linear of the tiny DiT (blocks, embedders, final layer)
    called = set()
    hooks = [m.register_forward_hook(lambda mod, args, out, name=name: called.add(name)) for name, m in layers.items()]
    try:
        _run(fp8_full)
    finally:
        for h in hooks:
            h.remove()
    assert called == set(layers), sorted(set(layers) - called)


def test_stream_equals_full_exactly_with_fp8(fp8_full_latent):
    parts = _parts()
    fp8.quantize_module(parts.unet, torch.float32)  # the budget is sized on the fp8 model: its working minimum
    engine = build_engine(parts, "stream", stream_working_minimum_gb(parts, "cpu"), weight_dtype="fp8_e4m3fn",
                          device="cpu")
    assert engine.placement.streamer.schedule.streamed  # blocks really stream
    assert torch.equal(_run(engine), fp8_full_latent)


def test_graph_and_compile_paths_equal_eager_with_fp8(fp8_full, fp8_full_latent, monkeypatch):
    assert torch.equal(_run(fp8_full), fp8_full_latent)
    monkeypatch.setattr(accel, "compile_options", lambda mode: {"backend": "aot_eager"})
    engine = build_engine(_parts(), "full", weight_dtype="fp8_e4m3fn", device="cpu")
    out = _run(engine, "compile+cuda_graph")
    assert engine.parts in accel._COMPILED  # the compiled regions ran, not an eager fallback
    assert rel_l2(out, fp8_full_latent) <= 1e-6


def test_fp8_latent_equals_the_dequantized_plain_model_and_stays_near_fp32(fp8_full_latent):
    fp32 = _run(build_engine(_parts(), "full", weight_dtype="fp32", device="cpu"), "none")
    parts = _parts()
    round_trip_linears(parts.unet, (torch.nn.Linear, torch.nn.Conv2d))
    dequantized = _run(build_engine(parts, "full", weight_dtype="fp32", device="cpu"), "none")
    assert rel_l2(fp8_full_latent, dequantized) <= 1e-5
    distance = rel_l2(fp8_full_latent, fp32)
    assert 1e-3 < distance <= FP32_BOUND, distance  # really quantized, and within the stated distance

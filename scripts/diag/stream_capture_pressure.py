"""Does the streamed SDXL UNet's output depend on how much memory is left under the ``stream`` budget's cap?

cuDNN / cuBLAS take another plan when a preferred plan's workspace cannot be allocated, so an eager call squeezed
under the cap may round differently from one with room. Builds the 4 GB ``stream`` engine (full-size SDXL, fp16,
random weights, batch 2 at 1024 px), compares eager before / after a CUDA-graph capture and the replay, then
repeats eager while a filler tensor leaves 1400 .. 320 MiB under the budget (RuntimeError: the filler itself did
not fit, OutOfMemoryError: the UNet did not). Sizes the capture test's tolerance in tests/memory/test_gpu_stream.py.
Usage (device, pack importable): python scripts/diag/stream_capture_pressure.py; writes $OUT/stream_capture_pressure.json.
"""
import torch

from diag_timing import Recorder
from leandiffusion.bench.models import full_unet, unet_inputs
from leandiffusion.memory.engine import parts_from_components
from leandiffusion.memory.load import build_engine
from leandiffusion.tests.kit import tiny_components

BUDGET_GB = 4.0
MiB = 2 ** 20
rec = Recorder("stream_capture_pressure.json")


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


unet = full_unet("sdxl", device="cuda", dtype=torch.float16).to("cpu")
torch.cuda.empty_cache()
inputs = unet_inputs("sdxl", batch=2, latent_hw=128, device="cuda", dtype=torch.float16)
components = tiny_components("sdxl")
components["unet"] = unet
engine = build_engine(parts_from_components(components, name="sdxl-random"), "stream", BUDGET_GB,
                      weight_dtype="fp16", vae_dtype="fp16", device="cuda")
static = {k: (v.clone() if torch.is_tensor(v) else {kk: vv.clone() for kk, vv in v.items()}) for k, v in inputs.items()}


def call():
    return engine.unet(static["sample"], static["timestep"], static["encoder_hidden_states"],
                       static["added_cond_kwargs"])


with engine.session("unet"), torch.no_grad():
    before = call().cpu()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    graph.replay()
    replay = captured.cpu()
    eager = call().cpu()
    out = {"eager_before_vs_after_capture": rel(before, eager), "replay_vs_eager": rel(replay, eager),
           "allocated_gib": torch.cuda.memory_allocated() / 2 ** 30}
    for left_mib in range(1400, 300, -20):
        try:
            torch.cuda.empty_cache()
            filler = torch.empty(int(BUDGET_GB * 2 ** 30 - torch.cuda.memory_allocated() - left_mib * MiB),
                                 dtype=torch.uint8, device="cuda")
            out[f"eager_with_{left_mib}MiB_left_vs_eager"] = rel(call().cpu(), eager)
        except Exception as exc:  # noqa: BLE001 - a probe: record what failed and go on
            out[f"eager_with_{left_mib}MiB_left_vs_eager"] = type(exc).__name__
        filler = None
    rec(f"stream_{BUDGET_GB}GB", out)
engine.placement.remove()

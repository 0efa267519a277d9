"""``compile+cuda_graph`` on a GPU where torch.compile cannot work falls back to ``cuda_graph`` with a warning.

Guards: inductor needs Triton to compile for a CUDA device; without it (ComfyUI on Windows: PyTorch's wheels bring
Triton only on Linux; requirements.txt does not list it) or on a GPU below compute capability 7.0 the first sampler
call failed ("Cannot find a working triton installation" / "too old to be supported by the triton GPU compiler")
instead of running the CUDA graph the user also asked for. Device properties are stubbed, so this runs on the CPU.
"""
import logging
from types import SimpleNamespace

import pytest
import torch

from leandiffusion.kernels import dispatch
from leandiffusion.memory.vram_budget import UNBUDGETED
from leandiffusion.sampling.loop import resolve_acceleration

COMPILE, GRAPH = "compile+cuda_graph", "cuda_graph"


def _engine(policy="full"):
    return SimpleNamespace(device=torch.device("cuda", 0), placement=SimpleNamespace(name=policy, budget=UNBUDGETED))


@pytest.mark.parametrize("triton, capability, expected", [
    (True, (9, 0), COMPILE),
    (True, (7, 0), COMPILE),
    (False, (9, 0), GRAPH),  # Triton not installed
    (True, (6, 1), GRAPH),   # Pascal
])
def test_compile_needs_a_usable_triton_on_cuda(monkeypatch, caplog, triton, capability, expected):
    monkeypatch.setattr(dispatch, "triton_importable", lambda: triton)
    monkeypatch.setattr(dispatch, "_capability", lambda index: capability)
    with caplog.at_level(logging.WARNING, logger="leandiffusion.sampling.loop"):
        assert resolve_acceleration(_engine(), COMPILE, None) == expected
    assert resolve_acceleration(_engine(), GRAPH, None) == GRAPH  # CUDA graphs need no Triton
    warned = [r.getMessage() for r in caplog.records if "using cuda_graph without compile" in r.getMessage()]
    assert len(warned) == (expected == GRAPH)
    if warned:
        assert ("not installed" in warned[0]) if not triton else ("6.1" in warned[0])

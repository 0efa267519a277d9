"""Shared pytest set-up: GPU and ComfyUI markers skip with a reason when their requirement is missing; every test
must leave the process-wide state as it found it (torch's numeric settings, the environment, loggers, ...: the pack
promises to set nothing process-wide outside its own scopes, and a leak makes later tests' results depend on the
order they run in)."""
import os
import time

import pytest
import torch

# The test process starts as a ComfyUI process is when the pack's first node runs: torch's compiler stack (ComfyUI
# imports it at start-up), transformers' CLIP and diffusers imported. Their imports change process-wide state
# (TORCHINDUCTOR_CACHE_DIR; sympy's, accelerate's, urllib3's and requests' warnings filters); imported here, that is
# not charged to whichever test imports them first by ``_process_state_unchanged``.
import torch._dynamo  # noqa: F401
import transformers.models.clip.modeling_clip  # noqa: F401
import diffusers  # noqa: F401


def pytest_collection_modifyitems(config, items):
    no_gpu = pytest.mark.skip(reason="needs a CUDA device")
    no_comfy = pytest.mark.skip(reason="needs COMFYUI_PATH pointing at a ComfyUI checkout")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        if "comfyui" in item.keywords and not os.environ.get("COMFYUI_PATH"):
            item.add_marker(no_comfy)


@pytest.fixture(scope="session", autouse=True)
def _torch_compiler_initialised():
    """torch's first compile sets process-wide state of its own, whoever asks for it (in ComfyUI: the first compiled
    model of any node): dynamo's first trace adds a warnings filter on PyTorch 2.4, and on CUDA the first Inductor
    compile sets TRITON_CACHE_DIR and TRITON_PTXAS_PATH in the environment and sys.recursionlimit 1000 -> 2000. One
    tiny compile of each kind here, before the first test, keeps that from being charged to whichever test compiles
    first by ``_process_state_unchanged``; anything a compile sets beyond that first initialisation still fails the
    test that did it.

    The CUDA compile multiplies by a constant unique to this process, so it is always compiled afresh: a graph
    served from Inductor's on-disk cache skips code generation, and with it the recursion limit and the Triton
    environment, so on a machine whose cache already holds the tiny graph (any earlier test process) every compiling
    test would fail that check while a fresh machine passes. Turning the caches off for the compile is not enough:
    Inductor then sets TRITON_CACHE_DIR only inside it."""
    torch.compile(lambda x: x * 2 + 1, backend="eager")(torch.ones(8))
    if torch.cuda.is_available():
        unique = float(os.getpid()) + time.time_ns() % 10**9 / 1e9
        torch.compile(lambda x: x * unique + 1)(torch.ones(8, device="cuda"))
        torch.cuda.synchronize()
    yield


@pytest.fixture
def strict_fp32():
    """IEEE fp32 matmuls and convolutions (no TF32) for the test; settings restored exactly after it."""
    from leandiffusion.tests.kit.precision import strict_fp32 as strict

    with strict():
        yield


@pytest.fixture
def opened_sessions(monkeypatch):
    """The stages of every ``LeanEngine.session`` opened during the test, in order (refusal tests expect none)."""
    from leandiffusion.memory.engine import LeanEngine

    opened = []
    real = LeanEngine.session

    def session(self, stage, *args, **kwargs):
        opened.append(stage)
        return real(self, stage, *args, **kwargs)

    monkeypatch.setattr(LeanEngine, "session", session)
    return opened


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _gpu_memory_isolation(request):
    """GPU tests start from a collected heap, no cuBLAS workspaces and an empty cache, so memory deltas (and what a
    budget leaves for kernel workspaces) depend only on the test itself."""
    if "gpu" in request.keywords and torch.cuda.is_available():
        import gc

        from leandiffusion.memory.cap import forget_library_workspaces

        gc.collect()
        # cuBLAS keeps a workspace per stream ever used: earlier tests' would hold memory a budgeted test counts
        forget_library_workspaces(torch.device("cuda", torch.cuda.current_device()))  # synchronises first
        torch.cuda.empty_cache()
    yield


@pytest.fixture(autouse=True)
def _process_state_unchanged(request):
    """Every test leaves the process-wide state of ``tests/kit/process_state.py`` as it found it: torch's numeric
    and kernel switches, autocast, grad/inference mode, thread counts, compiler configs, the environment, sys.path,
    the working folder, signal handlers, other loggers and warnings filters. A change is put back (so one leak
    fails one test, not every later one) and fails the test."""
    from leandiffusion.tests.kit import process_state

    before = process_state.snapshot()
    yield
    changed = process_state.changes(before, process_state.snapshot())
    if changed:
        process_state.restore(before)
        lines = "\n".join(f"  {name}: {old!r:.300} -> {new!r:.300}" for name, (old, new) in sorted(changed.items()))
        pytest.fail(f"{request.node.nodeid} left process-wide state changed (before -> after):\n{lines}",
                    pytrace=False)


FAKE_COMFYUI = os.path.join(os.path.dirname(__file__), "fixtures", "fake_comfyui.py")


@pytest.fixture
def fake_comfyui_dir(tmp_path, monkeypatch):
    """A ComfyUI folder whose main.py runs the fake server (tests/fixtures/fake_comfyui.py) for the runner's tests."""
    folder = tmp_path / "ComfyUI"
    folder.mkdir()
    (folder / "main.py").write_text(f"import runpy\nrunpy.run_path({FAKE_COMFYUI!r}, run_name='__main__')\n")
    monkeypatch.setenv("FAKE_COMFYUI_PIDFILE", str(tmp_path / "server.pid"))
    monkeypatch.delenv("COMFYUI_PYTHON", raising=False)
    return folder

"""CUDA-graph runner: capture once per key, replay otherwise; parity with the eager loop; CPU fallbacks.

On the CPU a stand-in backend (it "captures" by keeping the step callable) exercises the cache and key logic; the
``gpu`` tests capture real CUDA graphs and torch.compile the tiny UNet (fp16, within 5e-3 relative of eager).
Guards: a recapture per run (slow), a missing recapture when the shape/layout/adapter structure/weights change
(stale graph = wrong or crashing replay), a stale guidance scale or LoRA strength baked into a graph, a cache hit
for a LoRA view whose binding (the buffers the graph reads) was collected and made again elsewhere, graphs that
keep a collected model alive, a CPU run that fails instead of falling back, and a failed warm-up or capture that
leaves the caller's stream unjoined or its graph's pool pinned by a cuBLAS workspace.
"""
import contextlib
import gc
import logging
import weakref

import pytest
import torch

from leandiffusion.sampling.graph_runner import GraphRunner, weights_fingerprint
from leandiffusion.sampling.loop import sample
from leandiffusion.sampling.settings import SamplerSettings
from leandiffusion.tests.kit import tiny_engine
from leandiffusion.tests.kit.graph_backend import StandInBackend


class ScaleOutput:
    """An unmerged-LoRA stand-in: adds strength * 0.1 * conv_out(x); strength lives in a tensor it owns."""

    def __init__(self, strength, key="scale-out"):
        self.strength = torch.tensor(float(strength))
        self.graph_key = (key,)
        self._handle = None

    def to(self, device):
        self.strength = self.strength.to(device)
        return self

    def attach(self, parts):
        self._handle = parts.unet.conv_out.register_forward_hook(
            lambda mod, args, out: out + self.strength.to(out.dtype) * 0.1 * out)

    def detach(self, parts):
        self._handle.remove()


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("sd1")


def _settings(**kw):
    base = dict(positive="a boat", negative="rain", seed=11, steps=2, cfg=7.0, width=64, height=64,
                acceleration="cuda_graph")
    base.update(kw)
    return SamplerSettings(**base)


def _eager(engine, **kw):
    return sample(engine, _settings(acceleration="none", **kw), quiet=True)["samples"]


def test_capture_once_per_key_and_match_eager(engine):
    runner = GraphRunner(StandInBackend(), max_graphs=2)
    run = lambda **kw: sample(engine, _settings(**kw), runner=runner, quiet=True)["samples"]  # noqa: E731
    assert torch.equal(run(), _eager(engine))
    assert runner.captures(engine) == 1
    # seed, cfg, steps, spacing, denoise and the eta value change buffers only: no recapture
    for kw in (dict(seed=3), dict(steps=3), dict(timestep_spacing="trailing"), dict(denoise=0.5)):
        run(**kw)
    assert torch.equal(run(cfg=2.5, seed=4), _eager(engine, cfg=2.5, seed=4))
    assert runner.captures(engine) == 1
    run(eta=0.4)  # eta > 0 reads a noise buffer: new layout
    assert torch.equal(run(eta=0.9, seed=2), _eager(engine, eta=0.9, seed=2))
    assert runner.captures(engine) == 2
    assert torch.equal(run(cfg_mode="sequential"), _eager(engine, cfg_mode="sequential"))
    assert runner.captures(engine) == 3 and len(runner.cached_keys(engine)) == 2  # LRU of 2
    run(batch_size=2)
    run(width=72)
    assert runner.captures(engine) == 5


def test_adapter_structure_recaptures_strength_does_not(engine):
    runner = GraphRunner(StandInBackend(), max_graphs=4)
    run = lambda e: sample(e, _settings(), runner=runner, quiet=True)["samples"]  # noqa: E731
    base = run(engine)
    a = run(engine.with_adapter(ScaleOutput(1.0)))
    assert runner.captures(engine) == 2 and not torch.equal(a, base)
    b = run(engine.with_adapter(ScaleOutput(-2.0)))  # same graph_key, another strength
    assert runner.captures(engine) == 2
    assert torch.equal(b, _eager(engine.with_adapter(ScaleOutput(-2.0))))
    run(engine.with_adapter(ScaleOutput(1.0, key="other-target")))
    assert runner.captures(engine) == 3


class ShortOfMemoryBackend(StandInBackend):
    """Runs out of memory when capturing while another graph of the model is cached (a budget full of its pool)."""

    def __init__(self):
        self.runner, self.refused = None, 0

    def capture(self, fn, device):
        if any(entry.graphs for entry in self.runner._cache.values()):
            self.refused += 1
            raise torch.cuda.OutOfMemoryError("stand-in: the cached graph's pool fills the budget")
        return super().capture(fn, device)


def test_capture_short_of_memory_drops_the_other_graphs_and_captures_again(engine):
    backend = ShortOfMemoryBackend()
    runner = backend.runner = GraphRunner(backend, max_graphs=2)
    run = lambda **kw: sample(engine, _settings(**kw), runner=runner, quiet=True)["samples"]  # noqa: E731
    run()
    assert torch.equal(run(width=72), _eager(engine, width=72))
    assert backend.refused == 1
    assert len(runner.cached_keys(engine)) == 1  # the new shape's graph, captured on the second try
    assert runner.captures(engine) == 1  # (counted since the model's graphs were dropped)
    run(width=72)
    assert runner.captures(engine) == 1 and backend.refused == 1  # replayed


def test_capture_short_of_memory_alone_runs_eagerly(engine, caplog):
    class Never(StandInBackend):
        def capture(self, fn, device):
            raise torch.cuda.OutOfMemoryError("stand-in: no memory")

    runner = GraphRunner(Never())
    with caplog.at_level(logging.WARNING, logger="leandiffusion.sampling.loop"):
        out = sample(engine, _settings(), runner=runner, quiet=True)["samples"]
    assert torch.equal(out, _eager(engine))
    assert runner.cached_keys(engine) == [] and "running eagerly" in caplog.text


class _FakeCuda:
    """torch.cuda's streams and graphs as a log, so ``CudaGraphBackend`` runs on the CPU: the test sees the order in
    which the caller's stream joins the warm-up stream and cuBLAS's workspaces are forgotten."""

    def __init__(self, monkeypatch):
        from leandiffusion.sampling import graph_runner

        self.log = []
        self.capturing = False
        fake = self

        class Stream:
            def __init__(self, name):
                self.name = name

            def wait_stream(self, other):
                fake.log.append(f"{self.name} waits for {other.name}")

        class Graph:
            def replay(self):
                return None

        @contextlib.contextmanager
        def graph(g, **kwargs):
            self.capturing = True
            try:
                yield
            finally:
                self.capturing = False

        main, side = Stream("caller"), Stream("warm-up")
        monkeypatch.setattr(graph_runner, "shared_stream", lambda device, role: side)
        monkeypatch.setattr(graph_runner, "forget_library_workspaces", lambda device: self.log.append("forget"))
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)
        monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(torch.cuda, "graph", graph)


@pytest.mark.parametrize("fail_at", ["warm-up", "capture"])
def test_cuda_backend_failing_midway_leaves_the_stream_joined_and_no_workspace(monkeypatch, fail_at):
    """A warm-up step or the capture raising (out of memory) must not leave the caller's stream unordered after the
    warm-up kernels already queued (the sampler's retry or eager fallback reuses the step's buffers), nor cuBLAS
    holding a workspace from the failed graph's pool (32 MiB that would stay reserved)."""
    from leandiffusion.sampling.graph_runner import CudaGraphBackend

    cuda = _FakeCuda(monkeypatch)
    steps = []

    def step():
        steps.append("capture" if cuda.capturing else "warm-up")
        cuda.log.append(f"{steps[-1]} step")
        if steps[-1] == fail_at and (fail_at == "capture" or len(steps) == 2):
            raise torch.OutOfMemoryError("injected")

    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        CudaGraphBackend(warmup=2).capture(step, torch.device("cuda", 0))
    joined = ["warm-up waits for caller", "warm-up step", "warm-up step", "caller waits for warm-up"]
    assert cuda.log == (joined if fail_at == "warm-up" else joined + ["forget", "capture step", "forget"])
    cuda.log.clear()
    replay = CudaGraphBackend(warmup=2).capture(lambda: cuda.log.append("step"), torch.device("cuda", 0))
    assert callable(replay) and cuda.log == ["warm-up waits for caller", "step", "step", "caller waits for warm-up",
                                             "forget", "step"]


def test_budget_release_drops_this_models_graphs_only(engine):
    """``memory.budget`` asks every runner to drop a model's graphs when a budgeted stage needs their pools."""
    from leandiffusion.memory.budget import release_device_caches

    other = tiny_engine("sd1", seed=1)
    runner = GraphRunner(StandInBackend())
    sample(engine, _settings(), runner=runner, quiet=True)
    sample(other, _settings(), runner=runner, quiet=True)
    release_device_caches(engine.parts)
    assert runner.cached_keys(engine) == [] and len(runner.cached_keys(other)) == 1


def test_weights_fingerprint_tracks_moved_weights():
    unet = tiny_engine("sd1").parts.unet
    before = weights_fingerprint(unet)
    assert weights_fingerprint(unet) == before
    unet.conv_out.weight.data = unet.conv_out.weight.data.clone()  # what a placement that re-allocates does
    assert weights_fingerprint(unet) != before


def test_cache_does_not_keep_the_model_alive():
    runner = GraphRunner(StandInBackend())
    eng = tiny_engine("sd1")
    sample(eng, _settings(steps=1), runner=runner, quiet=True)
    assert runner.captures(eng) == 1
    ref = weakref.ref(eng.parts)
    del eng
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("acceleration", ["cuda_graph", "compile+cuda_graph"])
def test_cpu_falls_back_to_eager_with_a_note(engine, acceleration, caplog):
    with caplog.at_level(logging.INFO, logger="leandiffusion.sampling.loop"):
        out = sample(engine, _settings(acceleration=acceleration), quiet=True)["samples"]
    assert torch.equal(out, _eager(engine))
    assert "needs a CUDA device" in caplog.text


# ------------------------------------------------------------------------------------------------- GPU
def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module")
def gpu_engines():
    return {f: tiny_engine(f, device="cuda", dtype=torch.float16) for f in ("sd1", "sdxl")}


GPU_CASES = [("sd1", "cuda_graph", "batched", 0.0), ("sd1", "cuda_graph", "sequential", 0.5),
             ("sdxl", "cuda_graph", "batched", 0.5), ("sd1", "compile+cuda_graph", "batched", 0.0),
             ("sdxl", "compile+cuda_graph", "batched", 0.0)]  # one compile per family keeps the device time short


@pytest.fixture(scope="module")
def fp32_references():
    """fp32 eager latents on the CPU (same tiny weights, unrounded): the yardstick for fp16 rounding error."""
    engines = {f: tiny_engine(f) for f in ("sd1", "sdxl")}
    return lambda family, **kw: _eager(engines[family], **kw)


def _check_fp16(fast, eager, ref32, acceleration):
    """``cuda_graph`` replays the eager kernels: within 5e-3 of eager fp16 (in practice 0). ``compile`` generates
    other kernels (fused, reassociated fp16 sums), and on the tiny random models (latents reach ~80, far from the
    O(1) of real models) their rounding differences grow over the steps; so compiled fp16 must be no further from
    the fp32 result than eager fp16 is (x1.5, or 5e-3 when eager itself is that close). A wrong compiled graph (a
    dropped term, a stale input) is O(1) away and fails; fp32 compile-vs-eager is checked tightly below."""
    err_fast, err_eager = _rel(fast, ref32), _rel(eager, ref32)
    print(f"{acceleration}: rel vs eager fp16 {_rel(fast, eager):.3g}, vs fp32 eager: fast {err_fast:.3g}, "
          f"eager fp16 {err_eager:.3g}")
    if acceleration == "cuda_graph":
        assert _rel(fast, eager) <= 5e-3
    else:
        assert err_fast <= max(1.5 * err_eager, 5e-3), (err_fast, err_eager)


@pytest.mark.gpu
@pytest.mark.parametrize("family,acceleration,cfg_mode,eta", GPU_CASES)
def test_gpu_acceleration_matches_eager_fp16(gpu_engines, fp32_references, family, acceleration, cfg_mode, eta):
    eng = gpu_engines[family]
    s = dict(steps=6, cfg_mode=cfg_mode, eta=eta, batch_size=2)
    eager = _eager(eng, **s)
    runner = GraphRunner()
    fast = sample(eng, _settings(acceleration=acceleration, **s), runner=runner, quiet=True)["samples"]
    assert runner.captures(eng) == 1
    _check_fp16(fast, eager, fp32_references(family, **s), acceleration)
    again = sample(eng, _settings(acceleration=acceleration, cfg=3.0, seed=99, **s), runner=runner,
                   quiet=True)["samples"]
    assert runner.captures(eng) == 1, "cfg/seed changes must replay, not recapture"
    _check_fp16(again, _eager(eng, cfg=3.0, seed=99, **s), fp32_references(family, cfg=3.0, seed=99, **s),
                acceleration)


@pytest.mark.gpu
def test_gpu_compile_fp32_matches_eager_fp32(strict_fp32):
    """In fp32 (TF32 off for this test) the compiled graph computes the eager function: rel <= 1e-4 after 6 steps
    (fp32 reassociation is ~1e-6 per op). This separates a compile bug from fp16 rounding."""
    eng = tiny_engine("sd1", device="cuda", dtype=torch.float32)
    s = dict(steps=6, batch_size=2)
    eager = _eager(eng, **s)
    fast = sample(eng, _settings(acceleration="compile+cuda_graph", **s), runner=GraphRunner(), quiet=True)["samples"]
    print(f"fp32 compile vs eager: rel {_rel(fast, eager):.3g}")
    assert _rel(fast, eager) <= 1e-4


@pytest.mark.gpu
def test_gpu_lora_strength_change_needs_no_recapture(gpu_engines):
    eng = gpu_engines["sd1"]
    runner = GraphRunner()
    adapter = ScaleOutput(1.0).to("cuda")
    view = eng.with_adapter(adapter)
    first = sample(view, _settings(), runner=runner, quiet=True)["samples"]
    adapter.strength.fill_(-3.0)  # what the LoRA helper does at attach time: write into the persistent tensor
    second = sample(view, _settings(), runner=runner, quiet=True)["samples"]
    assert runner.captures(eng) == 1
    assert _rel(second, _eager(view)) <= 5e-3 and _rel(first, second) > 1e-2


@pytest.mark.gpu
def test_gpu_interrupt_leaves_graph_usable(gpu_engines):
    from leandiffusion import bridge

    eng = gpu_engines["sd1"]
    runner = GraphRunner()
    n = []

    def hook():
        n.append(1)
        if len(n) == 3:
            raise bridge.Interrupted("cancel")

    bridge.set_interrupt_hook(hook)
    try:
        with pytest.raises(bridge.Interrupted):
            sample(eng, _settings(steps=6), runner=runner, quiet=True)
    finally:
        bridge.set_interrupt_hook(None)
    out = sample(eng, _settings(steps=6), runner=runner, quiet=True)["samples"]
    assert runner.captures(eng) == 1
    assert _rel(out, _eager(eng, steps=6)) <= 5e-3


@pytest.mark.gpu
def test_gpu_graph_outlives_an_evicted_graph_and_released_workspaces(gpu_engines):
    """A graph captured after another was evicted must not bake in a cuBLAS workspace from the evicted graph's
    pool: once cuBLAS's workspaces and the cache are released (a budgeted Stream Scheduler run starts so), its
    replays would read freed memory (an illegal memory access on a full-size SDXL run)."""
    from leandiffusion.memory.cap import release_library_workspaces

    engine = gpu_engines["sdxl"]
    runner = GraphRunner(max_graphs=1)
    run = lambda **kw: sample(engine, _settings(**kw), runner=runner, quiet=True)["samples"]  # noqa: E731
    run(width=64)
    want = run(width=72)  # evicts the first graph
    release_library_workspaces(engine.device)
    got = run(width=72)  # replays the second
    torch.cuda.synchronize()
    assert runner.captures(engine) == 2 and torch.equal(got, want)


@pytest.mark.gpu
def test_gpu_failed_capture_leaves_no_memory_reserved():
    """A capture that raises (out of memory in the sampler's retry path) must not leave its graph's pool reserved:
    cuBLAS takes its workspace from that pool during the capture and keeps it (32 MiB) unless released."""
    from leandiffusion.sampling.graph_runner import CudaGraphBackend

    dev = torch.device("cuda", torch.cuda.current_device())
    a = torch.randn(2048, 2048, device=dev)
    out = {}

    def step():
        out["y"] = a @ a
        if torch.cuda.is_current_stream_capturing():
            raise torch.OutOfMemoryError("injected")

    before = torch.cuda.memory_reserved(dev)  # a collected heap, no workspaces (tests/conftest.py)
    try:
        CudaGraphBackend().capture(step, dev)
    except torch.OutOfMemoryError:
        pass  # the exception (and its frames, the graph among them) goes here
    else:
        raise AssertionError("the injected error did not propagate")
    out.clear()
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved(dev) == before


def test_compile_presets_name_real_inductor_options(monkeypatch):
    """A misspelt inductor option would only fail on the GPU at the first compile: check the names here."""
    import torch._inductor.config as inductor_config

    from leandiffusion.sampling import compile as comp

    for preset in comp._PRESETS.values():
        for name in preset.get("options", {}):
            obj = inductor_config
            for part in name.split("."):
                obj = getattr(obj, part)  # AttributeError names the unknown option
    monkeypatch.setenv("LEANDIFFUSION_COMPILE_MODE", "reduce-overhead")
    with pytest.raises(ValueError, match="LEANDIFFUSION_COMPILE_MODE"):
        comp.compile_mode()
    monkeypatch.setenv("LEANDIFFUSION_COMPILE_MODE", "tuned")
    assert comp.compile_mode() == "tuned"


@pytest.mark.gpu
def test_captures_warm_up_on_one_stream_per_device():
    from leandiffusion.sampling.shared_streams import shared_stream

    dev = torch.device("cuda")
    same = shared_stream(torch.device("cuda", torch.cuda.current_device()), "capture-warmup")
    assert shared_stream(dev, "capture-warmup") is same
    assert shared_stream(dev, "vae") is not same
    assert same != torch.cuda.current_stream(dev)


def test_cached_graph_keeps_the_lora_binding_it_reads(tmp_path):
    """A graph replays the addresses of the LoRA buffers attached at capture (factors, strength-scaled ``up_s``),
    while its key names the LoRA only by structure. When the view is dropped (ComfyUI drops a node's old output
    once its strength changes, before the injector runs again) and the same file is injected again, the new view
    must get the binding the graph was captured with; a new binding would put the buffers elsewhere and the
    cache hit would replay reads of freed memory (wrong image on a GPU). The sampler gets its conditioning from
    outside (as with CLIPTextEncode inputs), so no prompt-cache key keeps the first view's adapter alive."""
    from leandiffusion.lora import inject_lora
    from leandiffusion.sampling.cfg import encode_conditioning
    from leandiffusion.tests.lora import lorafiles as lf

    eng = tiny_engine("sd1")
    path = lf.write(lf.kohya_state_dict({"unet": eng.parts.unet}, {"unet": lf.ATTN_FF}), tmp_path / "l.safetensors")
    cond = encode_conditioning(eng, "a boat", "rain", 1, True, 64, 64)
    runner = GraphRunner(StandInBackend())
    run = lambda e: sample(e, _settings(), conditioning=cond, runner=runner, quiet=True)["samples"]  # noqa: E731

    view = inject_lora(eng, path, strength=1.0)
    run(view)
    captured = weakref.ref(view.adapters[0].binding)
    del view
    gc.collect()
    again = inject_lora(eng, path, strength=0.5)
    out = run(again)
    assert runner.captures(eng) == 1  # replayed: same structure, another strength
    assert again.adapters[0].binding is captured()  # ... so it must be the binding whose buffers the graph reads
    assert torch.equal(out, sample(again, _settings(acceleration="none"), conditioning=cond, quiet=True)["samples"])
    ref = weakref.ref(eng.parts)  # the bindings the cache keeps do not keep the model alive
    del eng, again
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("value", ["two", "0", "-1", "1.5"])
def test_a_bad_max_graphs_setting_names_the_variable(monkeypatch, value):
    """LEANDIFFUSION_MAX_GRAPHS=two is refused naming the variable, not with a bare ``invalid literal for int() with
    base 10: 'two'`` in every sampler run."""
    monkeypatch.setenv("LEANDIFFUSION_MAX_GRAPHS", value)
    with pytest.raises(ValueError, match=rf"LEANDIFFUSION_MAX_GRAPHS='{value}': expected a positive int \(CUDA graphs "
                                         r"cached per model, default 2\); set it to 1 or more, or unset it"):
        GraphRunner()


def test_max_graphs_setting_is_read(monkeypatch):
    monkeypatch.setenv("LEANDIFFUSION_MAX_GRAPHS", " 3 ")
    assert GraphRunner().max_graphs == 3
    monkeypatch.setenv("LEANDIFFUSION_MAX_GRAPHS", "")
    assert GraphRunner().max_graphs == 2


# The cache's LRU order and the key's weight / compile fields (the stand-in replays the step eagerly, so a stale key
# shows only in the capture count).
def test_the_least_recently_used_graph_is_evicted(engine):
    runner = GraphRunner(StandInBackend(), max_graphs=2)
    run = lambda width: sample(engine, _settings(width=width), runner=runner, quiet=True)  # noqa: E731
    run(64), run(72), run(64)  # 64 is now the most recently used
    assert runner.captures(engine) == 2
    run(80)  # evicts 72, the least recently used
    assert runner.captures(engine) == 3
    run(64)
    assert runner.captures(engine) == 3, "the most recently used graph was evicted"
    run(72)
    assert runner.captures(engine) == 4


def test_replaced_weights_capture_again():
    """A graph replays reads of the weights' addresses: weights replaced in place (a re-placement) must recapture."""
    eng = tiny_engine("sd1", seed=2)
    runner = GraphRunner(StandInBackend())
    sample(eng, _settings(), runner=runner, quiet=True)
    sample(eng, _settings(), runner=runner, quiet=True)
    assert runner.captures(eng) == 1
    eng.parts.unet.conv_out.weight.data = eng.parts.unet.conv_out.weight.data.clone()
    sample(eng, _settings(), runner=runner, quiet=True)
    assert runner.captures(eng) == 2


def test_weights_fingerprint_tracks_replaced_buffers():
    module = torch.nn.BatchNorm2d(4)
    before = weights_fingerprint(module)
    module.running_mean = module.running_mean.clone()
    assert weights_fingerprint(module) != before


def test_a_compiled_step_is_cached_apart_from_the_eager_one(engine, monkeypatch):
    """The compiled UNet's graph holds other kernels: ``compile+cuda_graph`` after ``cuda_graph`` (same shapes)
    captures again. The compiled UNet call is stubbed with the eager one (no inductor on the CPU test machine)."""
    from leandiffusion.sampling import loop

    monkeypatch.setattr(loop, "compiled_unet_fn", loop.eager_unet_fn)
    runner = GraphRunner(StandInBackend(), max_graphs=4)
    sample(engine, _settings(), runner=runner, quiet=True)
    sample(engine, _settings(acceleration="compile+cuda_graph"), runner=runner, quiet=True)
    assert runner.captures(engine) == 2
    sample(engine, _settings(acceleration="compile+cuda_graph"), runner=runner, quiet=True)
    assert runner.captures(engine) == 2

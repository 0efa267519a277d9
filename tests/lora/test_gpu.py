"""GPU: a CUDA graph captured inside a LoRA view's session follows strength changes on replay (no recapture),
in fp16, for unmerged and merged, for plain LoRA and LoHa / LoKr / DoRA files; the graph equals eager at every
strength. Skipped without CUDA.

The capture mirrors the sampler exactly: ``engine.session("unet")`` is entered first (adapters attach and write
their strength buffers *outside* any capture), then ``sampling.graph_runner.CudaGraphBackend.capture`` warms up
on a side stream and captures a step that reads only static device buffers (the timestep is a device tensor, as
``StepProgram.timestep`` is: a Python int would make diffusers build a CPU tensor and copy it during capture).
"""
import re

import pytest
import torch

from leandiffusion.lora import inject_lora
from leandiffusion.memory.engine import engine_from_parts, parts_from_components
from leandiffusion.sampling.graph_runner import CudaGraphBackend
from leandiffusion.tests.kit import tiny_components
from leandiffusion.tests.lora import lorafiles as lf

pytestmark = pytest.mark.gpu
FP16_REL = 2e-3


def _cuda_inputs(family):
    inputs = lf.unet_inputs(family)
    out = {"latents": inputs["latents"].cuda().half(), "context": inputs["context"].cuda().half(),
           "timestep": torch.tensor(inputs["timestep"], device="cuda", dtype=torch.int64)}
    if "added_cond_kwargs" in inputs:
        out["added_cond_kwargs"] = {k: v.cuda().half() for k, v in inputs["added_cond_kwargs"].items()}
    return out


def _call(view, inputs):
    return view.unet(inputs["latents"], inputs["timestep"], inputs["context"], inputs.get("added_cond_kwargs"))


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


UNET_ALL = re.compile(lf.ATTN_FF.pattern + "|" + lf.LOCON.pattern)


@pytest.mark.parametrize("family", ["sd1", "sdxl"])
@pytest.mark.parametrize("mode,strategy", [("unmerged", "hook"), ("unmerged", "geglu"), ("merged", "auto")])
@torch.no_grad()
def test_graph_replay_follows_strength(tmp_path, family, mode, strategy):
    c = tiny_components(family)
    sd = lf.kohya_state_dict({"unet": c["unet"]}, {"unet": UNET_ALL}, rank=4)
    _replay_follows_strength(tmp_path, c, sd, mode, strategy)


@pytest.mark.parametrize("family", ["sd1", "sdxl"])
@pytest.mark.parametrize("case", ["loha_lowrank", "loha_dense", "lokr_tucker", "lokr_both_lowrank", "dora_in",
                                  "dora_out", "locon_tucker"])
@pytest.mark.parametrize("mode", ["unmerged", "merged"])
@torch.no_grad()
def test_lycoris_graph_replay_follows_strength(tmp_path, family, case, mode):
    """LoHa (Khatri-Rao and dense), LoKr (Kronecker terms) and DoRA (dense terms from the live weight): the terms are
    capture-safe, and one captured graph replays every strength."""
    c = tiny_components(family)
    sd = lf.lycoris_case({"unet": c["unet"]}, {"unet": UNET_ALL}, case)
    replayed, base = _replay_follows_strength(tmp_path, c, sd, mode, "geglu" if mode == "unmerged" else "auto")
    # against fp32 on the CPU (checked there against the fp64 formulas): no further than fp16 puts the base model
    cpu = engine_from_parts(parts_from_components(tiny_components(family)))
    with inject_lora(cpu, tmp_path / "g.safetensors", 1.0, 1.0, mode=mode).session("unet"):
        ref = lf.run_unet(cpu.parts.unet, lf.unet_inputs(family)).cuda()
    base_ref = lf.run_unet(cpu.parts.unet, lf.unet_inputs(family)).cuda()
    assert _rel(replayed, ref) <= max(2 * _rel(base, base_ref), 2e-3)


def _replay_follows_strength(tmp_path, c, sd, mode, strategy):
    family = "sdxl" if "text_encoder_2" in c else "sd1"
    engine = engine_from_parts(parts_from_components(c), device="cuda", dtype=torch.float16,
                               vae_dtype=torch.float16)
    path = lf.write(sd, tmp_path / "g.safetensors")
    inputs = _cuda_inputs(family)
    views = [inject_lora(engine, path, s, 1.0, mode=mode, strategy=strategy) for s in (1.0, -0.7, 0.0)]
    assert len({v.adapters[0].graph_key for v in views}) == 1
    ptrs = [p.data_ptr() for p in engine.parts.unet.parameters()]
    static = {}

    def step():  # what StepProgram.step does: read static buffers, write a static output
        static["out"] = _call(views[0], inputs)

    with views[0].session("unet"):  # the sampler's order: session (attach) first, capture inside it
        replay = CudaGraphBackend(warmup=2).capture(step, torch.device("cuda"))
    out = static["out"]
    results = []
    for view in views + [views[0]]:
        with view.session("unet"):
            replay()
            torch.cuda.synchronize()
            replayed = out.clone()
            eager = _call(view, inputs)
        assert _rel(replayed, eager) <= FP16_REL
        results.append(replayed)
    with engine.session("unet"):
        base = _call(engine, inputs)
    assert _rel(results[0], base) > 1e-2  # the LoRA acts
    assert _rel(results[1], base) > 1e-2
    assert _rel(results[2], base) <= FP16_REL  # strength 0 (the same graph) gives the base model
    assert torch.equal(results[0], results[3])
    assert ptrs == [p.data_ptr() for p in engine.parts.unet.parameters()]
    return results[0], base


@pytest.mark.parametrize("mode", ["unmerged", "merged"])
@torch.no_grad()
def test_strength_write_inside_capture_is_refused(tmp_path, mode):
    """Entering a session with a new strength while a capture is running would bake the value into the graph."""
    c = tiny_components("sd1")
    engine = engine_from_parts(parts_from_components(c), device="cuda", dtype=torch.float16,
                               vae_dtype=torch.float16)
    sd = lf.kohya_state_dict({"unet": c["unet"]}, {"unet": lf.ATTN_FF}, rank=4)
    path = lf.write(sd, tmp_path / "g.safetensors")
    view = inject_lora(engine, path, 0.5, 1.0, mode=mode)
    graph = torch.cuda.CUDAGraph()
    x = torch.zeros(4, device="cuda")
    with pytest.raises(RuntimeError, match="capture"):
        with torch.cuda.graph(graph):
            x.add_(1)
            with view.session("unet"):
                pass
    with view.session("unet"):  # nothing left half-attached
        pass


@torch.no_grad()
def test_strategy_matches_hook_path_under_graph_replay(tmp_path, monkeypatch):
    """fp16, tiny SDXL-like UNet, LoRA on every attention/FF Linear and LoCon conv: the graph of the ``geglu``
    strategy replays what the hook path's graph replays (within fp16 rounding: the GEGLU terms are rounded at
    other points), and it really runs the Triton kernel (counted)."""
    strategy = "geglu"
    from leandiffusion.kernels import geglu_lora as gl

    c = tiny_components("sdxl")
    engine = engine_from_parts(parts_from_components(c), device="cuda", dtype=torch.float16,
                               vae_dtype=torch.float16)
    pattern = re.compile(lf.ATTN_FF.pattern + "|" + lf.LOCON.pattern)
    path = lf.write(lf.kohya_state_dict({"unet": c["unet"]}, {"unet": pattern}, rank=8), tmp_path / "s.safetensors")
    inputs = _cuda_inputs("sdxl")
    launches = []
    real = gl.geglu_lora_triton
    monkeypatch.setattr(gl, "geglu_lora_triton", lambda *a, **k: launches.append(1) or real(*a, **k))
    outs = {}
    for strat in ("hook", strategy):
        view = inject_lora(engine, path, 0.8, 1.0, strategy=strat)
        static = {}

        def step():
            static["out"] = _call(view, inputs)

        with view.session("unet"):
            where = set(view.adapters[0].binding.installed("unet"))
            assert where == ({"hook"} if strat == "hook" else {"hook", "override"})  # convs keep hooks
            replay = CudaGraphBackend(warmup=2).capture(step, torch.device("cuda"))
            replay()
            torch.cuda.synchronize()
            outs[strat] = static["out"].clone()
            eager = _call(view, inputs)
        assert _rel(outs[strat], eager) <= FP16_REL
    with engine.session("unet"):
        base = _call(engine, inputs)
    # yardstick: the same LoRA on the same (fp32, CPU) weights through the hook path. The strategies sum the terms
    # in another order, so in fp16 they may differ from the hook path by rounding; each must be no further from the
    # fp32 result than the fp16 hook path is (x2, or 2e-3). A dropped or doubled term is O(LoRA effect) away.
    ref_engine = engine_from_parts(parts_from_components(tiny_components("sdxl")))
    with inject_lora(ref_engine, path, 0.8, 1.0, strategy="hook").session("unet"):
        ref = lf.run_unet(ref_engine.parts.unet, lf.unet_inputs("sdxl")).cuda()
    err = {s: _rel(o, ref) for s, o in outs.items()}
    print(f"fp16 vs fp32 hook reference: {err}; hook vs base {_rel(outs['hook'], base):.3g}")
    assert _rel(outs["hook"], base) > 1e-2 and _rel(ref, base) > 1e-2
    assert err[strategy] <= max(2 * err["hook"], 2e-3)
    assert launches
    assert all("forward" not in m.__dict__ for m in engine.parts.unet.modules())


@torch.no_grad()
def test_capture_failing_between_siblings_then_eager_fallback_is_exact(tmp_path):
    """A k/v-only cross-attention LoRA (Custom Diffusion style) and a capture that runs out of memory between
    ``to_k`` and ``to_v``: the sampler runs the step eagerly in the same session, with the same context buffer (the
    loader's buffer pool). That run must equal an eager run, not reuse in ``to_k`` the shared down GEMM the failed
    capture recorded but never computed (the final latents then end far off)."""
    from leandiffusion.memory.load import build_engine
    from leandiffusion.sampling.graph_runner import GraphRunner
    from leandiffusion.sampling.loop import sample
    from leandiffusion.sampling.settings import SamplerSettings
    from leandiffusion.tests.kit import tiny_parts

    parts = tiny_parts("sd1")
    engine = build_engine(parts, "full", device="cuda")
    try:
        kv = re.compile(r"attn2\.(to_k|to_v)$")
        path = lf.write(lf.kohya_state_dict({"unet": parts.unet}, {"unet": kv}, rank=4), tmp_path / "kv.safetensors")
        view = inject_lora(engine, path, 1.0, 1.0)
        settings = dict(positive="a boat", negative="rain", seed=11, steps=4, cfg=7.0, width=64, height=64)
        want = sample(view, SamplerSettings(acceleration="none", **settings), quiet=True)["samples"]

        def short_of_memory_while_capturing(module, args):
            if torch.cuda.is_current_stream_capturing():
                raise torch.OutOfMemoryError("injected: out of memory during capture")

        to_v = next(m for n, m in parts.unet.named_modules() if n.endswith("attn2.to_v"))
        handle = to_v.register_forward_pre_hook(short_of_memory_while_capturing)
        runner = GraphRunner()
        try:
            got = sample(view, SamplerSettings(acceleration="cuda_graph", **settings), runner=runner,
                         quiet=True)["samples"]
        finally:
            handle.remove()
        assert runner.captures(engine) == 0  # the capture failed: this was the eager fallback
        assert torch.equal(got, want)
    finally:
        engine.placement.remove()


@torch.no_grad()
def test_compiled_sampler_swaps_lora_files_without_recompiling(tmp_path):
    """``compile+cuda_graph`` through the sampler: a second LoRA file with the same targets and ranks runs the code
    compiled for the first (dynamo compiles no new graph) in a capture of its own, and samples what eager sampling
    with that file gives (fp16 no further from the fp32 CPU result than eager fp16 is, as the sampler's compile
    tests bound it); switching back replays the first file's graph bit for bit."""
    from torch._dynamo.utils import counters

    from leandiffusion.sampling.graph_runner import GraphRunner
    from leandiffusion.sampling.loop import sample
    from leandiffusion.sampling.settings import SamplerSettings

    def settings(acceleration):
        return SamplerSettings(positive="a boat", negative="rain", seed=11, steps=3, cfg=7.0, width=64, height=64,
                               acceleration=acceleration)

    def views_of(engine):
        return [inject_lora(engine, p, 1.0, 1.0) for p in paths]

    c = tiny_components("sd1")
    paths = [lf.write(lf.kohya_state_dict({"unet": c["unet"]}, {"unet": lf.ATTN_FF}, rank=4, seed=s),
                      tmp_path / f"l{s}.safetensors") for s in (0, 1)]
    engine = engine_from_parts(parts_from_components(c), device="cuda", dtype=torch.float16,
                               vae_dtype=torch.float16)
    refs = [sample(v, settings("none"), quiet=True)["samples"]
            for v in views_of(engine_from_parts(parts_from_components(tiny_components("sd1"))))]
    rel = lambda a, b: ((a.cpu().double() - b.cpu().double()).norm() / b.cpu().double().norm()).item()  # noqa: E731
    torch._dynamo.reset()
    counters.clear()
    runner, outs, graphs = GraphRunner(), [], []
    views = views_of(engine)
    for i, view in enumerate(views + views[:1]):
        outs.append(sample(view, settings("compile+cuda_graph"), runner=runner, quiet=True)["samples"])
        graphs.append(counters["stats"]["unique_graphs"])
        eager = sample(view, settings("none"), quiet=True)["samples"]
        ref = refs[i % 2]
        assert rel(outs[-1], ref) <= max(1.5 * rel(eager, ref), 5e-3), (i, rel(outs[-1], ref), rel(eager, ref))
    assert graphs[0] >= 1 and graphs == [graphs[0]] * 3, graphs
    assert runner.captures(engine) == 2  # one capture per file; the first file's graph is still cached
    assert rel(outs[0], outs[1]) > 1e-2 and torch.equal(outs[0], outs[2])
    torch._dynamo.reset()

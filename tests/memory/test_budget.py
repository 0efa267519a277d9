"""``memory.budget``: under the ``stream`` policy the budget caps every stage of every node, and a text or VAE stage
releases cached CUDA graphs that would leave it no room.

On the CPU nothing is capped (checked on real engines). The CUDA paths run against stand-ins for CUDA's memory
counters (``fake_cuda``: allocated / reserved bytes the test sets, ``empty_cache`` returning the cached blocks)
and a recording ``allocator_cap``, so the arithmetic and the order of events are checked without a GPU; the GPU
test ``tests/memory/test_gpu_budget.py`` measures the real peaks.
"""
import contextlib
from types import SimpleNamespace

import pytest
import torch

from leandiffusion.memory import budget, placement as placement_mod
from leandiffusion.memory.hostmem import ModuleSwap
from leandiffusion.memory.load import build_engine
from leandiffusion.memory.vram_budget import HEADROOM, StageMode, VramBudget
from leandiffusion.tests.kit import tiny_engine, tiny_parts

MiB, GiB = 2 ** 20, 2 ** 30


@pytest.fixture(scope="module")
def budgeted():
    return build_engine(tiny_parts("sd1"), "stream", 1.0, device="cpu", weight_dtype="fp32", vae_dtype="fp32")


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA's memory counters as numbers: ``ours`` (the engine's storages), ``allocated``, ``reserved`` and
    ``cached`` (free cached blocks, part of ``reserved``, returned by ``empty_cache``); caps are recorded."""
    state = SimpleNamespace(ours=0, allocated=0, reserved=0, cached=0, caps=[])

    def empty_cache():
        state.reserved -= state.cached
        state.cached = 0

    @contextlib.contextmanager
    def recording_cap(device, cap_bytes):
        state.caps.append(("open", cap_bytes))
        try:
            yield True
        finally:
            state.caps.append(("close", cap_bytes))

    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: state.allocated)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: state.reserved)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(budget, "allocator_cap", recording_cap)
    monkeypatch.setattr(budget, "engine_device_bytes", lambda placement, device: state.ours)
    return state


class Parts:
    """Stands in for a model's ``ModelParts`` (the registry keys on it)."""
    name = "stand-in"


def _placement(budget_bytes=2 * GiB, vae=StageMode.WHILE_USED, vae_bytes=300 * MiB, text=StageMode.CPU,
               text_bytes=500 * MiB):
    hard = VramBudget(limit_bytes=budget_bytes, headroom_bytes=int(HEADROOM * budget_bytes), vae=vae,
                      vae_bytes=vae_bytes, text=text, text_bytes=text_bytes, unet=StageMode.STREAM)
    return SimpleNamespace(budget=hard, device=torch.device("cuda", 0), parts=Parts(), streamer=None)


class GraphCache:
    """A registered device cache holding ``nbytes`` of graph pools for one model until released."""

    def __init__(self, state, parts, nbytes):
        self.state, self.parts, self.nbytes, self.released = state, parts, nbytes, []
        state.reserved += nbytes
        budget.register_device_cache(self)

    def release_device_memory(self, parts):
        self.released.append(parts)
        if parts is self.parts and self.nbytes:
            self.state.reserved -= self.nbytes
            self.nbytes = 0


# --------------------------------------------------------------------------------------------- no budget
def test_cpu_and_unbudgeted_engines_are_not_capped(budgeted):
    assert budgeted.placement.budget.hard
    assert not tiny_engine("sd1").placement.budget.hard
    assert not build_engine(tiny_parts("sd1"), "balanced", 1.0, device="cpu").placement.budget.hard
    for engine in (budgeted, tiny_engine("sd1")):
        assert budget.run_cap_bytes(engine) == budget.NO_CAP
        assert budget.room_bytes(engine) is None
        with budget.stage_budget(engine.placement, "vae") as cap:
            assert cap == budget.NO_CAP


def test_a_balanced_plan_on_cuda_is_not_capped(fake_cuda):
    placement = _placement()
    placement.budget = VramBudget(vae=StageMode.WHILE_USED, text=StageMode.WHILE_USED)  # balanced: no limit
    with budget.stage_budget(placement, "vae") as cap:
        assert cap == budget.NO_CAP
    assert fake_cuda.caps == []


# --------------------------------------------------------------------------------------------- the cap
def test_cap_is_the_budget_plus_what_others_hold(fake_cuda):
    placement = _placement()
    small = budget.SMALL_OTHERS_BYTES
    fake_cuda.ours = 700 * MiB
    fake_cuda.allocated = 700 * MiB + small + 5 * MiB
    assert budget.cap_bytes(placement) == 2 * GiB + 5 * MiB  # another model's 5 MiB beyond the slack
    fake_cuda.allocated = 700 * MiB + small // 2
    assert budget.cap_bytes(placement) == 2 * GiB  # workspaces and small buffers count as the engine's
    fake_cuda.allocated = 600 * MiB
    assert budget.cap_bytes(placement) == 2 * GiB
    engine = SimpleNamespace(device=torch.device("cuda", 0), placement=placement)
    assert budget.run_cap_bytes(engine) == 2 * GiB


def test_every_stage_runs_under_the_cap_and_restores_it(fake_cuda):
    placement = _placement()
    for stage in ("text", "unet", "vae"):
        fake_cuda.caps.clear()
        with budget.stage_budget(placement, stage) as cap:
            assert cap == 2 * GiB and fake_cuda.caps == [("open", 2 * GiB)]
        assert fake_cuda.caps == [("open", 2 * GiB), ("close", 2 * GiB)]


def test_room_is_the_cap_less_headroom_less_what_stays_reserved(fake_cuda):
    placement = _placement()
    engine = SimpleNamespace(device=torch.device("cuda", 0), placement=placement)
    fake_cuda.reserved, fake_cuda.cached = 1500 * MiB, 400 * MiB  # 400 MiB of it is cached, free blocks
    assert budget.room_bytes(engine) == 2 * GiB - int(HEADROOM * 2 * GiB) - 1100 * MiB
    assert budget.room_bytes(engine, cap=1 * GiB) == 1 * GiB - int(HEADROOM * 2 * GiB) - 1100 * MiB


# --------------------------------------------------------------------------------------------- making room
def test_vae_stage_releases_cached_graphs_when_their_pools_leave_no_room(fake_cuda):
    """2 GiB budget: 1.0 GiB of weights + a 0.6 GiB graph pool; the VAE needs 300 MiB + the 512 MiB floor."""
    placement = _placement()
    fake_cuda.reserved = 1 * GiB
    graphs = GraphCache(fake_cuda, placement.parts, 600 * MiB)
    other_model = GraphCache(fake_cuda, Parts(), 100 * MiB)
    with budget.stage_budget(placement, "vae"):
        assert graphs.released == [placement.parts] and graphs.nbytes == 0
        assert other_model.nbytes == 100 * MiB  # another model's graphs are not this engine's to drop
    assert fake_cuda.reserved == 1 * GiB + 100 * MiB


def test_text_stage_releases_cached_graphs_when_its_weights_would_not_fit(fake_cuda):
    """2 GiB budget: 1.0 GiB held + a 0.6 GiB graph pool; the text encoders bring 500 MiB + the 128 MiB floor onto
    the device (0.63 GiB > the 0.4 GiB left), so the text stage, not only the VAE's, drops the graphs first."""
    placement = _placement(text=StageMode.WHILE_USED)
    fake_cuda.reserved = 1 * GiB
    graphs = GraphCache(fake_cuda, placement.parts, 600 * MiB)
    with budget.stage_budget(placement, "text"):
        assert graphs.released == [placement.parts] and graphs.nbytes == 0
    assert fake_cuda.reserved == 1 * GiB


@pytest.mark.parametrize("stage, budget_bytes", [
    ("vae", 4 * GiB),  # the VAE finds room beside them
    ("unet", 1 * GiB),  # short of room, but the UNet stage replays them
])
def test_stage_keeps_cached_graphs(fake_cuda, stage, budget_bytes):
    placement = _placement(budget_bytes=budget_bytes)
    fake_cuda.reserved = 1 * GiB
    graphs = GraphCache(fake_cuda, placement.parts, 600 * MiB)
    with budget.stage_budget(placement, stage):
        pass
    assert graphs.released == [] and graphs.nbytes == 600 * MiB


def test_the_boundary_counts_weights_floor_and_headroom(fake_cuda):
    placement = _placement()
    limit = 2 * GiB - int(HEADROOM * 2 * GiB)
    need = 300 * MiB + budget.STAGE_FLOOR_BYTES["vae"]
    fake_cuda.reserved = limit - need  # exactly fits: kept
    assert budget.make_room(placement, "vae", 2 * GiB) is False
    fake_cuda.reserved += 1  # one byte over: released
    assert budget.make_room(placement, "vae", 2 * GiB) is True


def test_text_stage_counts_its_weights_only_when_they_come_to_the_device(fake_cuda):
    on_cpu, on_device = _placement(text=StageMode.CPU), _placement(text=StageMode.WHILE_USED)
    fake_cuda.reserved = 2 * GiB - int(HEADROOM * 2 * GiB) - budget.STAGE_FLOOR_BYTES["text"] - 100 * MiB
    assert budget.make_room(on_cpu, "text", 2 * GiB) is False
    assert budget.make_room(on_device, "text", 2 * GiB) is True  # its 500 MiB of weights do not fit


def _zimage_text_placement(text_activation_bytes, text_arena_bytes=400 * MiB):
    """A placement stand-in streaming the tiny Z-Image's Qwen3 encoder under a 2 GiB budget."""
    from leandiffusion.memory.engine import parts_from_components
    from leandiffusion.memory.tiny_zimage import build_tiny_zimage

    hard = VramBudget(limit_bytes=2 * GiB, text=StageMode.STREAM, text_arena_bytes=text_arena_bytes,
                      text_activation_bytes=text_activation_bytes, unet=StageMode.STREAM)
    return SimpleNamespace(budget=hard, device=torch.device("cuda", 0), streamer=None, text_dtype=torch.bfloat16,
                           parts=parts_from_components(build_tiny_zimage(seed=0)))


def test_text_activation_at_uses_the_plans_formula_at_the_calls_shape():
    from leandiffusion.memory.text_units import TEXT_WORKSPACE_CUDA, text_activation_bytes

    placement = _zimage_text_placement(1 * GiB)
    encoder = placement.parts.text_encoder
    cfg = encoder.config
    layers, hidden, kv = len(encoder.layers), cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
    per_token = (layers + 1) * hidden + layers * 2 * kv + 3 * cfg.intermediate_size + 2 * hidden  # docstring
    assert budget.text_activation_at(placement, (2, 40)) == int(1.3 * 2 * 40 * per_token * 2) + TEXT_WORKSPACE_CUDA
    assert budget.text_activation_at(placement, (2, 40)) == text_activation_bytes(encoder, 2, 40, 2, "cuda")
    assert budget.text_activation_at(placement, None) is None
    assert budget.text_activation_at(_placement(), (1, 40)) is None  # no decoder-only encoder to size


def test_a_short_prompt_keeps_the_graphs_where_the_plans_longest_would_not_fit(fake_cuda):
    """2 GiB budget, 768 MiB held + a 400 MiB graph pool (880 MiB left): the text stage brings its 400 MiB ring and
    the 128 MiB floor. With the plan's 1 GiB activation estimate it must drop the graphs; told a 2 x 40-token call
    (the formula's 256 MiB workspace and under 1 MiB of activations for the tiny encoder) it keeps them; a shape
    that sizes above the plan's estimate counts the estimate."""
    big = _zimage_text_placement(1 * GiB)
    fake_cuda.reserved = 768 * MiB
    graphs = GraphCache(fake_cuda, big.parts, 400 * MiB)
    assert budget.make_room(big, "text", 2 * GiB, text_shape=(2, 40)) is False
    assert graphs.nbytes == 400 * MiB
    assert budget.make_room(big, "text", 2 * GiB) is True and graphs.nbytes == 0
    small = _zimage_text_placement(10 * MiB)  # the plan's estimate is the ceiling: the call's larger one is not used
    assert small.budget.entering_bytes("text", budget.text_activation_at(small, (2, 40))) == 410 * MiB


def test_the_flow_prompt_encoder_tells_the_stage_its_shape_and_retries_without_graphs(monkeypatch):
    """``encode_prompts`` opens the text stage with ``(prompts, tokens)`` of its call; an out-of-memory under a hard
    budget releases the model's cached graphs and encodes again (plan-sized), with the same result."""
    from leandiffusion.memory.engine import parts_from_components
    from leandiffusion.memory.tiny_zimage import build_tiny_zimage
    from leandiffusion.sampling.flow import text

    engine = build_engine(parts_from_components(build_tiny_zimage(seed=0)), "full", device="cpu")
    want = text.encode_prompts(engine, ["a red cat", "a much longer prompt about a dog"])
    shapes, released = [], []
    session = type(engine).session

    def failing_once(self, stage, text_shape=None):
        shapes.append(text_shape)
        if len(shapes) == 1:
            raise torch.cuda.OutOfMemoryError("out of memory under the cap")
        return session(self, stage, text_shape)

    monkeypatch.setattr(type(engine), "session", failing_once)
    monkeypatch.setattr(text, "release_device_caches", released.append)
    with pytest.raises(torch.cuda.OutOfMemoryError):  # no hard budget: nothing to release, the error stands
        text.encode_prompts(engine, ["a red cat", "a much longer prompt about a dog"])
    tokens = engine.parts.tokenizer([text.chat_text("a much longer prompt about a dog")]).input_ids[0]
    assert shapes == [(2, len(tokens))] and released == []
    shapes.clear()
    monkeypatch.setattr(engine.placement, "budget", VramBudget(limit_bytes=GiB))
    got = text.encode_prompts(engine, ["a red cat", "a much longer prompt about a dog"])
    assert shapes == [(2, len(tokens)), None] and released == [engine.parts]
    assert all(torch.equal(g, w) for g, w in zip(got, want))


# --------------------------------------------------------------------------------------------- the placement
def _record_stage_budgets(monkeypatch) -> list:
    """Replace the placement's ``stage_budget`` by one that records each open and close."""
    events = []

    @contextlib.contextmanager
    def recording(placement, stage, text_shape=None):
        events.append(("open", stage))
        try:
            yield budget.NO_CAP
        finally:
            events.append(("close", stage))

    monkeypatch.setattr(placement_mod, "stage_budget", recording)
    return events


def test_sessions_open_and_close_the_stage_budget(budgeted, monkeypatch):
    events = _record_stage_budgets(monkeypatch)
    with budgeted.session("vae"):
        with budgeted.session("vae"):
            assert events == [("open", "vae"), ("open", "vae")]
        assert events[-1] == ("close", "vae")
    assert events == [("open", "vae"), ("open", "vae"), ("close", "vae"), ("close", "vae")]

    events.clear()
    with pytest.raises(RuntimeError, match="boom"):
        with budgeted.session("unet"):
            raise RuntimeError("boom")
    assert events == [("open", "unet"), ("close", "unet")]


def test_a_failed_onload_closes_the_stage_budget(budgeted, monkeypatch):
    events = _record_stage_budgets(monkeypatch)

    def failing_onload(self):
        raise RuntimeError("onload failed")

    monkeypatch.setattr(ModuleSwap, "onload", failing_onload)
    assert budgeted.placement._swaps.get("vae"), "the stream policy keeps the VAE on the device only while used"
    with pytest.raises(RuntimeError, match="onload failed"):
        with budgeted.session("vae"):
            pass
    assert events == [("open", "vae"), ("close", "vae")]
    assert not budgeted.placement._scopes.get("vae")


def test_an_eager_unet_run_releases_graphs_that_crowd_out_its_activations(fake_cuda):
    placement = _placement(budget_bytes=1536 * MiB)
    engine = SimpleNamespace(device=torch.device("cuda", 0), placement=placement)
    fake_cuda.reserved = 560 * MiB  # resident weights
    graphs = GraphCache(fake_cuda, placement.parts, 600 * MiB)
    assert budget.ensure_room(engine, 250 * MiB, "eager UNet run") is False  # 1410 MiB <= 1.5 GiB - 5%
    assert graphs.nbytes == 600 * MiB
    assert budget.ensure_room(engine, 900 * MiB, "eager UNet run") is True
    assert graphs.released == [placement.parts] and fake_cuda.reserved == 560 * MiB


def test_eager_sampling_under_a_budget_asks_for_room_and_graph_runs_do_not(budgeted, monkeypatch):
    from leandiffusion.sampling import loop
    from leandiffusion.sampling.graph_runner import GraphRunner
    from leandiffusion.sampling.settings import SamplerSettings
    from leandiffusion.tests.sampling.test_graph_runner import StandInBackend

    asked = []
    monkeypatch.setattr(loop, "ensure_room", lambda engine, need, what: asked.append((need, what)) or False)
    settings = dict(positive="a boat", negative="rain", seed=1, steps=1, cfg=5.0, width=64, height=64)
    loop.sample(budgeted, SamplerSettings(acceleration="none", **settings), quiet=True)
    assert asked == [(budgeted.placement.plan.unet_activation_bytes, "eager UNet run")]
    assert budgeted.placement.budget.activation_bytes == budgeted.placement.plan.unet_activation_bytes
    asked.clear()
    loop.sample(budgeted, SamplerSettings(acceleration="cuda_graph", **settings),
                runner=GraphRunner(StandInBackend()), quiet=True)
    assert asked == []


# --------------------------------------------------------------------------------------------- errors
class HintingPlacement:
    """Enter/exit do nothing; out-of-memory errors get the budget's advice."""

    def enter(self, engine, stage, text_shape=None):
        pass

    def exit(self, engine, stage):
        pass

    def out_of_memory_hint(self, stage):
        return f"raise vram_budget_gb ({stage})"


def test_an_out_of_memory_error_inside_a_budgeted_stage_names_the_budget_once():
    from leandiffusion.memory.engine import LeanEngine

    engine = LeanEngine(parts=tiny_engine("sd1").parts, device=torch.device("cpu"), placement=HintingPlacement())
    oom = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
    with pytest.raises(oom) as info:
        with engine.session("unet"), engine.session("unet"):
            raise oom("CUDA out of memory. Tried to allocate 40.00 MiB.")
    assert str(info.value) == "CUDA out of memory. Tried to allocate 40.00 MiB.\nraise vram_budget_gb (unet)"
    with pytest.raises(RuntimeError, match="^other$"):  # other errors pass untouched
        with engine.session("vae"):
            raise RuntimeError("other")


def test_the_stream_policy_hint_names_the_budget_and_the_fixes(budgeted):
    from leandiffusion.memory.policies import VramPolicy

    assert budgeted.placement.out_of_memory_hint("unet") is None  # on the CPU nothing is capped
    cuda = torch.device("cuda", 0)
    on_gpu = SimpleNamespace(config=SimpleNamespace(policy=VramPolicy.STREAM), device=cuda,
                             budget=VramBudget(limit_bytes=int(1.5 * GiB)))
    hint = placement_mod.ModelPlacement.out_of_memory_hint(on_gpu, "vae")
    assert "vram_budget_gb=1.5 GB" in hint and "vae stage" in hint and "raise vram_budget_gb" in hint
    for policy, suggestion in ((VramPolicy.FULL, "'balanced' or 'lowvram'"), (VramPolicy.BALANCED, "'lowvram'"),
                               (VramPolicy.LOWVRAM, "'stream' with a vram_budget_gb")):
        on_gpu.config.policy = policy
        hint = placement_mod.ModelPlacement.out_of_memory_hint(on_gpu, "unet")
        assert f"vram_policy='{policy.value}'" in hint and "unet stage" in hint, hint
        assert f"set vram_policy to {suggestion}" in hint, hint

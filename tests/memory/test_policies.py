"""VRAM policies on the tiny models (CPU): same UNet output as ``full``, planned peaks ordered, clear errors.

Guards the promises "every policy's UNet output equals full's output on the tiny model (CPU, fp32:
max abs diff <= 1e-5)", "a budget below the model's working minimum (the error states the minimum)", and the
promise that the ``stream`` schedule really streams (same code path as on CUDA, copies synchronous on the CPU).
"""
import pytest
import torch

from leandiffusion.memory.load import build_engine
from leandiffusion.memory.plan import GiB, module_bytes
from leandiffusion.memory.policies import apply_vram_policy, stream_working_minimum_gb
from leandiffusion.tests.kit import tiny_parts

TOL = 1e-5
POLICIES = ["full", "balanced", "lowvram", "stream", "auto"]


def _stream_budget(parts, fraction=0.3):
    """A budget that keeps ~``fraction`` of the UNet's block weights resident (the rest streams)."""
    return stream_working_minimum_gb(parts, "cpu") + fraction * module_bytes(parts.unet, torch.float32) / GiB


def _unet_call(engine, seed=1):
    g = torch.Generator().manual_seed(seed)
    cfg = engine.parts.unet.config
    x = torch.randn(2, 4, 8, 8, generator=g)
    ctx = torch.randn(2, 77, cfg.cross_attention_dim, generator=g)
    add = None
    if engine.parts.is_sdxl:
        add = {"text_embeds": torch.randn(2, 128, generator=g), "time_ids": engine.time_ids(64, 64, 2)}
    with engine.session("unet"), torch.no_grad():
        return engine.unet(x, torch.tensor(500), ctx, add)


def _engine(family, policy, budget=None):
    parts = tiny_parts(family)
    return build_engine(parts, policy, budget if budget is not None else (
        _stream_budget(parts) if policy == "stream" else 4.0), device="cpu")


@pytest.fixture(scope="module", params=["sd1", "sdxl"])
def reference(request):
    return request.param, _unet_call(_engine(request.param, "full"))


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_matches_full(reference, policy):
    family, ref = reference
    engine = _engine(family, policy)
    out = _unet_call(engine)
    assert (out - ref).abs().max().item() <= TOL
    out2 = _unet_call(engine)  # a second forward reuses the staging ring
    assert (out2 - ref).abs().max().item() <= TOL


def test_stream_really_streams_from_host_copies():
    engine = _engine("sd1", "stream")
    streamer = engine.placement.streamer
    sched = streamer.schedule
    assert 0 < len(sched.streamed) < len(sched.order)
    ref = _unet_call(engine)
    issued = streamer.copies_issued
    _unet_call(engine)
    assert streamer.copies_issued - issued == len(sched.streamed)  # every streamed block copied once per step
    lo, hi = streamer.arena.data_ptr(), streamer.arena.data_ptr() + streamer.arena.numel()
    mods = dict(engine.parts.unet.named_modules())
    for i in sched.streamed:
        for p in mods[sched.order[i].name].parameters():
            assert lo <= p.data_ptr() < hi  # streamed weights live in the arena only
    streamer.host.tensor.zero_()  # the host copies are the only source of streamed weights
    assert (_unet_call(engine) - ref).abs().max().item() > 1e-3


def test_text_and_vae_stages_match_full_under_every_policy():
    from leandiffusion.sampling.prompt_encoder import encode_texts

    ref = _engine("sd1", "full")
    ctx_ref = encode_texts(ref, ["a red cube"], cache=None)[0].context
    for policy in ("balanced", "lowvram", "stream"):
        engine = _engine("sd1", policy)
        ctx = encode_texts(engine, ["a red cube"], cache=None)[0].context
        assert (ctx - ctx_ref).abs().max().item() <= TOL
    assert _engine("sd1", "lowvram").placement.stage_device(None, "text") == torch.device("cpu")


def test_planned_peaks_are_ordered():
    parts = tiny_parts("sdxl")
    budget = _stream_budget(parts)
    peaks = {}
    for policy in ("full", "balanced", "lowvram", "stream"):
        placement = apply_vram_policy(tiny_parts("sdxl"), policy, device="cpu", vram_budget_gb=budget)
        peaks[policy] = placement.plan.peak_bytes
        if policy == "stream":
            assert placement.plan.peaks["unet"] <= budget * GiB
            assert placement.plan.unet_streamed_bytes > 0
    assert peaks["full"] > peaks["balanced"] >= peaks["lowvram"] > peaks["stream"]



def test_each_policys_peaks_are_what_it_keeps_on_the_device_per_stage():
    """The module docstring's table, written out from the plan's byte counts: ``full`` holds everything in every
    stage (and the UNet's activations in its own); ``balanced`` the UNet plus the running stage's weights or
    activations; ``lowvram`` the same without the text encoders (on the CPU in fp32). The byte counts themselves are
    the parameters' sizes (checked against a plain count, 512-byte alignment allowed)."""
    parts = tiny_parts("sd1")
    for policy in ("full", "balanced", "lowvram"):
        plan = apply_vram_policy(tiny_parts("sd1"), policy, device="cpu").plan
        T, U, V, act = plan.text_bytes, plan.unet_bytes, plan.vae_bytes, plan.unet_activation_bytes
        want = {"full": {"text": T + U + V, "unet": T + U + V + act, "vae": T + U + V},
                "balanced": {"text": U + T, "unet": U + act, "vae": U + V},
                "lowvram": {"text": U, "unet": U + act, "vae": U + V}}[policy]
        assert plan.peaks == want, policy
        assert act > 0 and plan.peak_bytes == max(want.values())
        for got, module in ((U, parts.unet), (V, parts.vae), (T, parts.text_encoder)):
            params = list(module.parameters())
            plain = sum(p.numel() * 4 for p in params)
            assert plain <= got < plain + 512 * (len(params) + 1)
    for policy, text in (("lowvram", "fp32"), ("balanced", "bf16")):  # lowvram's text encoders compute in fp32
        placement = apply_vram_policy(tiny_parts("sd1"), policy, device="cpu", dtype=torch.bfloat16)
        assert placement.plan.text_dtype == text and placement.plan.dtype == "bf16", policy
        assert {p.dtype for p in placement.parts.text_encoder.parameters()} == {DTYPE_OF[text]}, policy


DTYPE_OF = {"fp32": torch.float32, "bf16": torch.bfloat16}


def test_a_stream_placement_reports_its_resident_weights_and_staging_ring_to_comfyui():
    """What ComfyUI's memory manager sees between stages (``device_bytes``) under ``stream``: the always-resident
    and resident block weights plus the staging ring the streamer allocated (its arena tensor's size), not the
    plan's weights alone; nothing once released."""
    parts = tiny_parts("sd1")
    placement = apply_vram_policy(parts, "stream", device="cpu", vram_budget_gb=_stream_budget(parts))
    arena = placement.streamer.arena
    assert arena.numel() * arena.element_size() > 0
    assert placement.device_bytes() == (placement.plan.unet_fixed_bytes + placement.plan.unet_resident_bytes +
                                        arena.numel() * arena.element_size())
    placement.release()
    assert placement.device_bytes() == 0


def _cuda_plan(parts, policy, free=None, budget_gb=4.0):
    """The plan ``apply_vram_policy`` would make on a CUDA device with ``free`` bytes free (planning runs on the
    ``meta`` device, so no GPU is needed)."""
    from leandiffusion.memory.planner import plan_placement
    from leandiffusion.memory.policies import PolicyConfig, VramPolicy

    req = VramPolicy(policy)
    s = int(parts.unet.config.sample_size)
    config = PolicyConfig(VramPolicy.FULL if req == VramPolicy.AUTO else req, req, torch.device("cuda", 0),
                          torch.float16, torch.float16, torch.float32, int(budget_gb * GiB), (2, s, s))
    return plan_placement(parts, config, free, "m").plan


def _least_free(peak):
    """The least free VRAM whose 90% (rounded down) holds ``peak`` bytes: 90% of it is exactly ``peak``."""
    free = int(peak / 0.9)
    while int(free * 0.9) < peak:
        free += 1
    while int((free - 1) * 0.9) >= peak:
        free -= 1
    assert int(free * 0.9) == peak
    return free


def test_auto_takes_the_fastest_policy_whose_peak_fits_90_percent_of_the_free_vram():
    """``auto`` on CUDA: full > balanced > lowvram > stream, the first whose estimated peak is at most 90% of the
    free VRAM (an equal peak fits); below every resident policy, ``stream`` with the budget cut to that 90%. Checked
    at the exact boundaries of each explicitly planned policy's peak (tiny SD1: balanced and lowvram peak alike)."""
    parts = tiny_parts("sd1")
    peaks = {p: _cuda_plan(parts, p).peak_bytes for p in ("full", "balanced", "lowvram")}
    assert peaks["full"] > peaks["balanced"] == peaks["lowvram"]

    def auto(free):
        plan = _cuda_plan(parts, "auto", free)
        assert plan.requested == "auto"
        return plan

    assert auto(_least_free(peaks["full"])).policy == "full"
    assert auto(_least_free(peaks["full"]) - 1).policy == "balanced"
    assert auto(_least_free(peaks["balanced"])).policy == "balanced"
    free = _least_free(peaks["balanced"]) - 1
    plan = auto(free)
    assert plan.policy == "stream" and plan.budget_bytes == int(free * 0.9) == peaks["balanced"] - 1
    assert plan.peak_bytes <= plan.budget_bytes
    assert auto(10 * GiB).policy == "full"


@pytest.mark.parametrize("family", ["sd1", "sdxl"])
def test_stream_keeps_text_encoders_on_the_cpu_when_they_do_not_fit_the_budget(family):
    """Under ``stream`` the text encoders go on the device (while used) only if they fit next to the UNet's resident
    weights: the text stage's planned peak stays within the budget at every budget from the working minimum up,
    and the encoders run on the CPU in fp32 exactly when resident weights + text weights exceed it (written out
    here from the plan's byte counts). Guards a plan that always puts them on the device: over a hard budget."""
    parts = tiny_parts(family)
    minimum = stream_working_minimum_gb(parts, "cpu")
    unet_gb = module_bytes(parts.unet, torch.float32) / GiB
    modes = set()
    for fraction in (0.0, 0.1, 0.3, 0.6, 1.0, 2.0):
        budget = minimum + fraction * unet_gb
        plan = apply_vram_policy(tiny_parts(family), "stream", device="cpu", vram_budget_gb=budget).plan
        resident = plan.unet_fixed_bytes + plan.unet_resident_bytes + plan.arena_bytes
        fits = resident + plan.text_bytes <= plan.budget_bytes
        assert plan.text_mode == ("while used" if fits else "cpu"), (fraction, plan.text_mode)
        assert plan.peaks["text"] <= plan.budget_bytes and plan.peaks["unet"] <= plan.budget_bytes, fraction
        if not fits:
            assert plan.text_dtype == "fp32"
        modes.add(plan.text_mode)
    assert modes == {"cpu", "while used"}  # the sweep exercised both sides of the rule

def test_budget_below_minimum_states_it():
    parts = tiny_parts("sd1")
    minimum = stream_working_minimum_gb(parts, "cpu")
    with pytest.raises(ValueError, match=r"working minimum of [0-9.]+ GB") as info:
        apply_vram_policy(parts, "stream", device="cpu", vram_budget_gb=minimum * 0.5)
    quoted = float(str(info.value).split("working minimum of ")[1].split(" GB")[0])
    assert minimum <= quoted <= minimum * 1.001
    apply_vram_policy(parts, "stream", device="cpu", vram_budget_gb=quoted)  # the quoted minimum is enough


@pytest.mark.parametrize("kwargs,match", [
    (dict(policy="fastest"), "vram_policy='fastest'"),
    (dict(vram_budget_gb=-1.0), "vram_budget_gb=-1.0"),
    (dict(vram_budget_gb=float("inf")), "vram_budget_gb=inf"),  # was a bare OverflowError
    (dict(dtype=torch.int8), "dtype=torch.int8"),
    (dict(working_shape=(2, 0, 8)), "working_shape"),
])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
        apply_vram_policy(tiny_parts("sd1"), device="cpu", **kwargs)
    with pytest.raises(TypeError, match="parts"):
        apply_vram_policy("model.safetensors", device="cpu")


def test_release_then_reuse_replaces_and_bumps_epoch():
    engine = _engine("sd1", "stream")
    ref = _unet_call(engine)
    placement = engine.placement
    epoch = placement.epoch
    placement.release()
    assert placement.streamer is None and not engine.parts.unet._forward_pre_hooks
    out = _unet_call(engine)
    assert placement.epoch == epoch + 1 and (out - ref).abs().max().item() <= TOL


def test_remove_restores_plain_module():
    engine = _engine("sd1", "stream")
    ref = _unet_call(engine)
    from leandiffusion.memory.streaming import host_copy

    unet = engine.parts.unet
    assert any(host_copy(p) is not None for p in unet.parameters())  # streamed weights point to their host copy
    engine.placement.remove()
    assert not unet._forward_pre_hooks and not unet._forward_hooks
    assert all(host_copy(p) is None for p in unet.parameters())  # none does once the streamer is gone
    assert all(not m._forward_pre_hooks for m in unet.modules())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 8, 8, generator=g)
    ctx = torch.randn(2, 77, unet.config.cross_attention_dim, generator=g)
    with torch.no_grad():
        plain = unet(x, torch.tensor(500), encoder_hidden_states=ctx).sample
    assert (plain - ref).abs().max().item() <= TOL


def test_a_refused_nested_forward_caught_inside_a_block_leaves_the_outer_forward_running():
    """A nested UNet call refused (and the refusal caught) inside a block ends only the nested call: the outer
    forward keeps its schedule and finishes with the plain output (its later blocks still stream)."""
    engine = _engine("sd1", "stream")
    ref = _unet_call(engine)
    streamer = engine.placement.streamer
    block = dict(engine.parts.unet.named_modules())[streamer.schedule.order[1].name]
    original, refused = block.forward, []

    def nested(*args, **kwargs):
        try:
            _unet_call(engine)
        except RuntimeError as exc:
            refused.append(str(exc))
        return original(*args, **kwargs)

    block.forward = nested
    try:
        out = _unet_call(engine)
    finally:
        del block.forward
    assert len(refused) == 1 and "entered twice" in refused[0]
    assert (out - ref).abs().max().item() == 0.0
    assert (_unet_call(engine) - ref).abs().max().item() == 0.0


def test_failed_stream_build_leaves_model_whole(monkeypatch):
    from leandiffusion.memory import streaming

    reference = _unet_call(_engine("sd1", "full"))

    class Broken:
        def __init__(self):
            raise RuntimeError("injected failure after the arena and resident buffers exist")

    monkeypatch.setattr(streaming, "SyncCopier", Broken)
    parts = tiny_parts("sd1")
    with pytest.raises(RuntimeError, match="injected"):
        apply_vram_policy(parts, "stream", device="cpu", vram_budget_gb=_stream_budget(parts))
    unet = parts.unet
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in unet.modules())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 8, 8, generator=g)
    ctx = torch.randn(2, 77, unet.config.cross_attention_dim, generator=g)
    with torch.no_grad():
        plain = unet(x, torch.tensor(500), encoder_hidden_states=ctx).sample
    assert (plain - reference).abs().max().item() <= TOL  # no weight lost to a half-built arena


def test_stream_forward_that_fails_midway_leaves_engine_usable():
    """An out-of-memory (here: any error) inside a streamed block must not wedge the streamer: the next forward
    runs and gives the same output as before (the Stream Scheduler retries a failed batch on the same engine)."""
    engine = _engine("sd1", "stream")
    ref = _unet_call(engine)
    streamer = engine.placement.streamer
    sched = streamer.schedule
    block = dict(engine.parts.unet.named_modules())[sched.order[len(sched.order) // 2].name]

    def fail(*args, **kwargs):
        raise torch.OutOfMemoryError("injected: out of memory inside a streamed block")

    block.forward = fail
    try:
        with pytest.raises(torch.OutOfMemoryError, match="injected"):
            _unet_call(engine)
    finally:
        del block.forward
    assert (_unet_call(engine) - ref).abs().max().item() == 0.0


def test_stream_refuses_a_nested_forward_and_recovers():
    """A UNet called again from inside one of its own blocks is refused by name; the outer forward fails with it and
    the next plain forward runs normally."""
    engine = _engine("sd1", "stream")
    ref = _unet_call(engine)
    streamer = engine.placement.streamer
    block = dict(engine.parts.unet.named_modules())[streamer.schedule.order[1].name]
    original = block.forward

    def nested(*args, **kwargs):
        _unet_call(engine)
        return original(*args, **kwargs)

    block.forward = nested
    try:
        with pytest.raises(RuntimeError, match="entered twice"):
            _unet_call(engine)
    finally:
        del block.forward
    assert (_unet_call(engine) - ref).abs().max().item() == 0.0

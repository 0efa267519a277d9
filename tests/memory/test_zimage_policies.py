"""Every VRAM policy runs Z-Image (CPU, fp32) with the same result as ``full``, bit for bit, and ``stream`` really
streams both the DiT and the Qwen3 text encoder (the CUDA path's schedule, copies synchronous on the CPU).

Guards issue 42's "every VRAM policy works for zimage, and stream keeps every stage (the 4B text encoder included,
streamed block by block like the DiT) within vram_budget_gb": the DiT's blocks called one by one as the flow
sampler calls them (its top-level forward never runs) and through diffusers' own forward; the text encoder's
hidden states; the whole flow sampler; and the ways a streamed forward can stop early (a block raising, an error
between two blocks, an interrupt, a nested call, blocks out of order), after each of which the next forward must
still equal the reference.
"""
import pytest
import torch

from leandiffusion.memory.engine import parts_from_components
from leandiffusion.memory.policies import apply_vram_policy
from leandiffusion.sampling.flow.dit_forward import ImageGrid, caption_layout, dit_forward
from leandiffusion.sampling.flow.loop import sample_flow
from leandiffusion.sampling.flow.settings import FlowSettings
from leandiffusion.sampling.flow.text import encode_prompts
from leandiffusion.tests.kit.partial_stream import engine_under, partly_streamed_budget_gb, replace_deeper

POLICIES = ["full", "balanced", "lowvram", "stream", "auto"]
# Small DiT activations at this working shape, so the text stage (512 tokens) is what the plan must make room for.
WORKING_SHAPE = (1, 8, 8)
PROMPTS = ["a red cube", "a lighthouse on a cliff at dusk, waves and gulls"]


def _components(seed: int = 0) -> dict:
    """The tiny Z-Image with a deeper DiT (2 + 2 + 4 blocks) and a 12-layer text encoder whose weights do not fit
    in the DiT's activation room, so under ``stream`` both stream."""
    from diffusers import ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    from leandiffusion.memory import tiny_zimage

    comps = tiny_zimage.build_tiny_zimage(seed)
    config = Qwen3Config(**{**tiny_zimage.text_config(len(comps["tokenizer"])).to_dict(), "num_hidden_layers": 12,
                            "intermediate_size": 1024, "layer_types": None})

    def build():
        dit = ZImageTransformer2DModel(**{**tiny_zimage.transformer_config(), "n_layers": 4, "n_refiner_layers": 2})
        with torch.no_grad():
            for p in (dit.x_pad_token, dit.cap_pad_token):
                p.normal_(0.0, 1.0)
            for final in dit.all_final_layer.values():
                torch.nn.init.normal_(final.linear.weight, std=0.1)
                torch.nn.init.normal_(final.adaLN_modulation[1].weight, std=0.1)
            for block in list(dit.layers) + list(dit.noise_refiner):
                torch.nn.init.normal_(block.adaLN_modulation[0].weight, std=0.05)
        return dit, Qwen3Model(config)

    return replace_deeper(comps, seed + 1, build)


def _parts():
    return parts_from_components(_components(), name="tiny-zimage-deep")


def _budget_gb(parts) -> float:
    return partly_streamed_budget_gb(parts, WORKING_SHAPE)


def _engine(policy: str):
    return engine_under(_parts(), policy, WORKING_SHAPE)


def _dit_inputs(dit, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 16, 6, 10, generator=g)
    t = torch.rand(2, generator=g)
    captions = [torch.randn(n, dit.config.cap_feat_dim, generator=g) for n in (5, 40)]
    return x, t, captions


def _blocks_in_order(engine, seed=1):
    """The DiT called as the flow sampler calls it: embedders, each block through ``__call__``, final layer."""
    dit = engine.parts.unet
    x, t, captions = _dit_inputs(dit, seed)
    grid = ImageGrid.of(6, 10, 2)
    with engine.session("unet"), torch.no_grad():
        layout = caption_layout(dit, captions, grid, 128, torch.float32, torch.device("cpu"))
        return dit_forward(dit, x, t, layout, grid)


def _diffusers_forward(engine, seed=1):
    dit = engine.parts.unet
    x, t, captions = _dit_inputs(dit, seed)
    with engine.session("unet"), torch.no_grad():
        out = dit(list(x.unsqueeze(2).unbind(0)), t, captions, return_dict=False)[0]
    return torch.stack(out).squeeze(2)


@pytest.fixture(scope="module")
def reference():
    engine = _engine("full")
    return dict(blocks=_blocks_in_order(engine), forward=_diffusers_forward(engine),
                text=encode_prompts(engine, PROMPTS))


@pytest.fixture(scope="module")
def streamed():
    return _engine("stream")


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_gives_the_dit_and_text_outputs_of_full(reference, policy):
    engine = _engine(policy)
    for _ in range(2):  # a second forward reuses the staging rings
        assert torch.equal(_blocks_in_order(engine), reference["blocks"]), policy
        assert torch.equal(_diffusers_forward(engine), reference["forward"]), policy
    for got, want in zip(encode_prompts(engine, PROMPTS), reference["text"]):
        assert torch.equal(got, want), policy
    if policy == "auto":
        assert engine.placement.plan.policy == "full"  # auto on the CPU stays full


def test_the_stream_plan_streams_both_and_keeps_every_stage_within_the_budget(streamed):
    plan = streamed.placement.plan
    assert plan.text_mode == "stream" and plan.unet_mode == "stream"
    assert plan.text_streamed_units == plan.text_total_units == 12
    assert 0 < plan.streamed_units < plan.total_units == 8
    assert plan.text_arena_bytes >= 3 * max(u.nbytes for u in streamed.placement.text_schedule.order)
    assert max(plan.peaks.values()) <= plan.budget_bytes
    assert plan.peaks["text"] == (streamed.placement.budget.resident_bytes + plan.text_arena_bytes
                                  + plan.text_activation_bytes)
    assert "streamed 12 of 12 blocks" in streamed.plan and "on the host (lookup there)" in streamed.plan


def test_the_flow_sampler_under_stream_equals_full():
    settings = FlowSettings("a red cat", "blurry", seed=3, steps=2, cfg=4.0, width=48, height=32,
                            acceleration="none")
    want = sample_flow(_engine("full"), settings, quiet=True)["samples"]
    assert torch.equal(sample_flow(_engine("stream"), settings, quiet=True)["samples"], want)


def test_the_dit_streams_from_its_host_copies_whichever_way_it_is_called(streamed, reference):
    streamer = streamed.placement.streamer
    sched = streamer.schedule
    for call in (_blocks_in_order, _diffusers_forward):
        issued = streamer.copies_issued
        call(streamed)
        assert streamer.copies_issued - issued == len(sched.streamed)  # every streamed block copied once
    lo, hi = streamer.arena.data_ptr(), streamer.arena.data_ptr() + streamer.arena.numel()
    mods = dict(streamed.parts.unet.named_modules())
    assert all(lo <= p.data_ptr() < hi for i in sched.streamed for p in mods[sched.order[i].name].parameters())
    saved = streamer.host.tensor.clone()
    streamer.host.tensor.zero_()  # the host copies are the only source of the streamed blocks' weights
    try:
        assert (_blocks_in_order(streamed) - reference["blocks"]).abs().max().item() > 1e-3
    finally:
        streamer.host.tensor.copy_(saved)
    assert torch.equal(_blocks_in_order(streamed), reference["blocks"])


def _text_swap(engine):
    (swap,) = engine.placement._swaps["text"]
    return swap


def test_the_text_ring_exists_only_while_the_text_stage_runs(streamed, reference):
    swap = _text_swap(streamed)
    encoder = streamed.parts.text_encoder
    host = swap.host.tensor
    layer_params = [p for layer in encoder.layers for p in layer.parameters()]

    def inside(buffer, p):
        return buffer.data_ptr() <= p.data_ptr() < buffer.data_ptr() + buffer.numel()

    assert swap.arena is None and all(inside(host, p) for p in layer_params)
    issued = swap.copies_issued
    with streamed.session("text"):
        assert swap.arena is not None and all(inside(swap.arena, p) for p in layer_params)
        with torch.no_grad():
            encoder(input_ids=torch.tensor([[3, 4, 5]]))
    assert swap.copies_issued - issued == 12
    assert swap.arena is None and all(inside(host, p) for p in layer_params)
    embed = encoder.embed_tokens.weight  # on the host, in the run dtype, in neither device buffer
    assert embed.dtype == torch.float32 and not inside(swap.resident, embed) and not inside(host, embed)
    assert swap.resident.numel() == streamed.placement.plan.text_fixed_bytes  # only the final norm is resident
    assert torch.equal(encode_prompts(streamed, PROMPTS)[1], reference["text"][1])


def _patched(module, fn):
    """Replace ``module.forward`` (a block's feed-forward: the flow sampler swaps the block's own forward while it
    runs, its submodules' it leaves alone)."""
    module.forward = fn
    return module


def _count_joins(streamer, monkeypatch) -> list:
    """Record every ``copier.end`` (the join of the copy stream: a no-op on the CPU, so counted here)."""
    joins, end = [], streamer.copier.end

    def counted():
        joins.append(1)
        end()

    monkeypatch.setattr(streamer.copier, "end", counted)
    return joins


def test_a_block_that_raises_closes_the_forward(streamed, reference, monkeypatch):
    """Out of memory inside a block, caught inside the same session (the Stream Scheduler retries so): the block's
    always-called hook closes the forward at once, and the next forward of the session runs normally."""
    joins = _count_joins(streamed.placement.streamer, monkeypatch)
    dit = streamed.parts.unet
    block = dit.layers[1].feed_forward

    def fail(*args, **kwargs):
        raise torch.OutOfMemoryError("injected: out of memory inside a streamed block")

    x, t, captions = _dit_inputs(dit)
    grid = ImageGrid.of(6, 10, 2)
    with streamed.session("unet"), torch.no_grad():
        layout = caption_layout(dit, captions, grid, 128, torch.float32, torch.device("cpu"))
        _patched(block, fail)
        try:
            with pytest.raises(torch.OutOfMemoryError, match="injected"):
                dit_forward(dit, x, t, layout, grid)
        finally:
            del block.forward
        assert not streamed.placement.streamer._active and len(joins) == 1
        assert torch.equal(dit_forward(dit, x, t, layout, grid), reference["blocks"])


def test_a_forward_abandoned_between_two_blocks_is_closed_by_the_next_one(streamed, reference, monkeypatch):
    """An error in the glue between the image refiner and the caption refiner (no block hook sees it), caught inside
    the same session: the next forward closes the stale one (joins its copies) and runs normally."""
    joins = _count_joins(streamed.placement.streamer, monkeypatch)
    dit = streamed.parts.unet

    def fail(module, args):
        raise ValueError("injected glue")

    handle = dit.cap_embedder.register_forward_pre_hook(fail)
    x, t, captions = _dit_inputs(dit)
    grid = ImageGrid.of(6, 10, 2)
    with streamed.session("unet"), torch.no_grad():
        layout = caption_layout(dit, captions, grid, 128, torch.float32, torch.device("cpu"))
        with pytest.raises(ValueError, match="injected glue"):
            dit_forward(dit, x, t, layout, grid)
        assert streamed.placement.streamer._active and not joins  # left open: no block hook ran after the error
        handle.remove()
        assert torch.equal(dit_forward(dit, x, t, layout, grid), reference["blocks"])
        assert len(joins) == 2  # the abandoned forward's, then the finished one's


def test_an_interrupt_inside_a_block_is_closed_when_the_session_exits(streamed, reference):
    block = streamed.parts.unet.context_refiner[0].feed_forward

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    _patched(block, interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            _blocks_in_order(streamed)
    finally:
        del block.forward
    assert not streamed.placement.streamer._active and streamed.placement.streamer._depth == 0
    assert torch.equal(_blocks_in_order(streamed), reference["blocks"])


def test_a_nested_forward_is_refused_and_the_outer_one_finishes(streamed, reference):
    block = streamed.parts.unet.layers[0].feed_forward
    original, refused = block.forward, []

    def nested(*args, **kwargs):
        try:
            _diffusers_forward(streamed, seed=2)
        except RuntimeError as exc:
            refused.append(str(exc))
        return original(*args, **kwargs)

    _patched(block, nested)
    try:
        out = _blocks_in_order(streamed)
    finally:
        del block.forward
    assert len(refused) == 1 and "entered twice" in refused[0]
    assert torch.equal(out, reference["blocks"])
    assert torch.equal(_blocks_in_order(streamed), reference["blocks"])


def test_a_block_outside_a_forward_or_out_of_order_is_refused(streamed, reference):
    """A later block called on its own is refused (no forward is open); the first block opens a forward, and a block
    other than the next one is then refused and closes it; the next whole forward runs normally."""
    dit = streamed.parts.unet
    hidden = torch.randn(1, 32, dit.config.dim)
    freqs = torch.ones(1, 32, dit.config.dim // dit.config.n_heads // 2, dtype=torch.complex64)
    adaln = torch.zeros(1, min(dit.config.dim, 256))
    with streamed.session("unet"), torch.no_grad():
        with pytest.raises(RuntimeError, match="ran outside"):
            dit.layers[2](hidden, None, freqs, adaln)
        dit.noise_refiner[0](hidden, None, freqs, adaln)
        with pytest.raises(RuntimeError, match="order changed"):
            dit.layers[0](hidden, None, freqs, adaln)
        assert not streamed.placement.streamer._active
    assert torch.equal(_blocks_in_order(streamed), reference["blocks"])


def _our_hooks(module) -> list:
    """The forward hooks on ``module``'s submodules that the pack's memory code installed."""
    return [h for m in module.modules() for h in (*m._forward_pre_hooks.values(), *m._forward_hooks.values())
            if getattr(h, "__module__", "").startswith("leandiffusion.memory")]


def test_remove_leaves_plain_modules_with_the_same_outputs(reference):
    from leandiffusion.memory.streaming import host_copy

    engine = _engine("stream")
    assert _our_hooks(engine.parts.unet) and _our_hooks(engine.parts.text_encoder)  # the check below can fail
    engine.placement.remove()
    for module in (engine.parts.unet, engine.parts.text_encoder):
        assert not _our_hooks(module)
        assert all(host_copy(p) is None and p.device.type == "cpu" for p in module.parameters())
    plain = dict(blocks=_blocks_in_order(engine), forward=_diffusers_forward(engine))
    assert torch.equal(plain["blocks"], reference["blocks"]) and torch.equal(plain["forward"], reference["forward"])


def test_a_failed_text_streamer_build_leaves_the_encoder_whole(monkeypatch, reference):
    from leandiffusion.memory import text_streaming

    def broken(self, modules):
        raise RuntimeError("injected failure after the text streamer's buffers exist")

    monkeypatch.setattr(text_streaming.TextStreamer, "_install_hooks", broken)
    parts = _parts()
    with pytest.raises(RuntimeError, match="injected"):
        apply_vram_policy(parts, "stream", device="cpu", vram_budget_gb=_budget_gb(parts),
                          working_shape=WORKING_SHAPE)
    from leandiffusion.memory.engine import engine_from_parts

    plain = engine_from_parts(parts)
    for got, want in zip(encode_prompts(plain, PROMPTS), reference["text"]):
        assert torch.equal(got, want)

"""Unmerged DoRA through its own forward (``lora/dora_forward.py``) against merged weights computed in fp64.

Guards (an unmerged DoRA that builds ``s * ((W + dW) g - W)`` in every forward triples the SDXL step): every DoRA
layout (LoRA, LoCon with Tucker factors, LoHa, LoKr; input and output axis) runs through the forward, not the dense
fallback, and gives the fp64 formula's output; a strength change rewrites buffers without recomputing the gain; a
weight written in place underneath (a merged LoRA earlier in the chain) is followed, and so is its restore; under the
``stream`` policy the gain is read from the host copies (at attach a streamed layer's device slot holds whatever the
last forward left there); a second DoRA on the same layer falls back to the dense hook and the two still add.
"""
import pytest
import torch

from leandiffusion.lora import dora_forward, inject_lora
from leandiffusion.lora.formats import LoraLayer
from leandiffusion.lora.keymap import Target
from leandiffusion.lora.lowrank_terms import LinearTerm
from leandiffusion.memory.load import build_engine
from leandiffusion.memory.plan import GiB, module_bytes
from leandiffusion.memory.policies import stream_working_minimum_gb
from leandiffusion.tests.kit import tiny_components, tiny_parts
from leandiffusion.tests.lora import lorafiles as lf
from leandiffusion.tests.lora.test_lycoris import PREFIX, TOL, _engine, _file, _reference, _roots

DORA_CASES = [c for c in lf.LYCORIS_CASES if lf.LYCORIS_CASES[c][3]]


def _where(view, adapter=-1, components=None) -> set:
    b = view.adapters[adapter].binding
    return {w for comp in components or b.components for w in b.installed(comp)}


def _count_gains(monkeypatch) -> list:
    calls = []
    real = dora_forward.dora_gain

    def counted(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(dora_forward, "dora_gain", counted)
    return calls


@pytest.mark.parametrize("case", DORA_CASES)
def test_every_dora_layout_runs_its_own_forward_and_matches_the_formula(tmp_path, case):
    assert {"dora_in", "dora_out", "lokr_dora_in", "loha_dora_out", "locon_tucker_dora_in"} <= set(DORA_CASES)
    engine = _engine("sd1")
    before = lf.snapshot(engine.parts.unet, engine.parts.text_encoder)
    sd, path = _file(tmp_path, "sd1", case)
    view = inject_lora(engine, path, 0.7, -0.6)
    ref = lf.view_outputs(_reference("sd1", [(sd, 0.7, -0.6)]))
    got = lf.view_outputs(view)
    with view.session("unet"), view.session("text"):
        assert _where(view) == {"override"}, "every DoRA layer must run the DoRA forward, not the dense fallback"
    assert lf.max_diff(got, ref) <= TOL
    assert lf.max_diff(ref, lf.view_outputs(engine)) > 0.05  # the file changes the outputs
    lf.assert_untouched(before, engine.parts.unet, engine.parts.text_encoder)


@pytest.mark.parametrize("case", ["dora_in", "dora_out"])
def test_on_a_geglu_proj_the_term_goes_into_the_fused_gating(tmp_path, case, strategy):
    """Under ``geglu`` the low-rank part of a DoRA on ``ff.net.0.proj`` runs in the GEGLU's override (as a plain
    LoRA's does), the per-channel part in the proj's forward; under ``hook`` the proj's forward does both."""
    engine = _engine("sd1")
    sd, path = _file(tmp_path, "sd1", case)
    view = inject_lora(engine, path, 0.7, -0.6)
    ref = lf.view_outputs(_reference("sd1", [(sd, 0.7, -0.6)]))
    assert lf.max_diff(lf.view_outputs(view), ref) <= TOL
    with view.session("unet"):
        dora = {ov.module: ov for ov in view.adapters[0].binding._dora["unet"]}
        projs = [m for n, m in engine.parts.unet.named_modules() if n.endswith("ff.net.0.proj")]
        assert projs and all(m in dora for m in projs)
        for m in projs:
            ov = dora[m]
            assert ov.term_in_geglu == (strategy == "geglu")
            assert (ov.inner in getattr(ov.geglu, "terms", ())) == (strategy == "geglu")
        assert not any(ov.term_in_geglu for m, ov in dora.items() if m not in projs)
    for m in projs:  # detached: neither override is left behind
        assert "forward" not in m.__dict__


@pytest.mark.parametrize("axis", ["in", "out"])
def test_an_input_in_another_dtype_than_the_adapter(axis):
    """A placement that runs the module in another dtype (here fp64 against an fp32 adapter) still gets the DoRA."""
    gen = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(12, 10).double()
    down, up = torch.randn(3, 12, generator=gen) * 0.3, torch.randn(10, 3, generator=gen) * 0.3
    mag = torch.rand(1, 12, generator=gen) + 0.5 if axis == "in" else torch.rand(10, 1, generator=gen) + 0.5
    layer = LoraLayer(component="unet", name="lin", naming="kohya", down=down, up=up, scale=1.0, source="t",
                      magnitude=mag)
    ov = dora_forward.DoraForward(Target("unet", "lin", lin, layer))
    ov.inner = LinearTerm(ov.down, ov.up_s)  # what the binding gives a folded DoRA
    assert ov.refresh_gain()
    s = 0.8
    for src, buf in ov.strength_pairs():
        buf.copy_(src * s)
    for buf in ov.plus_one():
        buf.add_(1.0)
    assert ov.add(object())
    x = torch.randn(4, 12, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        got = lin(x)
        want = torch.nn.functional.linear(
            x, lf.dora_reference_weight(lin.weight, up.double() @ down.double(), mag, s), lin.bias)
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    assert (got - torch.nn.functional.linear(x, lin.weight, lin.bias)).abs().max().item() > 0.05


def test_a_strength_change_reuses_the_gain(tmp_path, monkeypatch):
    calls = _count_gains(monkeypatch)
    engine = _engine("sd1")
    sd, path = _file(tmp_path, "sd1", "dora_in")
    layers = sum(1 for k in sd if k.endswith(".dora_scale"))
    for s in (0.7, -0.4, 1.3):
        view = inject_lora(engine, path, s, s)
        assert lf.max_diff(lf.view_outputs(view), lf.view_outputs(_reference("sd1", [(sd, s, s)]))) <= TOL
    assert len(calls) == layers  # computed once, at the first attach


@pytest.mark.parametrize("case", ["dora_in", "dora_out", "loha_dora_out"])
def test_strength_zero_at_the_first_attach_is_the_base_bit_exactly(tmp_path, case):
    engine = _engine("sd1")
    base = lf.view_outputs(engine)
    _, path = _file(tmp_path, "sd1", case)
    for s in (0.0, 0.8, 0.0):
        outs = lf.view_outputs(inject_lora(engine, path, s, s))
        assert all(torch.equal(a, b) for a, b in zip(outs, base)) == (s == 0.0)


def _chain_reference(plain, s_plain, dora, s_dora):
    """fp64: the plain LoRA merged into the weights first, then the DoRA decomposing *that* weight (ComfyUI's patch
    order, which a merged LoRA earlier in the chain gives)."""
    c = tiny_components("sd1")
    roots = _roots(c)
    with torch.no_grad():
        for comp, root in roots.items():
            for name, m in root.named_modules():
                if not isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)):
                    continue
                key = PREFIX[comp] + (name if comp == "unet" else lf.file_name(root, name)).replace(".", "_")
                w = m.weight.double()
                if key + ".lora_down.weight" in plain:
                    w = w + s_plain * lf.reference_delta(plain, key, m)
                if key + ".dora_scale" in dora:
                    w = lf.dora_reference_weight(w, lf.reference_delta(dora, key, m), dora[key + ".dora_scale"], s_dora)
                m.weight.copy_(w.float())
    from leandiffusion.memory.engine import engine_from_parts, parts_from_components
    return engine_from_parts(parts_from_components(c))


def test_the_gain_follows_a_merged_lora_underneath_and_its_restore(tmp_path, monkeypatch):
    calls = _count_gains(monkeypatch)
    engine = _engine("sd1")
    roots = {"unet": engine.parts.unet, "text_encoder": engine.parts.text_encoder}
    plain = lf.kohya_state_dict(roots, {"unet": lf.ATTN_FF, "text_encoder": lf.TE_LINEARS}, rank=3, seed=4)
    plain_path = lf.write(plain, tmp_path / "plain.safetensors")
    dora, dora_path = _file(tmp_path, "sd1", "dora_out", seed=3)
    alone = inject_lora(engine, dora_path, 0.7, 0.7)
    chained = inject_lora(inject_lora(engine, plain_path, 0.5, 0.5, mode="merged"), dora_path, 0.7, 0.7)
    ref_alone = lf.view_outputs(_reference("sd1", [(dora, 0.7, 0.7)]))
    ref_chained = lf.view_outputs(_chain_reference(plain, 0.5, dora, 0.7))
    assert lf.max_diff(ref_alone, ref_chained) > 0.05  # the two weights give different gains
    for view, ref in ((alone, ref_alone), (chained, ref_chained), (alone, ref_alone), (alone, ref_alone)):
        assert lf.max_diff(lf.view_outputs(view), ref) <= TOL
    layers = [k[:-len(".dora_scale")] for k in dora if k.endswith(".dora_scale")]
    both = [k for k in layers if k + ".lora_down.weight" in plain]
    assert 0 < len(both) < len(layers)
    # every layer at the first run; the layers the merged LoRA wrote, at its merge and its restore; none again after
    assert len(calls) == len(layers) + 2 * len(both)


def test_a_gain_refresh_inside_a_cuda_graph_capture_is_refused(tmp_path, monkeypatch):
    """A weight changed since the gain was computed cannot be re-normalised inside a capture (it would allocate and
    the replay would keep the old gain): the refresh says so. The capture state is stubbed (no GPU here); outside
    a capture the same refresh runs."""
    engine = _engine("sd1")
    _, path = _file(tmp_path, "sd1", "dora_in")
    view = inject_lora(engine, path, 0.8, 0.8)
    lf.view_outputs(view)  # attached once: every gain computed
    with view.session("unet"):
        forwards = [m.__dict__["forward"] for m in engine.parts.unet.modules()
                    if isinstance(m.__dict__.get("forward"), dora_forward.DoraForward)]
        assert forwards
        fwd = forwards[0]
        assert not fwd.refresh_gain()  # unchanged weight: nothing to do
        with torch.no_grad():
            fwd.module.weight.mul_(1.0)  # an in-place write: the gain's key changes
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        with pytest.raises(RuntimeError, match="cannot be recomputed inside a CUDA-graph capture"):
            fwd.refresh_gain()
        monkeypatch.undo()
        assert fwd.refresh_gain()


@pytest.mark.parametrize("layout", ["dora_in", "dora_out"])  # dora_out: the output-axis term reads the bias too
def test_under_the_stream_policy_the_gain_comes_from_the_host_copies(tmp_path, layout):
    parts = tiny_parts("sd1")
    budget = stream_working_minimum_gb(parts, "cpu") + 0.3 * module_bytes(parts.unet, torch.float32) / GiB
    engine = build_engine(parts, "stream", budget, device="cpu")
    streamer = engine.placement.streamer
    assert 0 < len(streamer.schedule.streamed) < len(streamer.schedule.order)
    sd, path = _file(tmp_path, "sd1", layout)
    view = inject_lora(engine, path, 0.8, 0.8)
    streamer.arena.zero_()  # what a streamed layer's weight reads as outside its block's forward: not its weights
    ref = lf.view_outputs(_reference("sd1", [(sd, 0.8, 0.8)]))
    got = lf.view_outputs(view)
    with view.session("unet"):
        assert _where(view, components=["unet"]) == {"override"}
    assert lf.max_diff(got[:1], ref[:1]) <= TOL


def test_a_second_dora_on_the_same_layer_falls_back_to_the_dense_hook(tmp_path):
    engine = _engine("sd1")
    before = lf.snapshot(engine.parts.unet, engine.parts.text_encoder)
    first, first_path = _file(tmp_path, "sd1", "dora_in", seed=3)
    second, second_path = _file(tmp_path, "sd1", "dora_out", seed=5)
    view = inject_lora(inject_lora(engine, first_path, 0.6, 0.6), second_path, -0.5, 0.9)
    ref = lf.view_outputs(_reference("sd1", [(first, 0.6, 0.6), (second, -0.5, 0.9)]))
    got = lf.view_outputs(view)
    with view.session("unet"), view.session("text"):
        assert _where(view, 0) == {"override"} and _where(view, 1) == {"hook"}
    assert lf.max_diff(got, ref) <= TOL
    lf.assert_untouched(before, engine.parts.unet, engine.parts.text_encoder)


@pytest.mark.parametrize("axis", ["in", "out"])
def test_a_channel_whose_adapted_weight_is_zero_keeps_a_finite_gain(axis):
    """The ``eps`` of ``g = m / (||W + dW|| + eps)`` (no other test's weights have a zero channel). A channel of
    ``W + dW`` that is all zeros (a pruned channel the adapter leaves alone) has ``g = m / eps``, finite, so its
    rows of ``(W + dW) g`` are 0 and the layer's delta there is ``-s W = 0``; without ``eps`` it is ``0 * inf``, NaN.
    The other channels: the formula in fp64."""
    from leandiffusion.lora.dora import dora_delta

    gen = torch.Generator().manual_seed(0)
    w, d = torch.randn(6, 5, generator=gen), 0.1 * torch.randn(6, 5, generator=gen)
    if axis == "in":
        w[:, 2], d[:, 2], m, dims = 0.0, 0.0, 1.0 + torch.rand(1, 5, generator=gen), 0
    else:
        w[2], d[2], m, dims = 0.0, 0.0, 1.0 + torch.rand(6, 1, generator=gen), 1
    got = dora_delta(w, d, m, 0.7)
    assert torch.isfinite(got).all()
    a = (w + d).double()
    norm = a.square().sum(dim=dims, keepdim=True).sqrt() + torch.finfo(torch.float32).eps
    ref = 0.7 * (a * m.double() / norm - w.double())
    assert (got.double() - ref).abs().max() <= 1e-6
    assert (got[:, 2] if axis == "in" else got[2]).abs().max() == 0

"""Unmerged and merged injection on tiny fp32 CPU models, against plain math and against each other.

Guards: y = W x + s * (alpha / r) * up(down(x)) with per-layer alphas and separate UNet / text strengths; merged ==
unmerged; strength 0 == base bit-exactly; target_blocks touches nothing else; strength changes never move a base
weight; stacking; the input view and its modules are left exactly as they were.
"""
import re

import pytest
import torch

from diffusers.models.activations import GEGLU

from leandiffusion.lora import inject_lora
from leandiffusion.memory.engine import engine_from_parts, parts_from_components
from leandiffusion.tests.kit import tiny_components
from leandiffusion.tests.lora import lorafiles as lf

TOL = 1e-5
UNET_ALL = re.compile(lf.ATTN_FF.pattern + "|" + lf.LOCON.pattern)
PATS = {"unet": UNET_ALL, "text_encoder": lf.TE_LINEARS}


def _setup(tmp_path, seed=0, varied_alpha=True, family="sd1"):
    c = tiny_components(family)
    engine = engine_from_parts(parts_from_components(c))
    lf.run_text(engine.parts)  # transformers installs its output-capturing hooks at the first call
    roots = {"unet": c["unet"], "text_encoder": c["text_encoder"]}
    sd = lf.kohya_state_dict(roots, PATS, rank=4, seed=seed, varied_alpha=varied_alpha)
    path = lf.write(sd, tmp_path / f"k{seed}.safetensors")
    return engine, sd, path


def _reference_engine(sd_and_strengths, family="sd1"):
    """A fresh model with W + s * alpha / r * up @ down written in by plain fp64 math (the trusted reference)."""
    c = tiny_components(family)
    roots = {"unet": c["unet"], "text_encoder": c["text_encoder"]}
    with torch.no_grad():
        for sd, s_unet, s_te in sd_and_strengths:
            for comp, pattern in PATS.items():
                prefix = "lora_unet_" if comp == "unet" else "lora_te_"
                for name in lf.module_names(roots[comp], pattern):
                    key = prefix + lf.file_name(roots[comp], name).replace(".", "_")
                    down, up = sd[key + ".lora_down.weight"].double(), sd[key + ".lora_up.weight"].double()
                    scale = sd[key + ".alpha"].item() / down.shape[0]
                    w = roots[comp].get_submodule(name).weight
                    delta = (up.flatten(1) @ down.flatten(1)).reshape(w.shape)
                    s = s_unet if comp == "unet" else s_te
                    w.copy_((w.double() + s * scale * delta).float())
    return engine_from_parts(parts_from_components(c))


def test_per_layer_alphas_and_separate_strengths_match_plain_math(tmp_path, strategy):
    engine, sd, path = _setup(tmp_path)
    view = inject_lora(engine, path, strength=0.7, strength_text_encoder=-0.4)
    ref = _reference_engine([(sd, 0.7, -0.4)])
    assert lf.max_diff(lf.view_outputs(ref), lf.view_outputs(engine)) > 0.05
    assert lf.max_diff(lf.view_outputs(view), lf.view_outputs(ref)) <= TOL


@pytest.mark.parametrize("strength", [1.0, -1.3])
def test_merged_equals_unmerged_and_restores_bit_exactly(tmp_path, strength, strategy):
    engine, sd, path = _setup(tmp_path)
    before = lf.snapshot(engine.parts.unet, engine.parts.text_encoder)
    unmerged = inject_lora(engine, path, strength, 0.5, mode="unmerged")
    merged = inject_lora(engine, path, strength, 0.5, mode="merged")
    assert lf.max_diff(lf.view_outputs(merged), lf.view_outputs(unmerged)) <= TOL
    lf.assert_untouched(before, engine.parts.unet, engine.parts.text_encoder)


@pytest.mark.parametrize("mode", ["unmerged", "merged"])
def test_strength_zero_is_base_bit_exact(tmp_path, mode, strategy):
    engine, _, path = _setup(tmp_path)
    base = lf.view_outputs(engine)
    view = inject_lora(engine, path, 0.0, 0.0, mode=mode)
    for a, b in zip(lf.view_outputs(view), base):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["unmerged", "merged"])
def test_strength_zero_after_another_strength_is_base_bit_exact(tmp_path, mode, strategy):
    """Views of one file share its buffers: a strength-0 view run after a 0.8 view must zero them again
    (the first strength 0 finds the buffers zeroed at creation, so only a later one tests the zeroing)."""
    engine, _, path = _setup(tmp_path)
    base = lf.view_outputs(engine)
    strong, off = (inject_lora(engine, path, s, s, mode=mode) for s in (0.8, 0.0))
    assert lf.max_diff(lf.view_outputs(strong), base) > 0.05
    for a, b in zip(lf.view_outputs(off), base):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["unmerged", "merged"])
def test_linear_factors_on_a_one_by_one_conv_equal_conv_factors(tmp_path, mode, strategy):
    """Some converters store a 1x1 conv's LoRA (SD1's proj_in/proj_out) as 2-D factors; they mean the same
    [out, r, 1, 1] / [r, in, 1, 1] product."""
    engine, sd, path = _setup(tmp_path)
    flat = {k: (v.flatten(1) if v.ndim == 4 and v.shape[2:] == (1, 1) else v) for k, v in sd.items()}
    changed = [k for k in sd if sd[k].ndim == 4 and sd[k].shape[2:] == (1, 1)]
    assert any("proj_in" in k for k in changed), "the test needs 1x1 conv layers"
    flat_path = lf.write(flat, tmp_path / "flat.safetensors")
    want = lf.view_outputs(inject_lora(engine, path, 0.9, 0.9, mode=mode))
    for a, b in zip(lf.view_outputs(inject_lora(engine, flat_path, 0.9, 0.9, mode=mode)), want):
        assert torch.equal(a, b)


def test_target_blocks_leave_every_other_module_bit_identical(tmp_path, strategy):
    engine, _, path = _setup(tmp_path)
    view = inject_lora(engine, path, 1.0, 1.0, target_blocks="mid_block, up_blocks.1.attentions.0")
    chosen = lambda n: n.startswith("mid_block.") or n.startswith("up_blocks.1.attentions.0.")
    covered = {n for n in lf.module_names(engine.parts.unet, UNET_ALL)}
    gegl = {n for n, m in engine.parts.unet.named_modules() if type(m) is GEGLU}
    g = torch.Generator().manual_seed(0)
    probes = {}
    for name, m in engine.parts.unet.named_modules():
        if isinstance(m, torch.nn.Linear):
            probes[name] = torch.randn(3, m.in_features, generator=g)
        elif name in gegl:
            probes[name] = torch.randn(3, m.proj.in_features, generator=g)
        elif isinstance(m, torch.nn.Conv2d):
            probes[name] = torch.randn(1, m.in_channels, 6, 6, generator=g)
    tok = engine.parts.tokenizer
    te_probe = tok(["a cat"], padding="max_length", max_length=tok.model_max_length, return_tensors="pt").input_ids
    with torch.no_grad():
        base = {n: engine.parts.unet.get_submodule(n)(x) for n, x in probes.items()}
        base_te = engine.parts.text_encoder(te_probe)[0]
        with view.session("unet"), view.session("text"):
            ours = {n: view.parts.unet.get_submodule(n)(x) for n, x in probes.items()}
            ours_te = view.parts.text_encoder(te_probe)[0]
    changed = {n for n in probes if not torch.equal(base[n], ours[n])}
    want = {n for n in covered if chosen(n)}
    parents = {n[:-len(".proj")] for n in want if n[:-len(".proj")] in gegl}
    assert parents  # the chosen blocks hold GEGLU feed-forwards
    if strategy == "geglu":  # the term lives in the GEGLU; its proj alone computes the base projection
        want = (want - {p + ".proj" for p in parents}) | parents
    else:
        want |= parents
    assert changed == want
    assert torch.equal(base_te, ours_te)  # the text encoder is not listed, so it is untouched
    # the whole UNet: every module before the first targeted block sees the same input, so the same output
    outs = {}

    def grab(store, name):
        return lambda mod, args, out: store.__setitem__(name, out.detach().clone())

    for store, eng in (("base", engine), ("lora", view)):
        outs[store] = {}
        hs = [m.register_forward_hook(grab(outs[store], n)) for n, m in eng.parts.unet.named_modules()
              if n.startswith("down_blocks.") and isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]
        with eng.session("unet"):
            lf.run_unet(eng.parts.unet, lf.unet_inputs("sd1"))
        for h in hs:
            h.remove()
    assert outs["base"] and all(torch.equal(outs["base"][n], outs["lora"][n]) for n in outs["base"])


@pytest.mark.parametrize("mode", ["unmerged", "merged"])
def test_strength_change_moves_no_weight_and_keeps_graph_key(tmp_path, mode, strategy):
    engine, _, path = _setup(tmp_path)
    before = lf.snapshot(engine.parts.unet, engine.parts.text_encoder)
    views = [inject_lora(engine, path, s, s, mode=mode) for s in (0.5, 1.5, -2.0)]
    keys = {v.adapters[-1].graph_key for v in views}
    assert len(keys) == 1 and hash(next(iter(keys)))
    assert len({id(v.adapters[-1].binding) for v in views}) == 1  # one set of buffers for every strength
    ptrs = None
    outs = []
    for v in views + [views[0]]:
        with v.session("unet"):
            if mode == "unmerged":
                now = [t.data_ptr() for t in v.adapters[-1].binding._up_s["unet"]]
                assert ptrs is None or now == ptrs
                ptrs = now
            assert all(p.data_ptr() == ptr for (_, ptr, _), p in zip(before, engine.parts.unet.parameters()))
            outs.append(lf.run_unet(v.parts.unet, lf.unet_inputs("sd1")))
    assert torch.equal(outs[0], outs[-1])  # back to the first strength: bit-identical result
    assert not torch.equal(outs[0], outs[1])
    lf.assert_untouched(before, engine.parts.unet, engine.parts.text_encoder)


def _spans_back_to_back(tensors, flat=None):
    """Whether ``tensors`` tile one memory span without gaps or overlap (exactly ``flat``'s, when given)."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
    whole = flat is None or (spans[0][0] == flat.data_ptr()
                             and spans[-1][1] == flat.data_ptr() + flat.numel() * flat.element_size())
    return whole and all(end == nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))


def test_strength_buffers_are_one_flat_tensor_holding_strength_times_up(tmp_path):
    """The plain layers' buffers are disjoint views of one flat tensor per component (zeroed in one kernel), their
    packed sources make one span, so the rewrite adds over one pair per component, and every strength write leaves
    exactly ``strength * up`` in each buffer, also after other strengths and strength 0."""
    engine, _, path = _setup(tmp_path)
    strengths = (0.6, -1.7, 0.0, 1.0)
    views = [inject_lora(engine, path, s, s) for s in strengths]
    binding = views[0].adapters[-1].binding
    assert binding.components == ["text_encoder", "unet"]
    for comp in binding.components:
        bufs, (flat,) = binding._up_s[comp], binding._arenas[comp].flats.values()
        assert binding._loose[comp] == [] and len(bufs) > 4
        assert _spans_back_to_back(bufs, flat)
        assert _spans_back_to_back(binding._up[comp])  # the loader packed the sources in the same order
        (dst,), (src,) = binding._rewrite[comp]
        assert dst.data_ptr() == flat.data_ptr() and dst.numel() == flat.numel() == src.numel()
    for view, s in zip(views + views[:1], strengths + strengths[:1]):
        with view.session("unet"), view.session("text"):
            for comp in binding.components:
                for buf, up in zip(binding._up_s[comp], binding._up[comp]):
                    assert torch.equal(buf, up * s), (comp, s)


def test_strength_rewrite_of_a_block_subset_pairs_each_buffer_with_its_own_source(tmp_path):
    """With ``target_blocks`` the sources are a gappy subset of the packed ups: the rewrite takes several spans,
    and each buffer still holds exactly ``strength * its up``; the result matches plain math on the subset."""
    engine, sd, path = _setup(tmp_path)
    view = inject_lora(engine, path, 0.8, 0.0, target_blocks="down_blocks.0, up_blocks.1")
    binding = view.adapters[-1].binding
    dst, src = binding._rewrite["unet"]
    assert 1 < len(dst) < len(binding._up_s["unet"])
    assert sum(d.numel() for d in dst) == sum(b.numel() for b in binding._up_s["unet"])
    with view.session("unet"):
        for buf, up in zip(binding._up_s["unet"], binding._up["unet"]):
            assert torch.equal(buf, up * 0.8)


def test_stacking_two_files_and_the_same_file_twice(tmp_path, strategy):
    engine, sd_a, path_a = _setup(tmp_path, seed=1)
    _, sd_b, path_b = _setup(tmp_path, seed=2)
    stacked = inject_lora(inject_lora(engine, path_a, 0.6, 0.3), path_b, -0.8, 0.9)
    ref = _reference_engine([(sd_a, 0.6, 0.3), (sd_b, -0.8, 0.9)])
    assert lf.max_diff(lf.view_outputs(stacked), lf.view_outputs(ref)) <= TOL
    twice = inject_lora(inject_lora(engine, path_a, 0.4, 0.2, mode="merged"), path_a, 0.5, 0.1)
    once = inject_lora(engine, path_a, 0.9, 0.3)
    assert twice.adapters[0].graph_key != twice.adapters[1].graph_key
    assert lf.max_diff(lf.view_outputs(twice), lf.view_outputs(once)) <= TOL
    same_twice = inject_lora(inject_lora(engine, path_a, 0.4, 0.2), path_a, 0.5, 0.1)
    assert same_twice.adapters[0].binding is not same_twice.adapters[1].binding
    assert lf.max_diff(lf.view_outputs(same_twice), lf.view_outputs(once)) <= TOL


def test_input_view_and_modules_untouched(tmp_path, strategy):
    engine, _, path = _setup(tmp_path)
    before = lf.snapshot(engine.parts.unet, engine.parts.text_encoder)
    base = lf.view_outputs(engine)
    view = inject_lora(engine, path, 1.0, 1.0)
    assert engine.adapters == () and len(view.adapters) == 1
    assert view.parts is engine.parts
    lf.view_outputs(view)
    for a, b in zip(lf.view_outputs(engine), base):
        assert torch.equal(a, b)
    lf.assert_untouched(before, engine.parts.unet, engine.parts.text_encoder)


def test_sessions_attach_only_their_stage_and_nest(tmp_path, strategy):
    engine, _, path = _setup(tmp_path)
    view = inject_lora(engine, path, 1.0, 1.0)
    own = {id(m): len(m._forward_hooks) for m in engine.parts.text_encoder.modules()}  # transformers' hooks
    hooked = lambda root: lf.injected(root, own)
    n_unet = len(lf.module_names(engine.parts.unet, UNET_ALL))
    n_te = len(lf.module_names(engine.parts.text_encoder, lf.TE_LINEARS))
    with view.session("unet"):
        assert (hooked(engine.parts.unet), hooked(engine.parts.text_encoder)) == (n_unet, 0)
        with view.session("text"):
            assert (hooked(engine.parts.unet), hooked(engine.parts.text_encoder)) == (n_unet, n_te)
            with view.session("text"):  # the same view nested again: counted, not re-attached
                assert hooked(engine.parts.text_encoder) == n_te
        assert hooked(engine.parts.text_encoder) == 0
    assert hooked(engine.parts.unet) == 0


def test_two_strengths_of_one_binding_cannot_run_at_once(tmp_path):
    engine, _, path = _setup(tmp_path)
    before = lf.snapshot(engine.parts.unet)
    v1, v2 = inject_lora(engine, path, 1.0, 1.0), inject_lora(engine, path, 0.5, 1.0)
    with v1.session("unet"):
        with pytest.raises(RuntimeError, match="different strengths"):
            with v2.session("unet"):
                pass
    lf.assert_untouched(before, engine.parts.unet)
    with v2.session("unet"):  # and it still works afterwards
        lf.run_unet(v2.parts.unet, lf.unet_inputs("sd1"))


@pytest.mark.parametrize("strategy_name", ["hook", "geglu"])
def test_a_conv_lora_keeps_the_layers_stride_padding_and_dilation(strategy_name):
    """The tiny UNets' convs all have dilation 1 (a plain LoRA conv term that dropped the module's dilation would pass
    every model test). On a Conv2d with stride 2, padding 2 and dilation 2 the unmerged term adds what the merged fp64
    weight W + s * (alpha / r) * up @ down does, and detach restores the conv."""
    import torch.nn.functional as F

    from leandiffusion.lora.formats import LoraLayer
    from leandiffusion.lora.keymap import Target
    from leandiffusion.lora.unmerged import UnmergedBinding

    gen = torch.Generator().manual_seed(5)
    conv = torch.nn.Conv2d(8, 12, 3, stride=2, padding=2, dilation=2).requires_grad_(False)
    down, up = torch.randn(4, 8, 3, 3, generator=gen) / 8, torch.randn(12, 4, 1, 1, generator=gen)
    layer = LoraLayer("unet", "c", "kohya", down, up, 0.5, "lora_unet_c")
    binding = UnmergedBinding(("dilated", strategy_name), [Target("unet", "c", conv, layer.placed(
        torch.device("cpu"), torch.float32))], "t", strategy=strategy_name)
    x = torch.randn(2, 8, 11, 9, generator=gen)
    w = conv.weight.double()
    merged = w + 0.8 * 0.5 * (up.double().flatten(1) @ down.double().flatten(1)).reshape(w.shape)
    ref = F.conv2d(x.double(), merged, conv.bias.double(), stride=2, padding=2, dilation=2)
    base = conv(x)
    assert (ref - base.double()).abs().max() > 0.05
    binding.attach({"unet": 0.8})
    try:
        assert (conv(x).double() - ref).abs().max() <= TOL
    finally:
        binding.detach({"unet": 0.8})
    assert torch.equal(conv(x), base)

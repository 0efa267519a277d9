"""LoHa, LoKr and DoRA files (kohya/LyCORIS layout) against merged weights computed in fp64 from the published formulas.

Guards: every LyCORIS layout (LoHa through its Khatri-Rao low-rank form and built densely; LoKr with full, low-rank,
doubly low-rank and Tucker factors; DoRA on the input and the output axis, on LoRA, LoHa and LoKr) gives, unmerged and
merged, on SD1-like and SDXL-like tiny models incl. the text encoders, the output of a model whose weights were merged
by ``lorafiles.reference_delta`` / ``dora_reference_weight`` (written from the formulas, not through ``lora/``); a
perturbed factor fails that check; strength 0 is the base bit-exactly; a strength change reuses the binding; stacking
with a plain LoRA adds the terms; target_blocks leaves every other module alone; the model is left untouched afterwards.
"""
import re

import pytest
import torch

import torch.nn.functional as F

from leandiffusion.lora import inject_lora
from leandiffusion.lora.formats import LoraLayer
from leandiffusion.lora.fullrank import make_term
from leandiffusion.lora.keymap import Target
from leandiffusion.lora.lycoris import parse_lycoris
from leandiffusion.memory.engine import engine_from_parts, parts_from_components
from leandiffusion.tests.kit import tiny_components
from leandiffusion.tests.lora import lorafiles as lf

TOL = 1e-5
UNET_ALL = re.compile(lf.ATTN_FF.pattern + "|" + lf.LOCON.pattern)
PREFIX = {"unet": "lora_unet_", "text_encoder": "lora_te_", "text_encoder_2": "lora_te2_"}
CASES = lf.LYCORIS_CASES


def _roots(c):
    return {k: c[k] for k in ("unet", "text_encoder", "text_encoder_2") if c.get(k) is not None}


def _patterns(family, unet=UNET_ALL):
    pats = {"unet": unet, "text_encoder": lf.TE_LINEARS}
    if family == "sdxl":
        pats["text_encoder_2"] = lf.TE_LINEARS
    return pats


def _file(tmp_path, family, case, seed=0, unet=UNET_ALL):
    c = tiny_components(family)
    ldm = lf.tiny_sdxl_ldm_names(c["unet"]) if family == "sdxl" else None
    pats = _patterns(family, unet)
    if family == "sdxl":  # kohya's SDXL trainers use LDM names; the table covers the block modules
        pats["unet"] = re.compile(r"^(down_blocks|mid_block|up_blocks)\..*(" + unet.pattern + ")")
    sd = lf.lycoris_case(_roots(c), pats, case, seed=seed, ldm_names=ldm)
    return sd, lf.write(sd, tmp_path / f"{family}_{case}_{seed}.safetensors")


def _reference(family, files):
    """A fresh model whose weights hold every file's delta, merged in fp64 from the formulas (``files``: list of
    (state dict, unet strength, text strength); DoRA layers decompose the base weight, as the unmerged terms do)."""
    c = tiny_components(family)
    roots = _roots(c)
    ldm = lf.tiny_sdxl_ldm_names(c["unet"]) if family == "sdxl" else {}
    base = {(comp, n): m.weight.detach().double().clone() for comp, r in roots.items()
            for n, m in r.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))}
    new = {k: w.clone() for k, w in base.items()}
    for sd, s_unet, s_text in files:
        for (comp, name), w in base.items():
            spelled = ldm.get(name, name) if comp == "unet" else lf.file_name(roots[comp], name)
            prefix = "lora_te1_" if (comp == "text_encoder" and family == "sdxl") else PREFIX[comp]
            key = prefix + spelled.replace(".", "_")
            if not any(k.startswith(key + ".") for k in sd):
                continue
            s = s_unet if comp == "unet" else s_text
            module = roots[comp].get_submodule(name)
            delta = lf.reference_delta(sd, key, module)
            if key + ".dora_scale" in sd:
                new[(comp, name)] += lf.dora_reference_weight(w, delta, sd[key + ".dora_scale"], s) - w
            else:
                new[(comp, name)] += s * delta
    with torch.no_grad():
        for (comp, name), w in new.items():
            roots[comp].get_submodule(name).weight.copy_(w.float())
    return engine_from_parts(parts_from_components(c))


def _engine(family):
    engine = engine_from_parts(parts_from_components(tiny_components(family)))
    lf.run_text(engine.parts)  # transformers installs its output-capturing hooks at the first call
    return engine


def _terms(view):
    return {type(term).__name__ for comp in view.adapters[0].binding.components
            for _, _, term, _ in view.adapters[0].binding._slots[comp]}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode", ["unmerged", "merged"])
def test_sd1_matches_the_fp64_formula(tmp_path, case, mode, strategy):
    engine = _engine("sd1")
    before = lf.snapshot(engine.parts.unet, engine.parts.text_encoder)
    sd, path = _file(tmp_path, "sd1", case)
    view = inject_lora(engine, path, 0.7, -0.6, mode=mode)
    ref = lf.view_outputs(_reference("sd1", [(sd, 0.7, -0.6)]))
    assert lf.max_diff(ref, lf.view_outputs(engine)) > 0.05, "the adapter must change the outputs for the test to mean anything"
    assert lf.max_diff(lf.view_outputs(view), ref) <= TOL
    lf.assert_untouched(before, engine.parts.unet, engine.parts.text_encoder)
    if mode == "unmerged":  # each layout runs the term it is documented to
        want = {"loha_lowrank": {"_LohaKhatriRao"}, "loha_dense": {"_DenseTerm", "_LohaKhatriRao"},
                "locon_tucker": {"LinearTerm", "ConvTerm"}}.get(
            case, {"_KronTerm"} if case.startswith("lokr_") and "dora" not in case else {"_DenseTerm"})
        assert _terms(view) == want


@pytest.mark.parametrize("mode", ["unmerged", "merged"])
def test_a_bf16_tucker_locon_matches_the_fp64_formula(tmp_path, mode):
    """A Tucker LoCon saved in bf16 (as most LyCORIS files are) must not have its ``lora_mid @ lora_down`` product
    rounded back to bf16 at load, a rounding ComfyUI does not make (2.9e-3 from ComfyUI's merged weights on the tiny
    UNet's output at strength 1; every other layout within 4e-6). On an fp32 model the output must be the fp64
    formula's over the file's bf16 values."""
    engine = _engine("sd1")
    sd, _ = _file(tmp_path, "sd1", "locon_tucker")
    sd = {k: v.to(torch.bfloat16) for k, v in sd.items()}
    path = lf.write(sd, tmp_path / "tucker_bf16.safetensors")
    ref = lf.view_outputs(_reference("sd1", [(sd, 1.0, 1.0)]))
    assert lf.max_diff(lf.view_outputs(inject_lora(engine, path, mode=mode)), ref) <= TOL


@pytest.mark.parametrize("case", ["loha_lowrank", "lokr_both_lowrank", "dora_in", "lokr_dora_in"])
def test_sdxl_with_ldm_names_and_both_text_encoders(tmp_path, case):
    engine = _engine("sdxl")
    sd, path = _file(tmp_path, "sdxl", case)
    assert any(k.startswith("lora_unet_input_blocks_") for k in sd) and any(k.startswith("lora_te2_") for k in sd)
    ref = lf.view_outputs(_reference("sdxl", [(sd, 0.8, 0.5)]))
    for mode in ("unmerged", "merged"):
        assert lf.max_diff(lf.view_outputs(inject_lora(engine, path, 0.8, 0.5, mode=mode)), ref) <= TOL


@pytest.mark.parametrize("case,key", [("loha_dense", "hada_w2_b"), ("loha_lowrank", "hada_w1_a"),
                                      ("lokr_tucker", "lokr_t2"), ("lokr_both_lowrank", "lokr_w1_b"),
                                      ("dora_in", "dora_scale"), ("dora_out", "dora_scale"),
                                      ("lokr_w2_lowrank", "alpha"), ("lokr_full", "lokr_w2"), ("loha_dense", "alpha"),
                                      ("locon_tucker", "lora_mid.weight")])
def test_a_perturbed_factor_fails_the_check(tmp_path, case, key):
    """The tolerance can fail: one factor of one layer off by 2% moves the output past TOL."""
    assert _perturbed_error(tmp_path, case, key) > TOL


def test_lokr_with_two_full_factors_ignores_alpha(tmp_path):
    """LyCORIS and ComfyUI scale a LoKr layer by alpha / rank only when a factor is low-rank; with lokr_w1 and
    lokr_w2 both stored whole the scale is 1 (the same 2% change of alpha that fails the check above is a no-op)."""
    assert _perturbed_error(tmp_path, "lokr_full", "alpha") <= TOL


def _conv_layer(kind: str, gen: torch.Generator):
    """A layer for a Conv2d(8 -> 12, 3x3) and its delta at strength 1, in fp64 from the formulas (independent of
    ``lora/``); the factors are fp32 values, so the fp64 reference sees what the layer holds."""
    def r(*shape):
        return torch.randn(*shape, generator=gen) / shape[-1] ** 0.5
    if kind.startswith("loha"):
        rank = 2 if kind == "loha_khatri_rao" else 4  # 2 * 2 * (72 + 12) <= 72 * 12 < 4 * 4 * (72 + 12)
        g = {".hada_w1_a": r(12, rank), ".hada_w1_b": r(rank, 72), ".hada_w2_a": r(12, rank),
             ".hada_w2_b": r(rank, 72), ".alpha": torch.tensor(1.5)}
        d = (g[".hada_w1_a"].double() @ g[".hada_w1_b"].double()) * (g[".hada_w2_a"].double() @
                                                                    g[".hada_w2_b"].double()) * 1.5 / rank
        return parse_lycoris(g, "unet", "c", "kohya", "lora_unet_c", "t", None), d.reshape(12, 8, 3, 3)
    if kind == "lokr":
        g = {".lokr_w1": r(3, 2), ".lokr_w2": r(4, 4, 3, 3)}  # full factors: scale 1
        w1, w2 = g[".lokr_w1"].double(), g[".lokr_w2"].double().flatten(1)
        d = (w1[:, None, :, None] * w2[None, :, None, :]).reshape(12, 2 * 36)  # kron
        return parse_lycoris(g, "unet", "c", "kohya", "lora_unet_c", "t", None), d.reshape(12, 8, 3, 3)
    down, up = r(4, 8, 3, 3), r(12, 4, 1, 1)  # DoRA on a LoCon layer, input axis
    magnitude = 0.5 + torch.rand(1, 8, 1, 1, generator=gen)
    layer = LoraLayer("unet", "c", "kohya", down, up, 0.5, "lora_unet_c", magnitude)
    return layer, 0.5 * (up.double().flatten(1) @ down.double().flatten(1)).reshape(12, 8, 3, 3)


@pytest.mark.parametrize("kind", ["loha_khatri_rao", "loha_dense", "lokr", "dora"])
def test_conv_terms_keep_the_layers_stride_padding_and_dilation(kind):
    """The tiny UNets' convs all have dilation 1, so a term that dropped the module's dilation (LoKr's grouped conv,
    LoHa's Khatri-Rao and dense convs, the dense DoRA fallback) would pass every model test. On a Conv2d with stride 2,
    padding 2 and dilation 2 each unmerged term adds what the merged fp64 weight does."""
    gen = torch.Generator().manual_seed(3)
    conv = torch.nn.Conv2d(8, 12, 3, stride=2, padding=2, dilation=2)
    layer, delta = _conv_layer(kind, gen)
    hook, source, buffer = make_term(Target("unet", "c", conv, layer.placed(torch.device("cpu"), torch.float32)))
    assert type(hook).__name__ == {"loha_khatri_rao": "_LohaKhatriRao", "lokr": "_KronTerm"}.get(kind, "_DenseTerm")
    strength = 0.8
    buffer.copy_(strength * source)
    x = torch.randn(2, 8, 11, 9, generator=gen)
    w = conv.weight.detach().double()
    if kind == "dora":
        a, m = w + delta, layer.magnitude.double()
        merged = w + strength * (a * m / (a.square().sum(dim=(0, 2, 3), keepdim=True).sqrt() +
                                          torch.finfo(torch.float32).eps) - w)
    else:
        merged = w + strength * delta
    ref = F.conv2d(x.double(), merged, conv.bias.detach().double(), stride=2, padding=2, dilation=2)
    with torch.no_grad():
        out = conv(x)
        got = hook(conv, (x,), out)
    got = out if got is None else got
    assert (ref - conv(x).detach().double()).abs().max() > 0.05
    assert (got.double() - ref).abs().max() <= TOL


def test_loha_takes_the_khatri_rao_form_exactly_when_documented():
    """On the tiny models' layers every rank choice falls clear of the rule's boundary, so a cost that left out the
    output side (or a strict ``<``) would pass there. The rank-``r1 r2`` form is taken when ``r1 r2 (n + out) <= n *
    out``: for n = 72, out = 12 (864) ranks 2 x 5 (840) qualify, 3 x 4 (1008) do not; for n = out = 12 (144) ranks 2 x 3
    (144) sit on the boundary and qualify."""
    def loha(out, n, r1, r2):
        g = {".hada_w1_a": torch.ones(out, r1), ".hada_w1_b": torch.ones(r1, n), ".hada_w2_a": torch.ones(out, r2),
             ".hada_w2_b": torch.ones(r2, n)}
        return parse_lycoris(g, "unet", "c", "kohya", "lora_unet_c", "t", None)
    assert loha(12, 72, 2, 5).khatri_rao_cheaper() and not loha(12, 72, 3, 4).khatri_rao_cheaper()
    assert loha(12, 12, 2, 3).khatri_rao_cheaper() and not loha(12, 12, 1, 7).khatri_rao_cheaper()


def _unequal_ranks(sd: dict, case: str) -> dict:
    """``loha_lowrank`` with the second Hadamard factor at rank 3 (the first keeps rank 2); ``lokr_full`` with
    ``lokr_w1`` stored as a rank-2 ``lokr_w1_a @ lokr_w1_b`` and ``lokr_w2`` whole."""
    gen = torch.Generator().manual_seed(5)
    out = {}
    for k, v in sd.items():
        if k.endswith(".hada_w2_a"):
            out[k] = torch.randn(v.shape[0], 3, generator=gen) / 3 ** 0.5
        elif k.endswith(".hada_w2_b"):
            out[k] = torch.randn(3, v.shape[1], generator=gen)
        elif k.endswith(".lokr_w1"):
            base = k[:-len(".lokr_w1")]
            out[base + ".lokr_w1_a"] = torch.randn(v.shape[0], 2, generator=gen) / 2 ** 0.5
            out[base + ".lokr_w1_b"] = torch.randn(2, v.shape[1], generator=gen)
        else:
            out[k] = v
    return out


@pytest.mark.parametrize("case", ["loha_lowrank", "lokr_full"])
def test_alpha_is_divided_by_the_documented_rank(tmp_path, case):
    """Every file in the other tests gives LoHa's two Hadamard factors one rank and decomposes LoKr's W2 whenever W1 is,
    so dividing alpha by the second LoHa rank (hada_w2_b's rows) or ignoring a decomposed W1 (LoKr scale 1) would pass
    them. LoHa scales by alpha / hada_w1_b's rows; LoKr with only lokr_w1 decomposed by alpha / its rank (ComfyUI
    ``loha.py`` / ``lokr.py``, LyCORIS); reference: the fp64 formula."""
    engine = _engine("sd1")
    sd, _ = _file(tmp_path, "sd1", case)
    sd = _unequal_ranks(sd, case)
    assert any(k.endswith((".hada_w2_b", ".lokr_w1_b")) for k in sd)
    path = lf.write(sd, tmp_path / "unequal.safetensors")
    ref = lf.view_outputs(_reference("sd1", [(sd, 0.9, 0.9)]))
    assert lf.max_diff(ref, lf.view_outputs(engine)) > 0.05
    for mode in ("unmerged", "merged"):
        assert lf.max_diff(lf.view_outputs(inject_lora(engine, path, 0.9, 0.9, mode=mode)), ref) <= TOL


def _perturbed_error(tmp_path, case, key):
    engine = _engine("sd1")
    sd, _ = _file(tmp_path, "sd1", case)
    victim = next(k for k in sorted(sd) if k.endswith("." + key) and "mid_block" in k)
    bad = dict(sd)
    bad[victim] = sd[victim] * 1.02
    path = lf.write(bad, tmp_path / "bad.safetensors")
    ref = lf.view_outputs(_reference("sd1", [(sd, 1.0, 1.0)]))
    return lf.max_diff(lf.view_outputs(inject_lora(engine, path, 1.0, 1.0)), ref)


@pytest.mark.parametrize("case", ["loha_lowrank", "loha_dense", "lokr_tucker", "dora_in", "dora_out"])
@pytest.mark.parametrize("mode", ["unmerged", "merged"])
def test_strength_zero_is_the_base_bit_exactly_also_after_another_strength(tmp_path, case, mode):
    engine = _engine("sd1")
    base = lf.view_outputs(engine)
    _, path = _file(tmp_path, "sd1", case)
    strong, off = (inject_lora(engine, path, s, s, mode=mode) for s in (0.9, 0.0))
    assert lf.max_diff(lf.view_outputs(strong), base) > 0.05
    for a, b in zip(lf.view_outputs(off), base):
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", ["loha_dense", "lokr_w2_lowrank", "dora_out"])
def test_strength_change_reuses_the_binding_and_never_moves_a_weight(tmp_path, case):
    """One binding (one set of buffers, one graph key) serves every strength; only its buffers are rewritten."""
    engine = _engine("sd1")
    sd, path = _file(tmp_path, "sd1", case)
    ptrs = [p.data_ptr() for p in engine.parts.unet.parameters()]
    views = [inject_lora(engine, path, s, s) for s in (1.0, -0.5)]
    assert views[0].adapters[0].binding is views[1].adapters[0].binding
    assert views[0].adapters[0].graph_key == views[1].adapters[0].graph_key
    for view, s in ((views[0], 1.0), (views[1], -0.5), (views[0], 1.0)):
        assert lf.max_diff(lf.view_outputs(view), lf.view_outputs(_reference("sd1", [(sd, s, s)]))) <= TOL
    assert ptrs == [p.data_ptr() for p in engine.parts.unet.parameters()]


@pytest.mark.parametrize("mode", ["unmerged", "merged"])
def test_stacked_with_a_plain_lora_the_terms_add(tmp_path, mode, strategy):
    engine = _engine("sd1")
    before = lf.snapshot(engine.parts.unet, engine.parts.text_encoder)
    roots = {"unet": engine.parts.unet, "text_encoder": engine.parts.text_encoder}
    plain = lf.kohya_state_dict(roots, _patterns("sd1"), rank=3, seed=4)
    plain_path = lf.write(plain, tmp_path / "plain.safetensors")
    loha, loha_path = _file(tmp_path, "sd1", "loha_dense", seed=1)
    lokr, lokr_path = _file(tmp_path, "sd1", "lokr_tucker", seed=2)
    view = inject_lora(engine, plain_path, 0.5, 0.5, mode=mode)
    view = inject_lora(view, lokr_path, -0.8, 0.3, mode=mode)
    view = inject_lora(view, loha_path, 0.6, 0.9, mode=mode)
    ref = _reference("sd1", [(plain, 0.5, 0.5), (lokr, -0.8, 0.3), (loha, 0.6, 0.9)])
    assert lf.max_diff(lf.view_outputs(view), lf.view_outputs(ref)) <= TOL
    lf.assert_untouched(before, engine.parts.unet, engine.parts.text_encoder)


def test_dora_stacked_on_a_plain_lora_decomposes_the_base_weight(tmp_path):
    """Unmerged, a DoRA term is computed against the base weight whatever else sits on the layer (docs/lora.md)."""
    engine = _engine("sd1")
    roots = {"unet": engine.parts.unet, "text_encoder": engine.parts.text_encoder}
    plain = lf.kohya_state_dict(roots, _patterns("sd1"), rank=3, seed=4)
    dora, dora_path = _file(tmp_path, "sd1", "dora_out", seed=3)
    view = inject_lora(engine, lf.write(plain, tmp_path / "plain.safetensors"), 0.5, 0.5)
    view = inject_lora(view, dora_path, 0.7, 0.7)
    assert lf.max_diff(lf.view_outputs(view), lf.view_outputs(_reference("sd1", [(plain, 0.5, 0.5), (dora, 0.7, 0.7)]))) <= TOL


@pytest.mark.parametrize("case", ["lokr_tucker", "loha_dense", "dora_in"])
@pytest.mark.parametrize("mode", ["unmerged", "merged"])
def test_target_blocks_select_only_their_layers(tmp_path, case, mode):
    engine = _engine("sd1")
    sd, path = _file(tmp_path, "sd1", case)
    view = inject_lora(engine, path, 1.0, 1.0, target_blocks="mid_block, up_blocks.1.attentions.0", mode=mode)
    kept = {k: v for k, v in sd.items()
            if k.startswith(("lora_unet_mid_block_", "lora_unet_up_blocks_1_attentions_0_"))}
    assert kept and len(kept) < len(sd)
    ref = lf.view_outputs(_reference("sd1", [(kept, 1.0, 1.0)]))
    assert lf.max_diff(lf.view_outputs(view), ref) <= TOL


@pytest.mark.parametrize("kind", ["loha", "lokr", "lokr_tucker"])
def test_matches_peft(tmp_path, kind):
    """peft's LoHa/LoKr layers (their own formulas; LyCORIS' key names) on the tiny UNet's attention and conv layers,
    their factors saved under kohya names: the same output. LoKr with a low-rank W2 (peft scales a LoKr by alpha / r
    even with two full factors, where LyCORIS and ComfyUI use 1); ``lokr_tucker``: peft's ``use_effective_conv2d``
    writes lokr_t2 for the 3x3 convs (ComfyUI 0.3.64 fails on those: tests/integration/test_comfyui_lycoris.py).
    peft before 0.14 (huggingface/peft PR #2180; the test extra's floor is 0.12) never applies a LoKr's alpha / r:
    there the LoKr cases take alpha = r, a scale of 1 in both (the tests above check the alpha / r scaling itself,
    against ``lorafiles.reference_delta``)."""
    import peft
    from peft import LoHaConfig, LoKrConfig, inject_adapter_in_model
    from peft.utils import get_peft_model_state_dict

    targets = r".*(attn1\.to_q|attn2\.to_v|ff\.net\.2|resnets\.0\.conv1)"
    ref_c = tiny_components("sd1")
    rank, old_peft = 2, tuple(int(v) for v in peft.__version__.split(".")[:2]) < (0, 14)
    alpha = float(rank) if kind != "loha" and old_peft else 3.0
    config = (LoHaConfig(r=rank, alpha=alpha, target_modules=targets, init_weights=False) if kind == "loha" else
              LoKrConfig(r=rank, alpha=alpha, target_modules=targets, init_weights=False, decompose_both=True,
                         use_effective_conv2d=kind == "lokr_tucker"))
    unet = inject_adapter_in_model(config, ref_c["unet"])
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # peft's random init is O(1) per factor: shrink so the model stays in range
        for name, p in unet.named_parameters():
            if "hada_" in name or "lokr_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 2.0 / max(p.shape) ** 0.5)
    peft_sd = get_peft_model_state_dict(unet)
    assert peft_sd and any("lokr_w2_a" in k or "hada_" in k for k in peft_sd)
    assert any("lokr_t2" in k for k in peft_sd) == (kind == "lokr_tucker")
    sd = {}
    for key, v in peft_sd.items():
        module, _, suffix = key.rpartition(".")
        sd[f"lora_unet_{module.replace('.', '_')}.{suffix}"] = v.detach().clone()
        sd[f"lora_unet_{module.replace('.', '_')}.alpha"] = torch.tensor(alpha)
    path = lf.write(sd, tmp_path / f"peft_{kind}.safetensors")
    engine = _engine("sd1")
    inputs = lf.unet_inputs("sd1")
    want = lf.run_unet(unet, inputs)
    base = lf.run_unet(engine.parts.unet, inputs)
    assert (want - base).abs().max() > 0.05
    for mode in ("unmerged", "merged"):
        view = inject_lora(engine, path, 1.0, 1.0, mode=mode)
        with view.session("unet"):
            got = lf.run_unet(view.parts.unet, inputs)
        assert ((got - want).abs().max() / want.abs().max()).item() <= TOL  # fp32, relative

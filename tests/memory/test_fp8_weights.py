"""fp8 weight storage (``memory/fp8_weights.py``, ``weight_dtype`` fp8_e4m3fn / fp8_e4m3fn_fast) on the CPU.

Guards the promises: quantization stays within e4m3's rounding bound; an fp8 layer computes exactly what a plain
layer holding the dequantized weight computes; the storage survives ``module.to(dtype)`` (which casts every floating
tensor, float8 included) byte for byte; the tiny SD1 and Z-Image denoisers stay close to their fp32 originals
(measured and bounded below); every VRAM policy gives ``full``'s output bit for bit; the plan counts one byte per
fp8 weight (half of bf16); already-fp8 weights are taken as given; the ``fast`` capability is one decision
(checked by monkeypatching), with one log line where it is refused; bad inputs name the choices.
"""
import copy
import logging

import pytest
import torch

from leandiffusion.memory import fp8_matmul, fp8_weights as fp8
from leandiffusion.memory.engine import parts_from_components
from leandiffusion.memory.load import WEIGHT_DTYPES, build_engine, load_engine
from leandiffusion.memory.plan import GiB, module_bytes
from leandiffusion.memory.policies import apply_vram_policy, stream_working_minimum_gb
from leandiffusion.memory.tiny_zimage import build_tiny_zimage
from leandiffusion.tests.kit import tiny_parts

POLICIES = ["full", "balanced", "lowvram", "stream", "auto"]
# Relative L2 distance of one denoiser call, fp8 storage vs the fp32 original (CPU, fp32 compute, seed-fixed tiny
# random models): measured 0.088 (SD1) and 0.043 (Z-Image); bf16 storage of the same models: 0.0057 / 0.0028. fp8
# keeps 3 mantissa bits (per-weight error ~2.6% rms) and the tiny random UNet amplifies it through ~80 layers.
REL_BOUND = {"sd1": 0.15, "zimage": 0.08}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _sd1_call(unet, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 4, 8, 8, generator=g)
    ctx = torch.randn(2, 77, unet.config.cross_attention_dim, generator=g)
    with torch.no_grad():
        return unet(x, torch.tensor(500), encoder_hidden_states=ctx, return_dict=False)[0]


def _zimage_call(dit, seed=1):
    g = torch.Generator().manual_seed(seed)
    x, t = torch.randn(2, 16, 8, 8, generator=g), torch.rand(2, generator=g)
    captions = [torch.randn(n, dit.config.cap_feat_dim, generator=g) for n in (5, 40)]
    with torch.no_grad():
        out = dit(list(x.unsqueeze(2).unbind(0)), t, captions, return_dict=False)[0]
    return torch.stack(out).squeeze(2)


CALLS = {"sd1": _sd1_call, "zimage": _zimage_call}


def _parts(family):
    return tiny_parts("sd1") if family == "sd1" else parts_from_components(build_tiny_zimage(seed=0))


# ------------------------------------------------------------------------------------------------------ math
def test_quantize_round_trip_is_within_e4m3_rounding():
    """``|Q s - W| <= max(2^-4 |W|, 2^-10 s)`` per element (half an ulp of 3 mantissa bits; half the subnormal step
    below 2^-6 s), ``s = amax / 448`` in fp32, the largest element lands on 448 exactly; zeros and NaN handled."""
    g = torch.Generator().manual_seed(0)
    for w in (torch.randn(64, 96, generator=g) * 0.02,
              torch.randn(32, 16, 3, 3, generator=g) * torch.logspace(-6, 1, 32).view(32, 1, 1, 1),  # wide range
              torch.randn(40, 40, generator=g).to(torch.bfloat16)):
        q, s = fp8.quantize(w)
        w32 = w.float()
        assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
        assert s == float(w32.abs().amax() / 448.0)
        assert q.float().abs().max().item() == 448.0
        err = (fp8.dequantize(q, s) - w32).abs()
        bound = torch.maximum(w32.abs() * 2 ** -4, torch.full_like(w32, s * 2 ** -10))
        assert bool((err <= bound * (1 + 1e-6)).all())
        assert 0.01 < (err.norm() / w32.norm()).item() < 0.04  # fp8 really rounds: ~2.6% rms
    q, s = fp8.quantize(torch.zeros(4, 4))
    assert s == 1.0 and not q.float().any()
    with pytest.raises(ValueError, match="layer.weight: holds NaN or infinite"):
        fp8.quantize(torch.tensor([[1.0, float("nan")]]), name="layer.weight")
    w = torch.randn(8, 8)
    before = w.clone()
    fp8.quantize(w)
    assert torch.equal(w, before)  # the caller's fp32 tensor is never divided in place


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_fp8_layer_equals_a_plain_layer_holding_the_dequantized_weight(dtype):
    g = torch.Generator().manual_seed(1)
    layers = [torch.nn.Linear(48, 40), torch.nn.Linear(33, 7, bias=False),
              torch.nn.Conv2d(6, 10, 3, stride=2, padding=1), torch.nn.Conv2d(6, 4, 1, bias=False)]
    inputs = [torch.randn(3, 5, 48, generator=g), torch.randn(4, 33, generator=g),
              torch.randn(2, 6, 9, 9, generator=g), torch.randn(2, 6, 5, 5, generator=g)]
    for layer, x in zip(layers, inputs):
        layer = layer.to(dtype)
        q = copy.deepcopy(layer)
        fp8.quantize_module(q, dtype)
        assert fp8.is_fp8_layer(q) and isinstance(q, type(layer))  # still a Linear / Conv2d for LoRA targets
        plain = copy.deepcopy(q)
        assert fp8.dequantize_module(plain) == 1 and type(plain) is type(layer)
        assert plain.weight.dtype == dtype
        x = x.to(dtype)
        with torch.no_grad():
            got, want = q(x), plain(x)
        tol = 1e-6 if dtype == torch.float32 else 0.0
        assert (got - want).abs().max().item() <= tol, type(layer).__name__
        assert torch.equal(q.weight, plain.weight)  # the read-only ``weight`` is the dequantized weight
        assert tuple(fp8.weight_shape(q)) == tuple(layer.weight.shape)


def test_module_to_a_dtype_keeps_the_fp8_storage_byte_for_byte():
    """``module.to(bf16)`` casts every floating tensor (float8 counts): the storage is uint8 and the scale int32,
    so they stay; biases and norms follow the cast; diffusers' ``dtype`` reports the compute dtype."""
    unet = tiny_parts("sd1").unet
    fp8.quantize_module(unet, torch.float32)
    layers = fp8.fp8_layers(unet)
    before = {n: (m.weight_fp8.clone(), m.weight_scale.clone()) for n, m in layers}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        unet.to(dtype)
        assert unet.dtype == dtype
        for n, m in layers:
            assert m.weight_fp8.dtype == torch.uint8 and torch.equal(m.weight_fp8, before[n][0]), n
            assert torch.equal(m.weight_scale, before[n][1]), n
            assert m.compute_dtype == dtype and m.weight.dtype == dtype
            assert m.bias is None or m.bias.dtype == dtype
    assert fp8.storage_name(unet) == "fp8_e4m3fn"


@pytest.mark.parametrize("family", ["sd1", "zimage"])
def test_tiny_denoiser_with_fp8_storage_stays_close_to_fp32(family):
    ref_parts, parts = _parts(family), _parts(family)
    ref = CALLS[family](ref_parts.unet)
    summary = fp8.quantize_module(parts.unet, torch.float32)
    linears = [m for m in parts.unet.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]
    assert summary.layers == len(linears) and summary.skipped == ()
    got = CALLS[family](parts.unet)
    assert 0.005 < _rel(got, ref) < REL_BOUND[family]
    plain = copy.deepcopy(parts.unet)
    fp8.dequantize_module(plain)
    assert (CALLS[family](plain) - got).abs().max().item() <= 1e-6


# ------------------------------------------------------------------------------------------------------ policies
def _budget(parts):
    """A stream budget that keeps ~30% of the fp8 denoiser's block weights resident (the rest streams)."""
    return stream_working_minimum_gb(parts, "cpu") + 0.3 * module_bytes(parts.unet, torch.float32) / GiB


def _fp8_engine(family, policy, weight_dtype="fp8_e4m3fn"):
    parts = _parts(family)
    budget = 4.0
    if policy == "stream":
        fp8.quantize_module(parts.unet, torch.float32)  # the budget is sized on the fp8 model
        budget = _budget(parts) if family == "sd1" else stream_working_minimum_gb(parts, "cpu")
    return build_engine(parts, policy, budget, weight_dtype=weight_dtype, device="cpu")


def _engine_call(engine):
    with engine.session("unet"):
        return CALLS[engine.family](engine.parts.unet)


@pytest.fixture(scope="module", params=["sd1", "zimage"])
def fp8_full(request):
    return request.param, _engine_call(_fp8_engine(request.param, "full"))


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_equals_full_with_fp8_storage(fp8_full, policy):
    """CPU: bit-identical (the fp8 bytes move verbatim; the same ops run). ``stream`` really streams fp8 blocks."""
    family, ref = fp8_full
    engine = _fp8_engine(family, policy)
    assert engine.dtype == torch.float32 and fp8.storage_name(engine.parts.unet) == "fp8_e4m3fn"
    assert torch.equal(_engine_call(engine), ref)
    assert torch.equal(_engine_call(engine), ref)  # a second forward reuses the staging ring
    if policy == "stream":
        streamer = engine.placement.streamer
        assert 0 < len(streamer.schedule.streamed) <= len(streamer.schedule.order)  # Z-Image: at its minimum
        streamed = dict(engine.parts.unet.named_modules())[streamer.schedule.order[streamer.schedule.streamed[0]].name]
        storage = [m.weight_fp8 for m in streamed.modules() if fp8.is_fp8_layer(m)]
        lo, hi = streamer.arena.data_ptr(), streamer.arena.data_ptr() + streamer.arena.numel()
        assert storage and all(lo <= s.data_ptr() < hi and s.dtype == torch.uint8 for s in storage)
        assert streamer.hold(10 * 2 ** 30) > 0  # held units: filled by the next forward, then computed in place
        assert torch.equal(_engine_call(engine), ref) and torch.equal(_engine_call(engine), ref)
        held = streamer._held.buffer
        assert all(held.data_ptr() <= s.data_ptr() < held.data_ptr() + held.numel() for s in storage)
        streamer.release_held()
        assert torch.equal(_engine_call(engine), ref) and all(lo <= s.data_ptr() < hi for s in storage)


def test_the_plan_counts_one_byte_per_fp8_weight_and_names_the_storage():
    parts = tiny_parts("sd1")
    bf16 = module_bytes(parts.unet, torch.bfloat16)
    summary = fp8.quantize_module(parts.unet, torch.bfloat16)
    rest = sum(p.numel() * 2 for n, p in parts.unet.named_parameters() if not n.endswith("weight_fp8"))
    got = module_bytes(parts.unet, torch.bfloat16)
    n_params = len(list(parts.unet.parameters()))
    assert summary.fp8_bytes + rest <= got < summary.fp8_bytes + rest + 512 * (n_params + 1)  # 512-byte alignment
    assert 0.45 < got / bf16 < 0.56  # half of bf16 (biases and norms stay bf16)
    plan = apply_vram_policy(parts, "full", device="cpu", dtype=torch.bfloat16).plan
    assert plan.unet_bytes == got and plan.unet_storage == "fp8_e4m3fn"
    assert "dtypes: UNet fp8_e4m3fn (computes in bf16), text bf16" in plan.render()
    plain = apply_vram_policy(tiny_parts("sd1"), "full", device="cpu", dtype=torch.bfloat16).plan
    assert plain.unet_storage == "" and "dtypes: UNet bf16, text bf16" in plain.render()


def test_a_stream_budget_keeps_about_twice_the_weights_resident_with_fp8():
    """At one budget, the stream plan of the fp8 UNet holds at least as many block weights resident as the bf16
    plan, and every streamable unit's bytes about halve (what the budget is spent on)."""
    from leandiffusion.memory.units import trace_units

    plain, quant = tiny_parts("sd1"), tiny_parts("sd1")
    fp8.quantize_module(quant.unet, torch.bfloat16)
    units_plain = trace_units(plain.unet, (2, 8, 8), torch.bfloat16)
    units_fp8 = trace_units(quant.unet, (2, 8, 8), torch.bfloat16)
    for a, b in zip(units_plain, units_fp8):
        assert a.name == b.name and 0.4 < b.nbytes / a.nbytes < 0.65, a.name
    budget = stream_working_minimum_gb(plain, "cpu", torch.bfloat16) + \
        0.2 * module_bytes(plain.unet, torch.bfloat16) / GiB
    p_plain = apply_vram_policy(plain, "stream", device="cpu", dtype=torch.bfloat16, vram_budget_gb=budget).plan
    p_fp8 = apply_vram_policy(quant, "stream", device="cpu", dtype=torch.bfloat16, vram_budget_gb=budget).plan
    assert p_fp8.streamed_units < p_plain.streamed_units
    assert p_fp8.unet_streamed_bytes < p_plain.unet_streamed_bytes / 2


# ------------------------------------------------------------------------------------------------------ inputs
def test_already_fp8_weights_are_stored_as_given():
    """``prequantized`` (a split fp8 checkpoint: float8 tensors with their scales) is stored without re-quantizing;
    a layer whose weight is itself float8_e4m3fn is stored with scale 1; bad entries name the layer."""
    unet = tiny_parts("sd1").unet
    names = [n for n, m in unet.named_modules() if isinstance(m, torch.nn.Linear)][:3]
    given = {}
    for i, n in enumerate(names):
        q, s = fp8.quantize(unet.get_submodule(n).weight * (i + 2))
        given[n + ".weight" if i % 2 else n] = (q, torch.tensor([s]) if i == 2 else s)
    plain = unet.get_submodule("conv_in")
    plain.weight.data = plain.weight.data.clamp(-0.5, 0.5).to(torch.float8_e4m3fn)
    raw = plain.weight.data.clone()
    fp8.quantize_module(unet, torch.float32, prequantized=given)
    for i, n in enumerate(names):
        layer = unet.get_submodule(n)
        q, s = given[n + ".weight" if i % 2 else n]
        assert torch.equal(layer.weight_fp8, q.view(torch.uint8)) and layer.fp8_scale == float(s)
    assert torch.equal(plain.weight_fp8, raw.view(torch.uint8)) and plain.fp8_scale == 1.0
    fresh = tiny_parts("sd1").unet
    q = fp8.quantize(fresh.conv_in.weight)[0]
    cases = [({"nope": (q, 1.0)}, "no nn.Linear / nn.Conv2d of that name"),
             ({"conv_in": (q.float(), 1.0)}, "expected a torch.float8_e4m3fn tensor"),
             ({"conv_in": (q[:1], 1.0)}, "does not match the layer's weight"),
             ({"conv_in": (q, float("nan"))}, "finite positive"),
             ({"conv_in": (q, torch.ones(2))}, "per-tensor scale"),
             ({"conv_in": q}, "pair")]
    for bad, message in cases:
        with pytest.raises((ValueError, TypeError), match=message):
            fp8.quantize_module(fresh, torch.float32, prequantized=bad)
    assert not fp8.fp8_layers(fresh)  # refused before any layer changed
    with pytest.raises(ValueError, match="compute_dtype"):
        fp8.quantize_module(fresh, torch.float8_e4m3fn)


def test_a_bad_weight_dtype_lists_the_fp8_choices():
    assert WEIGHT_DTYPES[-2:] == ("fp8_e4m3fn", "fp8_e4m3fn_fast")
    for bad in ("fp8", "float8_e4m3fn", "e4m3"):
        with pytest.raises(ValueError, match="expected one of auto, fp16, bf16, fp32, fp8_e4m3fn, fp8_e4m3fn_fast"):
            load_engine("tiny-random (test)", weight_dtype=bad, device="cpu")
    with pytest.raises(ValueError, match="vae_dtype='fp8_e4m3fn'"):  # the VAE keeps a compute dtype
        load_engine("tiny-random (test)", vae_dtype="fp8_e4m3fn", device="cpu")


def test_load_engine_stores_the_denoiser_in_fp8_and_keeps_text_and_vae_in_the_compute_dtype():
    engine = load_engine("tiny-random (test)", "full", weight_dtype="fp8_e4m3fn", device="cpu")
    assert engine.dtype == torch.float32 and fp8.storage_name(engine.parts.unet) == "fp8_e4m3fn"
    assert "UNet fp8_e4m3fn (computes in fp32)" in engine.plan
    for module in (engine.parts.text_encoder, engine.parts.vae):
        assert not fp8.fp8_layers(module) and {p.dtype for p in module.parameters()} == {torch.float32}


# ------------------------------------------------------------------------------------------------------ fast path
def test_the_fast_capability_is_one_decision(monkeypatch):
    """CUDA compute capability >= 8.9 (not ROCm, torch with ``_scaled_mm``); nothing else runs fp8 matmuls."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    for cap, want in (((8, 9), True), ((9, 0), True), ((12, 0), True), ((8, 6), False), ((7, 5), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None, cap=cap: cap)
        assert fp8.fp8_matmul_supported(torch.device("cuda", 0)) is want, cap
    assert not fp8.fp8_matmul_supported("cpu")
    monkeypatch.setattr(torch.version, "hip", "6.0", raising=False)
    assert not fp8.fp8_matmul_supported(torch.device("cuda", 0))
    assert fp8.fast_shape_ok(64, 3840) and not fp8.fast_shape_ok(33, 64) and not fp8.fast_shape_ok(64, 40)


def test_fast_refused_logs_one_line_and_computes_as_fp8_e4m3fn(caplog):
    with caplog.at_level(logging.WARNING, logger=fp8_matmul.__name__):
        engine = _fp8_engine("sd1", "full", weight_dtype="fp8_e4m3fn_fast")
    lines = [r for r in caplog.records if "fp8_e4m3fn_fast" in r.getMessage()]
    assert len(lines) == 1 and "computing as fp8_e4m3fn" in lines[0].getMessage()
    assert fp8.storage_name(engine.parts.unet) == "fp8_e4m3fn"
    assert torch.equal(_engine_call(engine), _engine_call(_fp8_engine("sd1", "full")))


def test_fast_layers_are_marked_per_shape_and_fall_back_off_cuda(monkeypatch):
    """Where the decision says yes, Linear layers with K, N multiples of 16 run the fast path and the rest (convs,
    odd shapes) dequantize; a call that cannot take it (CPU input) dequantizes too, with the same result."""
    monkeypatch.setattr(fp8_matmul, "fp8_matmul_supported", lambda device: True)
    engine = _fp8_engine("sd1", "full", weight_dtype="fp8_e4m3fn_fast")
    unet = engine.parts.unet
    for _, m in fp8.fp8_layers(unet):
        want = isinstance(m, torch.nn.Linear) and m.in_features % 16 == 0 and m.out_features % 16 == 0
        assert m.fp8_fast == want
    assert fp8.storage_name(unet) == "fp8_e4m3fn_fast"
    assert "UNet fp8_e4m3fn_fast (computes in fp32)" in engine.plan
    assert torch.equal(_engine_call(engine), _engine_call(_fp8_engine("sd1", "full")))
    odd = torch.nn.Linear(33, 48)
    fp8.quantize_module(odd, torch.bfloat16, fast=True)
    assert not odd.fp8_fast


@pytest.mark.skipif(not hasattr(torch, "_scaled_mm"), reason="this torch has no _scaled_mm")
def test_the_fast_matmul_math_on_the_cpu():
    """``fp8_linear_fast`` is ``(X s_x) (Q s)^T + b`` with the activation quantized per tensor: against that formula
    in fp32 within bf16 output rounding, and within 5% (relative L2) of the dequantizing path. Runs where this
    torch's CPU ``_scaled_mm`` exists (the CUDA run is ``test_fp8_gpu.py``)."""
    g = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(64, 48).to(torch.bfloat16)
    fp8.quantize_module(layer, torch.bfloat16)
    x = torch.randn(3, 7, 64, generator=g).to(torch.bfloat16)
    try:
        got = fp8.fp8_linear_fast(x, layer.weight_fp8.view(torch.float8_e4m3fn), layer.scale_tensor(), layer.bias)
    except (RuntimeError, NotImplementedError) as exc:  # pragma: no cover - a CPU build without the kernel
        pytest.skip(f"CPU _scaled_mm unavailable: {exc}")
    xq, s_x = fp8_matmul.quantize_activation(x.reshape(-1, 64))
    assert s_x.dtype == torch.float32 and s_x.item() >= x.float().abs().max().item() / 448
    assert bool(xq.float().isfinite().all()) and xq.float().abs().max().item() <= 448
    formula = (xq.float() * s_x) @ fp8.dequantize(layer.weight_fp8, layer.fp8_scale).t() + layer.bias.float()
    formula = formula.view(3, 7, 48)
    assert got.shape == (3, 7, 48) and got.dtype == torch.bfloat16
    assert _rel(got.float(), formula) < 1e-2
    with torch.no_grad():
        assert _rel(got.float(), layer(x).float()) < 0.05
    zeros, s0 = fp8_matmul.quantize_activation(torch.zeros(4, 16, dtype=torch.bfloat16))
    assert s0.item() > 0 and not zeros.float().any()  # never 0 / 0

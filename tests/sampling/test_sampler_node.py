"""The node and the loop's promises beyond numerical parity: clear errors, interruption, progress, no mutation.

Guards: width/height not a multiple of 8, a LATENT whose channels do not match, steps * denoise < 1 and other bad
inputs fail before any model runs with a message naming the input; an interrupt stops between steps, detaches
adapters and leaves the engine (and its cached graphs) usable; the progress bar advances once per step; the
input LATENT is never modified; the node is plain plumbing over ``sampling.loop.sample``.
"""
import pytest
import torch

from leandiffusion import bridge
from leandiffusion.nodes.sampler import LeanFusedDDIMSampler
from leandiffusion.sampling.loop import sample
from leandiffusion.sampling.settings import SamplerSettings
from leandiffusion.tests.kit import tiny_engine


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("sd1")


def _settings(**kw):
    base = dict(positive="a lighthouse", negative="", seed=5, steps=3, cfg=6.0, width=64, height=64,
                acceleration="none")
    base.update(kw)
    return SamplerSettings(**base)


def _node_args(engine, **kw):
    args = dict(lean_model=engine, positive="a lighthouse", negative="", seed=5, steps=3, cfg=6.0, eta=0.0, width=64,
                height=64, batch_size=1, timestep_spacing="leading", cfg_mode="batched", acceleration="cuda_graph")
    args.update(kw)
    return args


def test_node_is_plumbing_over_sample(engine):
    (latent,) = LeanFusedDDIMSampler().run(**_node_args(engine))
    want = sample(engine, _settings(), quiet=True)["samples"]
    assert torch.equal(latent["samples"], want)  # cuda_graph on the CPU falls back to the same eager loop


def test_node_img2img_optional_inputs(engine):
    raw = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    keep = raw.clone()
    (latent,) = LeanFusedDDIMSampler().run(**_node_args(engine), latent_image={"samples": raw}, denoise=0.7)
    assert torch.equal(raw, keep), "the input LATENT must not be modified"
    assert latent["samples"].shape == raw.shape
    want = sample(engine, _settings(denoise=0.7), latent_image={"samples": keep}, quiet=True)["samples"]
    assert torch.equal(latent["samples"], want)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(width=100), ValueError, "width=100 is not a multiple of 8"),
    (dict(height=68), ValueError, "height=68 is not a multiple of 8"),
    (dict(steps=4, denoise=0.2), ValueError, "steps \\* denoise"),
    (dict(steps=0), ValueError, "steps=0"),
    (dict(cfg=31.0), ValueError, "cfg=31"),
    (dict(eta=1.5), ValueError, "eta=1.5"),
    (dict(timestep_spacing="karras"), ValueError, "timestep_spacing"),
    (dict(cfg_mode="parallel"), ValueError, "cfg_mode"),
    (dict(acceleration="tensorrt"), ValueError, "acceleration"),
    (dict(batch_size=65), ValueError, "batch_size=65"),
    # the type checks
    (dict(positive=None), TypeError, r"positive: expected a prompt string, got NoneType"),
    (dict(negative=["fog"]), TypeError, r"negative: expected a prompt string, got list"),
    (dict(cfg="7.5"), TypeError, r"cfg='7.5': expected a finite number"),
    (dict(eta=float("nan")), TypeError, r"eta=nan: expected a finite number"),
    (dict(denoise=True), TypeError, r"denoise=True: expected a finite number"),
])
def test_bad_settings_raise_before_running(engine, kw, exc, match, monkeypatch):
    calls = []
    monkeypatch.setattr(type(engine), "unet", lambda *a, **k: calls.append(1))
    with pytest.raises(exc, match=match):
        LeanFusedDDIMSampler().run(**_node_args(engine, **kw))
    assert calls == []


def test_unknown_prompt_syntax_is_refused():
    from leandiffusion.sampling.settings import SamplerSettings

    with pytest.raises(ValueError, match=r"prompt_syntax='a1111': expected one of \('comfyui', 'extended'\)"):
        SamplerSettings(positive="a boat", prompt_syntax="a1111").validated()


def test_bad_latents_raise(engine):
    node = LeanFusedDDIMSampler()
    with pytest.raises(ValueError, match="latent_image has 16 channels but this model's VAE uses 4"):
        node.run(**_node_args(engine), latent_image={"samples": torch.zeros(1, 16, 8, 8)})
    with pytest.raises(TypeError, match="latent_image"):
        node.run(**_node_args(engine), latent_image=torch.zeros(1, 4, 8, 8))
    with pytest.raises(ValueError, match="noise_mask"):
        node.run(**_node_args(engine), latent_image={"samples": torch.zeros(1, 4, 8, 8),
                                                   "noise_mask": torch.ones(1, 1, 64, 64)})
    with pytest.raises(ValueError, match="batch_size=3 is not a multiple"):
        node.run(**_node_args(engine, batch_size=3), latent_image={"samples": torch.zeros(2, 4, 8, 8)})
    with pytest.raises(TypeError, match="lean_model"):
        node.run(**_node_args(object()))


class _Adapter:
    """Counts attach/detach (an unmerged LoRA stand-in)."""

    graph_key = ("test-adapter",)

    def __init__(self):
        self.attached = 0

    def attach(self, parts):
        self.attached += 1

    def detach(self, parts):
        self.attached -= 1


@pytest.mark.parametrize("acceleration", ["none", "cuda_graph"])
def test_interrupt_stops_between_steps_and_engine_stays_usable(engine, acceleration):
    adapter = _Adapter()
    view = engine.with_adapter(adapter)
    checks = []

    def hook():
        checks.append(1)
        if len(checks) == 3:  # 1 before text encoding, then before steps 1, 2 -> stops before step 2
            raise bridge.Interrupted("user pressed cancel")

    unet_calls = []
    original = type(engine).unet

    def counting_unet(self, *a, **k):
        unet_calls.append(1)
        return original(self, *a, **k)

    bridge.set_interrupt_hook(hook)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(type(engine), "unet", counting_unet)
            with pytest.raises(bridge.Interrupted):
                sample(view, _settings(steps=4, acceleration=acceleration), quiet=True)
    finally:
        bridge.set_interrupt_hook(None)
    assert len(unet_calls) == 1, "stopped within one step"
    assert adapter.attached == 0, "session closed: adapters detached"
    again = sample(view, _settings(steps=4, acceleration=acceleration), quiet=True)["samples"]
    fresh = sample(engine, _settings(steps=4, acceleration="none"), quiet=True)["samples"]
    assert torch.equal(again, fresh)


def test_progress_bar_advances_once_per_step(engine, monkeypatch):
    updates = []

    class Bar:
        def __init__(self, total, desc="", quiet=False):
            updates.append(("total", total))

        def update(self, n=1):
            updates.append(("update", n))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(bridge, "ProgressBar", Bar)
    sample(engine, _settings(steps=10, denoise=0.5), quiet=True)
    assert updates == [("total", 5)] + [("update", 1)] * 5


def test_denoise_without_latent_starts_from_an_empty_latent(engine):
    """ComfyUI's EmptyLatentImage is zeros: denoise < 1 with no latent_image equals img2img from zeros."""
    s = _settings(steps=4, denoise=0.5, seed=9)
    empty = sample(engine, s, quiet=True)["samples"]
    zeros = sample(engine, s, latent_image={"samples": torch.zeros(1, 4, 8, 8)}, quiet=True)["samples"]
    assert torch.equal(empty, zeros)


def test_precomputed_conditioning_path(engine):
    """Callers with their own text encoding (stream sampler, CONDITIONING inputs) get the same latent."""
    from leandiffusion.sampling.cfg import encode_conditioning

    s = _settings(steps=2, batch_size=2)
    cond = encode_conditioning(engine, s.positive, s.negative, 2, True, 64, 64)
    assert torch.equal(sample(engine, s, conditioning=cond, quiet=True)["samples"],
                       sample(engine, s, quiet=True)["samples"])
    with pytest.raises(ValueError, match="needs batch 1"):
        sample(engine, _settings(steps=2), conditioning=cond, quiet=True)


def _documented_inputs(doc: str) -> dict:
    """``name -> (type column, default column)`` from a node page's input table (``| `a`, `b` (optional) | ...``)."""
    import re
    from pathlib import Path

    rows = {}
    for line in (Path(__file__).resolve().parents[2] / "docs" / doc).read_text().splitlines():
        m = re.match(r"\| (`[^|]+) \| ([^|]+) \|([^|]*)\|", line)
        if m:
            for name in re.findall(r"`(\w+)`", m.group(1)):
                rows[name] = (m.group(2).strip(), m.group(3).strip())
    return rows


def test_inputs_are_the_documented_ones():
    """docs/sampler.md's input table is the contract: every input, its kind, range, step, choices and default
    (the steps / eta / batch_size ranges, the width step and the denoise, cfg_mode and spacing defaults must not
    change unnoticed)."""
    import re

    spec = LeanFusedDDIMSampler.INPUT_TYPES()
    inputs = {**spec["required"], **spec["optional"]}
    documented = _documented_inputs("sampler.md")
    assert set(documented) == set(inputs)
    for name, (kind, default) in documented.items():
        decl = inputs[name]
        opts = decl[1] if len(decl) > 1 else {}
        number = re.match(r"(INT|FLOAT)(?: (-?[\d.]+)-([\d.]+))?(?:, step ([\d.]+))?$", kind)
        if number:
            assert decl[0] == number.group(1), name
            if number.group(2):
                assert (opts["min"], opts["max"]) == (float(number.group(2)), float(number.group(3))), name
            if number.group(4):
                assert opts["step"] == float(number.group(4)), name
            assert opts["default"] == float(default), name
        elif " / " in kind:
            assert decl[0] == re.findall(r"`([^`]+)`", kind) and opts["default"] == default, name
        else:
            assert decl[0] == kind, name
    assert LeanFusedDDIMSampler.RETURN_TYPES == ("LATENT",)
    assert LeanFusedDDIMSampler.CATEGORY == "LeanDiffusion/sampling"


def test_every_widget_reaches_sample_as_itself(engine, monkeypatch):
    """The node hands each widget to ``SamplerSettings`` and the optional inputs to ``sample`` unchanged (eta or denoise
    replaced by their defaults, or the two CONDITIONING inputs swapped, would pass tests that run at eta 0, or at the
    same denoise through both paths)."""
    import leandiffusion.nodes.sampler as node_module

    seen = {}
    monkeypatch.setattr(node_module, "sample", lambda model, settings, **kw: seen.update(kw, settings=settings))
    latent, pos, neg = {"samples": torch.zeros(1, 4, 8, 8)}, [["pos"]], [["neg"]]
    args = _node_args(engine, seed=11, steps=7, cfg=3.5, eta=0.25, width=72, height=80, batch_size=2,
                      timestep_spacing="trailing", cfg_mode="sequential", acceleration="none")
    LeanFusedDDIMSampler().run(**args, latent_image=latent, denoise=0.6, positive_cond=pos, negative_cond=neg)
    s = seen["settings"]
    assert (s.seed, s.steps, s.cfg, s.eta, s.width, s.height, s.batch_size) == (11, 7, 3.5, 0.25, 72, 80, 2)
    assert (s.timestep_spacing, s.cfg_mode, s.acceleration, s.denoise) == ("trailing", "sequential", "none", 0.6)
    assert (s.positive, s.negative) == ("a lighthouse", "")
    assert seen["latent_image"] is latent and seen["positive_cond"] is pos and seen["negative_cond"] is neg

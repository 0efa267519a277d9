"""bench/suite_finite.py: the row that measures the non-finite checks against an SDXL step builds and validates,
and it times the checks the Fused DDIM Sampler itself runs, no more and no fewer.

No GPU here: the suite's smoke mode runs the same code on the tiny SDXL model on the CPU. On the device the same
case runs at 1024x1024 on the full-size random SDXL UNet (``python -m leandiffusion.bench --quick``).
"""
import pytest
import torch

from leandiffusion.bench import schema, suite_finite
from leandiffusion.bench.harness import BenchContext
from leandiffusion.bench.models import tiny_engine
from leandiffusion.memory import finite
from leandiffusion.nodes.sampler import LeanFusedDDIMSampler


@pytest.fixture(scope="module")
def sdxl():
    return tiny_engine("sdxl")


def test_the_smoke_case_builds_its_rows_and_they_validate(tmp_path):
    ctx = BenchContext("finite", tmp_path, smoke=True)
    suite_finite.run(ctx)
    rows = {r["metric"]: r for r in ctx.to_json()}
    assert set(rows) == {"checks_ms", "checks_cpu_inputs_ms", "refused_nan_inputs"}
    for row in rows.values():
        assert schema.validate_record(schema.normalise_record(row)) == [], row
        assert row["case"] == "tiny-sdxl-64-b2"
    checks = rows["checks_ms"]
    assert checks["peer_name"].startswith("SDXL UNet step") and checks["peer"] > 0 and checks["ours"] > 0
    assert checks["target"].startswith(">= 100x") and isinstance(checks["passed"], bool)
    assert checks["ratio"] == pytest.approx(checks["peer"] / checks["ours"])
    assert "<= 1% of one step" in checks["notes"]
    assert rows["refused_nan_inputs"]["ours"] == 3 and rows["refused_nan_inputs"]["passed"] is True


def _checked_shapes(monkeypatch) -> list:
    """Patches the one gate every input check passes (``memory.finite``'s call of ``any_non_finite``); returns the
    list it fills with the shapes of each call's tensors."""
    calls = []
    real = finite.any_non_finite

    def spy(tensors):
        calls.append([tuple(t.shape) for t in tensors])
        return real(tensors)

    monkeypatch.setattr(finite, "any_non_finite", spy)
    return calls


def test_the_timed_checks_are_the_ones_the_sampler_node_runs(sdxl, monkeypatch):
    """The benchmark's ``sampler_checks`` and a real Fused DDIM Sampler run over the same inputs make the same checks:
    a benchmark that timed fewer checks than the node runs would understate their cost."""
    calls = _checked_shapes(monkeypatch)
    inputs = suite_finite.sampler_inputs(sdxl, 64, torch.device("cpu"))
    suite_finite.sampler_checks(sdxl, inputs)()
    timed, calls[:] = list(calls), []
    LeanFusedDDIMSampler().run(lean_model=sdxl, positive="", negative="", seed=1, steps=1, cfg=5.0, eta=0.0,
                               width=64, height=64, batch_size=1, timestep_spacing="leading", cfg_mode="batched",
                               acceleration="none", denoise=1.0, **inputs)
    latent = tuple(inputs["latent_image"]["samples"].shape)
    cond, extras = inputs["positive_cond"][0]
    pair = [tuple(cond.shape), tuple(extras["pooled_output"].shape)]
    assert timed == [[latent], pair, pair]
    assert calls == timed

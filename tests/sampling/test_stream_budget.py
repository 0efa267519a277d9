"""Stream Scheduler Sampler under the loader's ``stream`` policy: a hard VRAM budget.

Under a budgeted plan the stages run in order on one stream and the decode is the exact tiled one sized by
``decode_budget`` (budget minus the UNet's resident weights, the VAE weights and the captured batch's activation
pool). On the CPU the plan is built the same way, so this checks the wiring and that the pictures do not change:
the latents equal the ``full``-policy run bit for bit and the images the untiled decode within 1e-4.
"""
import pytest
import torch

from leandiffusion.memory.load import build_engine
from leandiffusion.sampling.stream.batching import budgeted_plan
from leandiffusion.sampling.stream.scheduler import decode_budget, run_stream
from leandiffusion.sampling.stream.settings import StreamSettings
from leandiffusion.sampling.stream.streams import StageStreams
from leandiffusion.tests.kit import tiny_engine, tiny_parts

MiB = 2 ** 20


def _settings(**kw):
    base = dict(negative="blurry", seed=3, steps=2, cfg=2.0, width=64, height=64, acceleration="none", max_batch=2)
    base.update(kw)
    return StreamSettings.from_text("a red boat\nsnowy forest\na cat", **base)


@pytest.fixture(scope="module")
def budgeted():
    return build_engine(tiny_parts("sd1"), "stream", 1.0, device="cpu", weight_dtype="fp32", vae_dtype="fp32")


def test_only_the_stream_policy_is_budgeted(budgeted):
    assert budgeted_plan(budgeted) is not None
    assert budgeted_plan(tiny_engine("sd1")) is None
    assert budgeted_plan(build_engine(tiny_parts("sd1"), "balanced", 1.0, device="cpu")) is None


def test_decode_budget_leaves_room_for_the_graph_pool(budgeted):
    plan = budgeted_plan(budgeted)
    s = _settings().validated()
    eager = decode_budget(budgeted, s, 2, (8, 8))
    graphs = decode_budget(budgeted, _settings(acceleration="cuda_graph").validated(), 2, (8, 8))
    assert 64 * MiB <= eager <= plan.budget_bytes - plan.vae_bytes
    assert graphs <= eager
    assert decode_budget(budgeted, s, 2, (8, 8)) == decode_budget(budgeted, s, 7, (8, 8))  # eager: no pool


def test_one_stream_when_not_overlapping():
    streams = StageStreams(torch.device("cpu"), overlap=False)
    assert not streams.overlap and streams.stream("vae") is None


def test_budgeted_run_gives_the_full_policy_pictures(budgeted):
    s = _settings()
    ours = run_stream(budgeted, s, quiet=True)
    ref = run_stream(tiny_engine("sd1"), s, quiet=True)
    assert torch.equal(ours.latents, ref.latents)
    assert (ours.images - ref.images).abs().max().item() <= 1e-4

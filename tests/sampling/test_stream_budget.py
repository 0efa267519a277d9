"""Stream Scheduler Sampler under the loader's ``stream`` policy: a hard VRAM budget.

Under a budgeted plan the stages run in order on one stream and the decode is the exact tiled one sized by
``decode_budget`` (budget minus the UNet's resident weights, the VAE weights and the captured batch's activation
pool and the loader's headroom), run with ``ExactConfig.strict_budget`` (copies on the compute stream, cached
blocks released between the tiler's stages). On the CPU the plan is built the same way, so this checks the wiring and that the pictures do not change:
the latents equal the ``full``-policy run bit for bit and the images the untiled decode within 1e-4.
"""
import pytest
import torch

from leandiffusion.memory.load import build_engine
from leandiffusion.memory.vram_budget import HEADROOM, StageMode, VramBudget
from leandiffusion.vae.tiled import MIN_TILE
from leandiffusion.sampling.stream.scheduler import DECODE_RESERVED_FACTOR, decode_budget, run_stream
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
    assert budgeted.placement.budget.hard
    assert not tiny_engine("sd1").placement.budget.hard
    assert not build_engine(tiny_parts("sd1"), "balanced", 1.0, device="cpu").placement.budget.hard


def test_decode_budget_is_what_the_resident_weights_leave(budgeted):
    """The typed budget carries the plan's arithmetic: budget - the UNet stage's weights - VAE weights - headroom."""
    plan = budgeted.placement.plan
    resident = plan.peaks["unet"] - plan.unet_activation_bytes
    assert budgeted.placement.budget.resident_bytes == resident
    left = plan.budget_bytes - resident - plan.vae_bytes - int(HEADROOM * plan.budget_bytes)
    assert decode_budget(budgeted) == max(int(left / DECODE_RESERVED_FACTOR), 64 * MiB)


def test_budgeted_run_denoises_all_then_drops_graphs_then_decodes(budgeted, monkeypatch):
    """Under a budget the decodes wait until every batch is denoised and the run's graphs are dropped; without a
    budget a batch's decode is launched before the next batch is denoised."""
    from leandiffusion.sampling.graph_runner import GraphRunner
    from leandiffusion.sampling.stream import decode, scheduler

    events = []
    real_denoise, real_tiled = scheduler.denoise_batch, decode.DecodeStage._tiled_image
    monkeypatch.setattr(scheduler, "denoise_batch", lambda *a, **k: (events.append("denoise"), real_denoise(*a, **k))[1])
    monkeypatch.setattr(decode.DecodeStage, "_tiled_image",
                        lambda self, raw: (events.append("decode"), real_tiled(self, raw))[1])

    class Runner(GraphRunner):
        def clear(self, engine=None):
            events.append("clear")
            super().clear(engine)

    s = _settings(max_batch=1, decode_tile_size=MIN_TILE)
    out = run_stream(budgeted, s, runner=Runner(), quiet=True)
    assert events == ["denoise"] * 3 + ["clear"] + ["decode"] * 3
    events.clear()
    ref = run_stream(tiny_engine("sd1"), s, runner=Runner(), quiet=True)
    assert events.index("decode") < len(events) - 1 - events[::-1].index("denoise") and "clear" not in events
    assert torch.equal(out.latents, ref.latents)
    assert (out.images - ref.images).abs().max().item() <= 1e-4


def test_one_stream_when_not_overlapping():
    streams = StageStreams(torch.device("cpu"), overlap=False)
    assert not streams.overlap and streams.stream("vae") is None


def test_budgeted_run_gives_the_full_policy_pictures(budgeted):
    s = _settings()
    ours = run_stream(budgeted, s, quiet=True)
    ref = run_stream(tiny_engine("sd1"), s, quiet=True)
    assert torch.equal(ours.latents, ref.latents)
    assert (ours.images - ref.images).abs().max().item() <= 1e-4


def test_only_a_budgeted_run_decodes_under_a_strict_budget(budgeted, monkeypatch):
    """The hard-budget tiler mode (one stream, cached blocks released between stages) is the budgeted run's; a run
    without a budget keeps the overlapping copy streams. Both give the same pictures."""
    from leandiffusion.sampling.stream import decode

    seen = []
    real = decode.run_exact

    def spy(program, z, cfg, *a, **kw):
        seen.append(cfg.strict_budget)
        return real(program, z, cfg, *a, **kw)

    monkeypatch.setattr(decode, "run_exact", spy)
    s = _settings(decode_tile_size=MIN_TILE)
    strict = run_stream(budgeted, s, quiet=True)
    assert seen and all(seen)
    seen.clear()
    loose = run_stream(tiny_engine("sd1"), s, quiet=True)
    assert seen and not any(seen)
    assert (strict.images - loose.images).abs().max().item() <= 1e-4


@pytest.mark.gpu
def test_one_copy_stream_under_a_strict_budget():
    from leandiffusion.vae.stores import Streams

    dev = torch.device("cuda")
    one = Streams(dev, side=False)
    assert one.upload == torch.cuda.current_stream(dev) == one.download
    two = Streams(dev)
    assert two.upload != torch.cuda.current_stream(dev) and two.download != two.upload


def test_budgeted_batch_counts_headroom_and_workspace(monkeypatch):
    """Under a budget the activations of a batch get what the budget leaves after the resident weights, the
    loader's headroom and the kernel workspace: a plan the loader sized for one guided image gives a batch of one
    (without them the batch's activations would go over the budget)."""
    from types import SimpleNamespace

    from leandiffusion.memory.plan import WORKSPACE_CUDA
    from leandiffusion.sampling.stream import batching

    GiB = 2 ** 30
    budget, per_image = 4 * GiB, 350 * MiB
    act = per_image + WORKSPACE_CUDA  # the plan's activation estimate for one guided image
    resident = budget - int(HEADROOM * budget) - act  # the loader fills the rest with resident blocks
    hard = VramBudget(limit_bytes=budget, headroom_bytes=int(HEADROOM * budget), resident_bytes=resident,
                      activation_bytes=act, vae_bytes=300 * MiB, vae=StageMode.WHILE_USED, unet=StageMode.STREAM)
    engine = SimpleNamespace(device=torch.device("cuda", 0), placement=SimpleNamespace(budget=hard))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev: (70 * GiB, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev: 0)
    assert hard.activation_room_bytes == budget - resident - int(HEADROOM * budget)
    assert batching.available_bytes(engine) == per_image
    assert batching.auto_batch(8, per_image, batching.available_bytes(engine), 0, 8) == 1


"""The engine's buffer pool over a ComfyUI session: many queue runs with changed sizes, batches and prompt lengths.

Guards unbounded growth: the sampler takes its step buffers (latent state, UNet input, context, ...) from the
engine's ``BufferPool`` keyed by (role, shape, dtype); every new width/height/batch/prompt length used to add
buffers that stayed on the device for the life of the model (a cached CUDA graph keeps its own buffers; the pool
kept every shape ever used, also under a hard VRAM budget, which only drops graphs). Now each role keeps its
``max_per_role`` most recently used shapes, and the result of a run does not depend on which shapes ran before.
"""
import torch

from leandiffusion.memory.load import build_engine
from leandiffusion.memory.pool import DEFAULT_MAX_PER_ROLE
from leandiffusion.sampling.loop import sample
from leandiffusion.sampling.settings import SamplerSettings
from leandiffusion.tests.kit import tiny_parts


def _settings(width, words, seed):
    return SamplerSettings(positive=" ".join(["a boat"] * words), negative="rain", seed=seed, steps=2, cfg=5.0,
                           width=width, height=64, acceleration="none")


def test_pool_stays_bounded_over_many_sizes_and_results_do_not_depend_on_history():
    engine = build_engine(tiny_parts("sd1"), "full", device="cpu")
    first = sample(engine, _settings(64, 1, 5), quiet=True)["samples"]
    for i, width in enumerate(range(72, 72 + 8 * 12, 8)):
        sample(engine, _settings(width, 1 + 40 * (i % 3), i), quiet=True)
    keys = list(engine.pool.data_ptrs())
    roles = {k[0] for k in keys}
    per_role = {r: sum(1 for k in keys if k[0] == r) for r in roles}
    assert max(per_role.values()) <= DEFAULT_MAX_PER_ROLE, per_role
    again = sample(engine, _settings(64, 1, 5), quiet=True)["samples"]
    assert torch.equal(again, first)
    allocated = engine.pool.stats().allocations
    sample(engine, _settings(64, 1, 6), quiet=True)
    assert engine.pool.stats().allocations == allocated  # a repeated shape still reuses its buffers

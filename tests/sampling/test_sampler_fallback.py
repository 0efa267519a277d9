"""The Fused DDIM Sampler degrades instead of failing when memory runs out (``sampling.fallback``).

Guards: an out-of-memory error in a step used to propagate at once (only a failed graph capture fell back);
now batched CFG retries as sequential CFG, then as ever smaller chunks of rows, each with the same latents as a
run that never ran out (eta noise included: every attempt sees the same per-row draws), a CPU allocation failure
counts as out of memory, other errors are never retried, and when one row does not fit the error says what was
tried. The UNet below refuses any call with more rows than a limit, as a GPU with too little memory would.
"""
import pytest
import torch

from leandiffusion import bridge
from leandiffusion.memory.out_of_memory import is_out_of_memory
from leandiffusion.sampling.fallback import Attempt, attempts
from leandiffusion.sampling.loop import sample
from leandiffusion.sampling.settings import SamplerSettings
from leandiffusion.tests.kit import tiny_engine

TOL = 1e-5
CPU_OOM = "[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: can't allocate memory: you tried to " \
          "allocate 120000000000 bytes. Error code 12 (Cannot allocate memory)"


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("sd1")


def _settings(**kw):
    base = dict(positive="a lighthouse", negative="fog", seed=11, steps=3, cfg=6.0, width=64, height=64,
                batch_size=4, acceleration="none")
    base.update(kw)
    return SamplerSettings(**base)


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


class RowLimit:
    """Stands in for the UNet's forward: more than ``rows`` latent rows in one call raise ``error``."""

    def __init__(self, unet, rows, error=lambda: torch.OutOfMemoryError("injected: CUDA out of memory")):
        self.real, self.rows, self.error, self.calls = unet.forward, rows, error, []

    def __call__(self, sample, *args, **kwargs):
        self.calls.append(sample.shape[0])
        if sample.shape[0] > self.rows:
            raise self.error()
        return self.real(sample, *args, **kwargs)


@pytest.fixture
def limit(engine, monkeypatch):
    def install(rows, **kw):
        fake = RowLimit(engine.parts.unet, rows, **kw)
        monkeypatch.setattr(engine.parts.unet, "forward", fake)
        return fake
    return install


def test_attempt_plan():
    assert attempts(4, True, "batched") == [Attempt("batched", 4), Attempt("sequential", 4),
                                            Attempt("sequential", 2), Attempt("sequential", 1)]
    assert attempts(5, False, "batched") == [Attempt("batched", 5), Attempt("batched", 3), Attempt("batched", 2),
                                             Attempt("batched", 1)]
    assert attempts(1, True, "sequential") == [Attempt("sequential", 1)]
    assert Attempt("sequential", 3).chunks(5) == [(0, 3), (3, 5)]


@pytest.mark.parametrize("rows, expect_calls", [
    (4, [8, 4, 4]),  # batched (8 rows) fails; sequential CFG: uncond then cond, 4 rows each
    (2, [8, 4, 2, 2]),  # sequential 4 fails; chunks of 2 rows
    (1, [8, 4, 2, 1, 1]),  # down to one row
])
@pytest.mark.parametrize("eta", [0.0, 0.7])
def test_out_of_memory_degrades_to_the_same_latents(engine, limit, rows, expect_calls, eta):
    batched = sample(engine, _settings(eta=eta), quiet=True)["samples"]
    sequential = sample(engine, _settings(eta=eta, cfg_mode="sequential"), quiet=True)["samples"]
    fake = limit(rows)
    got = sample(engine, _settings(eta=eta), quiet=True)["samples"]
    assert fake.calls[:len(expect_calls)] == expect_calls
    assert max(fake.calls[len(expect_calls) - 1:]) <= rows
    assert got.shape == batched.shape
    if rows == 4:  # the sequential attempt is exactly a sequential run (same draws after the failed attempt)
        assert torch.equal(got, sequential)
    # chunks differ from the whole batch by rounding only; batched and sequential CFG likewise
    assert _rel(got, sequential) <= TOL and _rel(got, batched) <= 10 * TOL


def test_a_cpu_allocation_failure_counts_as_out_of_memory(engine, limit):
    want = sample(engine, _settings(batch_size=2), quiet=True)["samples"]
    limit(2, error=lambda: RuntimeError(CPU_OOM))
    got = sample(engine, _settings(batch_size=2), quiet=True)["samples"]
    assert _rel(got, want) <= 10 * TOL
    assert is_out_of_memory(RuntimeError(CPU_OOM)) and is_out_of_memory(MemoryError())
    assert not is_out_of_memory(RuntimeError("shape mismatch")) and not is_out_of_memory(ValueError("x"))


def test_other_errors_are_not_retried(engine, limit):
    fake = limit(0, error=lambda: RuntimeError("a real bug"))
    with pytest.raises(RuntimeError, match="a real bug"):
        sample(engine, _settings(), quiet=True)
    assert fake.calls == [8]


def test_one_row_that_does_not_fit_reports_what_was_tried(engine, limit):
    limit(0)
    with pytest.raises(torch.OutOfMemoryError) as info:
        sample(engine, _settings(batch_size=2), quiet=True)
    message = str(info.value)
    for tried in ("batched CFG, batch 2", "sequential CFG, batch 2", "sequential CFG, chunks of 1 of 2 rows"):
        assert tried in message
    assert "vram_policy" in message and "batch_size" in message


def test_engine_stays_usable_after_a_failed_run(engine, limit, monkeypatch):
    limit(0)
    with pytest.raises(torch.OutOfMemoryError):
        sample(engine, _settings(batch_size=1), quiet=True)
    monkeypatch.undo()
    out = sample(engine, _settings(batch_size=1), quiet=True)["samples"]
    assert torch.isfinite(out).all()


def test_progress_is_replanned_and_never_passes_its_total(engine, limit, monkeypatch):
    seen = []

    class Bar:
        def __init__(self, total, desc="", quiet=False):
            self.total, self.value = total, 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            seen.append((self.value, self.total))

        def update(self, n=1):
            self.value += n
            assert self.value <= self.total

        def set(self, value, total):
            self.value, self.total = value, total

    monkeypatch.setattr(bridge, "ProgressBar", Bar)
    limit(2)
    sample(engine, _settings(), quiet=True)
    assert seen == [(6, 6)]  # 3 steps x 2 chunks, at its end

"""Guards the harness contract every suite builds on: ratio and pass/fail arithmetic, the time budget, the sink
that keeps records across a crash, and strict JSON for non-finite numbers."""
import json
import math
import time

import pytest
import torch

from leandiffusion.bench.harness import BenchContext, peak_memory, time_ms, write_json
from leandiffusion.bench.schema import validate_record


def make_ctx(tmp_path, **kw):
    return BenchContext("unit", tmp_path, smoke=True, **kw)


def test_old_constructor_still_works(tmp_path):
    ctx = BenchContext("unit", tmp_path, True, False, None)
    assert ctx.time_budget_s is None and ctx.deadline() == math.inf and ctx.has_time(1e9)
    assert ctx.mode == "smoke" and ctx.device.type == "cpu"


@pytest.mark.parametrize("ours, peer, lower, kind, target, ratio, passed", [
    (10.0, 25.0, True, "ratio>=", 2.0, 2.5, True),     # twice as fast needed, 2.5x measured
    (10.0, 15.0, True, "ratio>=", 2.0, 1.5, False),
    (30.0, 10.0, False, "ratio>=", 2.0, 3.0, True),    # throughput: ours/peer
    (3.9, None, True, "ours<=", 4.0, None, True),
    (4.1, None, True, "ours<=", 4.0, None, False),
    (1.0, None, False, "ours>=", 2.0, None, False),
    (10.0, None, True, "ratio>=", 2.0, None, False),   # a ratio target without a peer cannot pass
    (5.0, 10.0, True, "", None, 2.0, None),
])
def test_record_ratio_and_pass(tmp_path, ours, peer, lower, kind, target, ratio, passed):
    ctx = make_ctx(tmp_path)
    rec = ctx.record("c", "m_ms", ours, peer, "peer" if peer is not None else "", target=target, target_kind=kind,
                     lower_is_better=lower, unit="ms")
    assert rec.ratio == (None if ratio is None else pytest.approx(ratio))
    assert rec.passed is passed
    assert bool(rec.target) == (passed is not None)


def test_record_accepts_tensors_and_rejects_bad_kind(tmp_path):
    ctx = make_ctx(tmp_path)
    rec = ctx.record("c", "m_ms", torch.tensor(2.0), torch.tensor(4.0), "p", unit="ms")
    assert isinstance(rec.ours, float) and isinstance(rec.ratio, float) and rec.ratio == 2.0
    with pytest.raises(ValueError, match="target_kind"):
        ctx.record("c", "m", 1.0, target=1.0, target_kind="ratio>")


def test_non_finite_never_passes_and_is_stored_as_null(tmp_path):
    ctx = make_ctx(tmp_path, sink=tmp_path / "r.json")
    rec = ctx.record("c", "max_abs_diff", float("nan"), target=1e-3, target_kind="ours<=")
    assert rec.passed is False
    text = (tmp_path / "r.json").read_text()
    assert "NaN" not in text
    stored = json.loads(text)["records"][0]
    assert stored["ours"] is None
    assert validate_record(stored) == []
    write_json([{"x": float("inf")}], tmp_path / "w.json")
    assert json.loads((tmp_path / "w.json").read_text()) == [{"x": None}]


def test_sink_holds_every_record_as_soon_as_made(tmp_path):
    sink = tmp_path / "sub" / "r.json"
    seen = []
    ctx = make_ctx(tmp_path, sink=sink, on_record=seen.append)
    ctx.record("a", "m_ms", 1.0, unit="ms")
    assert [r["case"] for r in json.loads(sink.read_text())["records"]] == ["a"]
    ctx.skip("b", "no time")
    ctx.record("c", "m_ms", 2.0, unit="ms")
    doc = json.loads(sink.read_text())
    assert [r["case"] for r in doc["records"]] == ["a", "c"]
    assert doc["status"] == "running" and doc["skipped"] == [{"case": "b", "reason": "no time"}]
    assert [r.case for r in seen] == ["a", "c"]
    ctx.flush("ok")
    assert json.loads(sink.read_text())["status"] == "ok"


def test_time_budget_and_deadline(tmp_path):
    ctx = make_ctx(tmp_path, time_budget_s=30)
    assert 29 < ctx.time_left() <= 30 and ctx.has_time(20) and not ctx.has_time(40)
    past = make_ctx(tmp_path, time_budget_s=30, deadline=time.time() - 1)  # the CLI's deadline wins
    assert past.time_left() < 0 and not past.has_time(0)
    with pytest.raises(ValueError, match="time_budget_s"):
        make_ctx(tmp_path, time_budget_s=0)


def test_artifact_path_is_confined_to_out_dir(tmp_path):
    ctx = make_ctx(tmp_path / "out")
    assert ctx.artifact_path("trace.json") == tmp_path / "out" / "unit_trace.json"
    for bad in ("../x", "a/b", "", ".hidden"):
        with pytest.raises(ValueError, match="name="):
            ctx.artifact_path(bad)


def test_time_ms_is_a_median_and_peak_memory_is_zero_on_cpu():
    # warm-up calls are not timed; the three timed calls sleep 4, 80 and 6 ms: the median is ~6 ms, while a mean
    # (~30 ms), the maximum (80 ms), the minimum (4 ms) or a timed warm-up (0 ms) would each fall outside the bounds
    sleeps = [0.0, 0.0, 0.004, 0.080, 0.006]
    calls = []

    def fn():
        time.sleep(sleeps[len(calls)])
        calls.append(1)

    assert 5.5 <= time_ms(fn, warmup=2, repeat=3, device=torch.device("cpu")) < 25
    assert len(calls) == 5
    with peak_memory(torch.device("cpu")) as mem:
        torch.ones(10)
    assert mem == {"reserved_gb": 0.0, "allocated_gb": 0.0}


@pytest.mark.parametrize("ours, peer, lower, kind, target", [
    (float("inf"), None, False, "ours>=", 1.0),      # an infinite throughput is not a measurement
    (float("inf"), 2.0, False, "ratio>=", 1.5),      # ours/peer = inf
    (4.0, float("inf"), True, "ratio>=", 1.5),       # peer/ours = inf (a peer that never finished)
    (float("-inf"), None, True, "ours<=", 4.0),
])
def test_infinite_numbers_never_pass(tmp_path, ours, peer, lower, kind, target):
    """``record`` promises that a non-finite ``ours`` never passes: ``inf >= target`` or an infinite ratio would
    otherwise pass, and JSON would then store the number as null next to ``passed: true``."""
    ctx = make_ctx(tmp_path, sink=tmp_path / "r.json")
    rec = ctx.record("c", "m", ours, peer, "peer" if peer is not None else "", target=target, target_kind=kind,
                     lower_is_better=lower)
    assert rec.passed is False
    stored = json.loads((tmp_path / "r.json").read_text())["records"][0]
    assert validate_record(stored) == []


# --------------------------------------------------------------------------------------------- targets on the bound
@pytest.mark.parametrize("ours, peer, lower, kind, target", [
    (10.0, 20.0, True, "ratio>=", 2.0),     # ratio exactly 2.0 (both exact in binary)
    (4.0, None, True, "ours<=", 4.0),
    (2.0, None, False, "ours>=", 2.0),
])
def test_a_target_met_exactly_passes(tmp_path, ours, peer, lower, kind, target):
    """Targets read ">= 2x" and "<= 4 GB": a measurement on the bound meets them."""
    rec = make_ctx(tmp_path).record("c", "m", ours, peer, "p" if peer is not None else "", target=target,
                                    target_kind=kind, lower_is_better=lower)
    assert rec.passed is True


@pytest.mark.parametrize("ours, peer", [(0.0, 5.0), (5.0, 0.0)])
def test_a_zero_measurement_gives_no_ratio_instead_of_dividing_by_it(tmp_path, ours, peer):
    rec = make_ctx(tmp_path).record("c", "m", ours, peer, "p", target=2.0, target_kind="ratio>=")
    assert rec.ratio is None and rec.passed is False


def test_has_time_is_inclusive_at_the_deadline(tmp_path, monkeypatch):
    import leandiffusion.bench.harness as harness

    ctx = make_ctx(tmp_path, deadline=1000.0)
    monkeypatch.setattr(harness.time, "time", lambda: 990.0)
    assert ctx.time_left() == 10.0 and ctx.has_time(10.0) and not ctx.has_time(10.5)


def test_a_skip_reaches_the_sink_at_once(tmp_path):
    """A suite killed right after ``skip`` still reports the case it left out (the sink is written on skip)."""
    sink = tmp_path / "r.json"
    make_ctx(tmp_path, sink=sink).skip("big", "no time")
    assert json.loads(sink.read_text())["skipped"] == [{"case": "big", "reason": "no time"}]


def test_smoke_mode_runs_on_the_cpu_even_where_cuda_is_available(tmp_path, monkeypatch):
    import leandiffusion.bench.harness as harness

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(harness, "device_name", lambda: "fake gpu")
    monkeypatch.setattr(harness, "versions", lambda: {"torch": torch.__version__})
    assert BenchContext("unit", tmp_path, smoke=True).device.type == "cpu"
    assert BenchContext("unit", tmp_path, smoke=False).device.type == "cuda"


class _FakeCuda:
    """Stands in for ``torch.cuda``'s timing and memory calls; logs every call in order, with a clock."""

    def __init__(self, monkeypatch, reserved=3 * 2**30, allocated=2**30):
        self.log = []
        fake = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing
                self.t = None

            def record(self):
                fake.log.append("record")
                self.t = time.perf_counter()

            def elapsed_time(self, end):
                return (end.t - self.t) * 1e3

        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
            monkeypatch.setattr(torch.cuda, name, lambda *a, _n=name: fake.log.append(_n))
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a: fake.log.append("reserved") or reserved)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: fake.log.append("allocated") or allocated)


def test_cuda_timing_brackets_exactly_the_call_between_synchronised_events(monkeypatch):
    """On a GPU, ``time_ms`` times with CUDA events: the queue is drained before the start event, the call runs
    between the two events, and the end event is waited for before it is read (CUDA faked by a clock-event stub:
    the GPU itself cannot be checked here)."""
    cuda = _FakeCuda(monkeypatch)

    def fn():
        cuda.log.append("fn")
        time.sleep(0.02)

    ms = time_ms(fn, warmup=1, repeat=2, device=torch.device("cuda"))
    assert 19 <= ms < 60
    one = ["synchronize", "record", "fn", "record", "synchronize"]
    assert cuda.log == ["fn"] + one + one


def test_cpu_timing_on_a_machine_with_cuda_uses_the_host_clock(monkeypatch):
    """``device=cpu`` is timed with ``perf_counter`` even where CUDA exists (CUDA events would time the GPU's queue,
    not the host work)."""
    cuda = _FakeCuda(monkeypatch)
    assert 9 <= time_ms(lambda: time.sleep(0.01), warmup=0, repeat=1, device=torch.device("cpu")) < 50
    assert cuda.log == []


def test_peak_memory_resets_before_and_reads_both_peaks_in_gib_after(monkeypatch):
    """The peak of a block is measured from a drained queue, an emptied cache (blocks cached by earlier work are
    not counted) and reset peaks; after the block the queue is drained again, then reserved and allocated peaks
    are read, each in GiB (CUDA faked: the logged order is the contract)."""
    cuda = _FakeCuda(monkeypatch, reserved=3 * 2**30, allocated=2**29)
    with peak_memory(torch.device("cuda")) as mem:
        cuda.log.append("block")
    assert cuda.log == ["synchronize", "empty_cache", "reset_peak_memory_stats", "block", "synchronize", "reserved",
                        "allocated"]
    assert mem == {"reserved_gb": 3.0, "allocated_gb": 0.5}


def test_non_finite_numbers_inside_tuples_are_stored_as_null(tmp_path):
    write_json({"pair": (1.0, float("nan")), "deep": [(float("-inf"),)]}, tmp_path / "t.json")
    assert json.loads((tmp_path / "t.json").read_text()) == {"pair": [1.0, None], "deep": [[None]]}

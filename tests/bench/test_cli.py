"""Guards the CLI's promises with stub suites (tests/bench/stubs): one process per suite, a crashing, raising or
hanging suite is recorded as failed with its error and keeps the records it made, the others still run, time
budgets are shared and enforced, parts split the full run, and the last output lines are the summary."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from leandiffusion.bench import __main__ as cli
from leandiffusion.bench import schedule, schema

STUBS = Path(__file__).parent / "stubs"


def run_cli(*args, timeout=170):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "leandiffusion.bench", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def stub_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("stubs")
    t0 = time.time()
    proc = run_cli("--smoke", "--suite-dir", str(STUBS), "--budget", "30", "--out", str(out))
    return proc, out, time.time() - t0


def test_stub_run_records_every_outcome(stub_run):
    proc, out, _ = stub_run
    assert proc.returncode == 1, proc.stdout + proc.stderr  # a suite failed, so the run says so
    doc = schema.load(out / "bench.json")
    assert schema.validate(doc) == []
    status = {s["suite"]: s for s in doc["suites"]}
    assert {k: v["status"] for k, v in status.items()} == {
        "boom": "failed", "comfy": "skipped", "exit": "crashed", "hang": "timeout", "ok": "ok"}
    assert "stub suite exploded on purpose" in status["boom"]["error"]
    assert "exit code 3" in status["exit"]["error"]
    assert "killed after" in status["hang"]["error"]
    assert "--comfyui" in status["comfy"]["skipped"][0]["reason"]
    assert status["ok"]["skipped"] == [{"case": "matmul4096", "reason": "too large for a stub"}]
    cases = {(r["suite"], r["case"], r["metric"]) for r in doc["records"]}
    # records made before a raise or a kill survive
    assert ("boom", "before_crash", "time_ms") in cases and ("hang", "before_hang", "time_ms") in cases
    assert len([c for c in cases if c[0] == "ok"]) == 4
    assert all(r["device"].startswith("cpu") for r in doc["records"])


def test_stub_run_writes_the_report_files_and_ends_with_the_summary(stub_run):
    proc, out, seconds = stub_run
    assert {p.name for p in out.iterdir()} == {"bench.json", "BENCHMARKS.md", "bench.log", "time.png", "vram.png",
                                               "throughput.png"}
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("TOTAL: 2 pass, 0 fail, 6 records; suites failed: boom, exit, hang")
    tail = "\n".join(lines[-12:])
    assert "ok/matmul64 time_ms" in tail and "PASS" in tail and "suite hang: TIMEOUT" in tail
    assert "ROW ok/matmul64 max_abs_diff" in (out / "bench.log").read_text()
    assert seconds < 90  # the budget (30 s) bounds the run, hang included


@pytest.mark.slow
def test_spawn_isolation_runs_a_fresh_interpreter(tmp_path):
    # the GPU path: a new python process per suite (here on the CPU, still in smoke mode); --no-charts leaves
    # only the text files
    proc = run_cli("--smoke", "--isolation", "spawn", "--suite-dir", str(STUBS), "--suite", "ok", "--no-charts",
                   "--budget", "150", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = schema.load(tmp_path / "bench.json")
    assert {s["suite"]: s["status"] for s in doc["suites"]} == {"ok": "ok"}, proc.stdout
    assert "mode smoke, spawn" in proc.stdout
    assert {p.name for p in tmp_path.iterdir()} == {"bench.json", "BENCHMARKS.md", "bench.log"}


def test_usage_errors(tmp_path, capsys):
    with pytest.raises(SystemExit, match="no such suite; available: boom, comfy, exit, hang, ok"):
        cli.main(["--suite", "nope", "--suite-dir", str(STUBS), "--out", str(tmp_path)])
    for args, fragment in ((["--quick", "--smoke"], "exclude each other"), (["--part", "5/4"], "--part")):
        with pytest.raises(SystemExit):
            cli.main([*args, "--out", str(tmp_path)])
        assert fragment in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--out DIR is required"):
        cli.main(["--smoke", "--suite-dir", str(STUBS)])
    with pytest.raises(SystemExit, match="--smoke only"):
        cli.main(["--quick", "--isolation", "fork", "--suite-dir", str(STUBS), "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match=r"--budget=0.0: expected a positive number of seconds"):
        cli.main(["--smoke", "--budget", "0", "--suite-dir", str(STUBS), "--out", str(tmp_path)])


def test_list(capsys):
    assert cli.main(["--list", "--smoke", "--suite-dir", str(STUBS)]) == 0
    out = capsys.readouterr().out
    assert "hang" in out and "(needs --comfyui)" in out


def test_discovery_reads_constants_without_importing():
    found = schedule.discover(STUBS)
    assert list(found) == ["boom", "comfy", "exit", "hang", "ok"]
    assert found["ok"].weight("smoke") == 20 and found["ok"].weight("quick") == schedule.DEFAULT_WEIGHT_S["quick"]
    assert found["comfy"].requires_comfyui and not found["ok"].requires_comfyui
    assert "suite_device.py" in {p.path.name for p in schedule.discover().values()}  # the package's own suites


def test_parts_cover_every_suite_once_and_balance_weights():
    infos = [schedule.SuiteInfo(n, Path(n), None, {"FULL_BUDGET_S": w})
             for n, w in [("a", 300), ("b", 200), ("c", 200), ("d", 100), ("e", 100), ("f", 60), ("g", 20)]]
    parts = schedule.split_parts(infos, 4, "full")
    names = [s.name for p in parts for s in p]
    assert sorted(names) == list("abcdefg")
    loads = [sum(s.weight("full") for s in p) for p in parts]
    assert max(loads) <= 300  # no part above the heaviest suite here
    assert schedule.split_parts(infos, 4, "full") == parts  # deterministic
    assert schedule.parse_part("2/4") == (2, 4)
    for bad in ("0/4", "5/4", "x", "1/2/3"):
        with pytest.raises(ValueError, match="--part"):
            schedule.parse_part(bad)


def test_share_of_the_remaining_budget():
    assert schedule.share_s(100, [60, 20, 20]) == pytest.approx(60)
    assert schedule.share_s(100, [10]) == pytest.approx(100)  # the last suite gets all that is left
    assert schedule.share_s(100, [0, 0]) == 0.0
    assert schedule.kill_after_s(100, 60) == pytest.approx(80)  # its share + half of what the others would get
    assert schedule.kill_after_s(100, 100) == pytest.approx(100)  # the last suite: everything left, no more


def test_parts_leave_comfyui_suites_out_without_comfyui(tmp_path, monkeypatch):
    # with --part and no --comfyui, a ComfyUI-only suite must not take a part of its own
    seen = {}

    def fake_run_suite(info, mode, out_dir, tmp_dir, share, comfyui, tee, isolation="spawn", kill_after=None):
        seen[info.name] = share
        return {"suite": info.name, "status": "ok", "error": "", "skipped": [], "records": []}

    monkeypatch.setattr(cli, "run_suite", fake_run_suite)
    monkeypatch.setattr(cli, "_preimport", lambda: None)
    ran = set()
    for k in (1, 2):
        seen.clear()
        assert cli.main(["--smoke", "--suite-dir", str(STUBS), "--part", f"{k}/2", "--no-charts", "--budget", "50",
                         "--out", str(tmp_path / str(k))]) == 0
        doc = schema.load(tmp_path / str(k) / "bench.json")
        assert {s["suite"]: s["status"] for s in doc["suites"]}["comfy"] == "skipped"
        ran |= set(seen)
    assert ran == {"boom", "exit", "hang", "ok"}

"""Guards the report: the schema check catches malformed records, the end-of-run summary stays compact and ends
with the totals line, and Markdown / charts render from a bench.json without a GPU."""
import copy
import json

import pytest

from leandiffusion.bench import charts, report, schema, summary


def rec(**kw):
    base = {"suite": "s", "case": "c", "metric": "step_ms", "ours": 10.0, "peer": 20.0, "peer_name": "eager",
            "ratio": 2.0, "target": ">= 1.5x eager", "passed": True, "pass": True, "unit": "ms", "device": "gpu",
            "versions": {"torch": "2.11", "python": "3.12"}, "notes": ""}
    base.update(kw)
    return base


def doc(records, statuses=None):
    names = sorted({r["suite"] for r in records} | set(statuses or {}))
    suites = [{"suite": n, "status": (statuses or {}).get(n, "ok"), "error": "", "seconds": 1.0, "budget_s": 5.0,
               "skipped": [], "records": sum(r["suite"] == n for r in records)} for n in names]
    return {"schema": 1, "meta": {"mode": "quick", "device": "Test GPU", "date": "1970-01-01",
                                  "versions": {"torch": "2.11"}, "command": "python -m leandiffusion.bench --quick"},
            "suites": suites, "records": records}


def suite(d, name):
    return next(s for s in d["suites"] if s["suite"] == name)


def test_good_record_passes():
    assert schema.validate_record(rec()) == []
    assert schema.validate(doc([rec(), rec(case="d", peer=None, peer_name="", ratio=None, target="", passed=None,
                                           **{"pass": None})])) == []


@pytest.mark.parametrize("change, fragment", [
    ({"ours": "fast"}, "ours"),
    ({"ours": True}, "ours"),
    ({"ours": float("nan")}, "not finite"),
    ({"passed": "yes", "pass": "yes"}, "passed"),
    ({"pass": False}, "differs"),
    ({"target": ""}, "target is empty"),
    ({"passed": None, "pass": None}, "has no pass/fail"),
    ({"peer": None}, "ratio without a peer"),
    ({"peer_name": ""}, "peer without a peer_name"),
    ({"suite": " "}, "suite is empty"),
    ({"versions": {}}, "torch"),
    ({"ours": None}, "ours is null"),
])
def test_bad_records_are_caught(change, fragment):
    errors = schema.validate_record(rec(**change))
    assert any(fragment in e for e in errors), errors


def test_missing_key_and_unknown_suite_and_bad_status():
    bad = rec()
    del bad["metric"]
    d = doc([bad])
    d["records"].append(rec(suite="ghost"))
    d["suites"][0]["status"] = "crashed"  # crashed without an error message
    errors = schema.validate(d)
    assert any("missing key 'metric'" in e for e in errors)
    assert any("'ghost' is not in 'suites'" in e for e in errors)
    assert any("without an error message" in e for e in errors)


def test_load_accepts_a_bare_record_list(tmp_path):
    r = rec()
    del r["pass"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps([r]))
    d = schema.load(path)
    assert schema.validate(d) == []
    assert d["records"][0]["pass"] is True


def test_summary_is_bounded_and_ends_with_totals():
    records = [rec(case=f"t{i}") for i in range(5)] + [rec(case=f"f{i}", passed=False, **{"pass": False}) for i in range(2)]
    records += [rec(case=f"info{i}", target="", passed=None, **{"pass": None}) for i in range(200)]
    d = doc(records, statuses={"broken": "failed"})
    suite(d, "broken")["error"] = "Traceback (most recent call last):\n  File x\nRuntimeError: CUDA out of memory"
    lines = summary.summary_lines(d, max_rows=40)
    assert lines[-1].startswith("TOTAL: 5 pass, 2 fail, 207 records; suites failed: broken")
    assert any("RuntimeError: CUDA out of memory" in x for x in lines)
    assert len(lines) < 60 and all(len(x) <= 200 for x in lines)
    assert sum(x.endswith(" FAIL") for x in lines) == 2  # every targeted record is shown even when rows are cut


def test_format_row_columns():
    row = summary.format_row(rec())
    for part in ("s/c step_ms", " 10 ", " 20 ", " ms ", "eager", "2.00x", ">= 1.5x eager", "PASS"):
        assert part in row
    assert summary.format_row(rec(ours=None, passed=False, **{"pass": False})).split()[-1] == "FAIL"


def test_markdown_outputs(tmp_path):
    d = doc([rec(), rec(case="mem", metric="peak_reserved_gb", unit="GB", ours=3.5, peer=7.0)],
            statuses={"dead": "timeout"})
    suite(d, "dead")["error"] = "killed after 100s\nlast output"
    md = report.benchmarks_markdown(d, ["time.png"])
    assert "| c | step_ms | 10 ms | 20 ms (eager) | 2.00x | >= 1.5x eager | **pass** |" in md
    assert "## Suites" in md and "killed after 100s" in md and "![time](time.png)" in md
    block = report.readme_markdown(d, "docs/bench")
    assert "Test GPU" in block and "1970-01-01" in block and "**2 of 2 targets pass.**" in block
    assert "![time](docs/bench/time.png)" in block and "![vram](docs/bench/vram.png)" in block
    assert "suite `dead` timeout: killed after 100s" in block


@pytest.mark.parametrize("metric, unit, kind", [
    ("step_ms", "ms", "time"), ("load_s", "s", "time"), ("peak_reserved_gb", "GB", "vram"),
    ("peak_allocated", "GiB", "vram"), ("images_per_s", "img/s", "throughput"), ("copy_gbps", "GB/s", "throughput"),
    ("max_abs_diff", "", None), ("speedup", "x", None),
])
def test_chart_kind(metric, unit, kind):
    assert charts.chart_kind({"metric": metric, "unit": unit}) == kind


@pytest.mark.parametrize("backend", ["pillow", "matplotlib"])
def test_charts_render(tmp_path, backend):
    if backend == "matplotlib":
        pytest.importorskip("matplotlib")
    from PIL import Image

    d = doc([rec(), rec(case="stream", metric="peak_reserved_gb", unit="GB", ours=3.9, peer=0.96),
             rec(case="b", metric="images_per_s", unit="img/s", ours=4.0, peer=2.0, ratio=2.0),
             rec(suite="t", case="x", metric="step_ms", peer=None, peer_name="", ratio=None, target="", passed=None,
                 **{"pass": None})])
    paths = charts.write_charts(d, tmp_path, backend=backend)
    assert [p.name for p in paths] == ["time.png", "vram.png", "throughput.png"]
    for p in paths:
        with Image.open(p) as img:
            assert img.size[0] >= 600 and img.size[1] >= 100
    with pytest.raises(ValueError, match="backend"):
        charts.write_charts(d, tmp_path, backend="svg")


def test_report_cli(tmp_path, capsys):
    d = doc([rec()])
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(d))
    assert report.main([str(path), "--check", "--markdown", "--write"]) == 0
    out = capsys.readouterr().out
    assert "schema: 0 problem(s)" in out and "targets pass" in out
    assert (tmp_path / "BENCHMARKS.md").exists() and (tmp_path / "time.png").exists()
    broken = copy.deepcopy(d)
    broken["records"][0]["ours"] = "x"
    path.write_text(json.dumps(broken))
    assert report.main([str(path), "--check"]) == 1


def test_lint_flags_ambiguous_records():
    d = doc([rec(), rec(), rec(case="other")])
    assert schema.lint(d) == ["s/c step_ms recorded 2 times"]
    assert schema.validate(d) == []  # ambiguity is a warning, not a schema error
    assert any(x.startswith("WARN 1 ambiguous key(s): s/c step_ms") for x in summary.summary_lines(d))
    assert "Ambiguous records" in report.benchmarks_markdown(d)


def test_chart_labels_tell_ambiguous_records_apart():
    d = doc([rec(notes="acceleration=none; x"), rec(notes="acceleration=cuda_graph; x")])
    labels = [item[0] for _, items in charts.chart_groups(d, "time") for item in items]
    assert labels == ["c · step_ms (acceleration=none)", "c · step_ms (acceleration=cuda_graph)"]


def test_interrupted_report_write_keeps_the_last_good_files(tmp_path, monkeypatch):
    """bench.json / BENCHMARKS.md are rewritten after every suite: a write that fails midway (disk full, kill) must
    leave the previous files whole, not truncated ones that lose the run's measurements."""
    import builtins
    import io

    report.write_all(doc([rec()]), tmp_path, charts=False)
    good = {n: (tmp_path / n).read_bytes() for n in ("bench.json", "BENCHMARKS.md")}
    real_open = io.open

    class HalfWriter:
        def __init__(self, fh):
            self.fh = fh

        def write(self, data):
            self.fh.write(data[:len(data) // 2])
            raise OSError(28, "No space left on device")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

        def __getattr__(self, name):
            return getattr(self.fh, name)

    def failing_open(file, mode="r", *args, **kwargs):
        fh = real_open(file, mode, *args, **kwargs)
        return HalfWriter(fh) if "w" in mode else fh

    monkeypatch.setattr(io, "open", failing_open)
    monkeypatch.setattr(builtins, "open", failing_open)
    with pytest.raises(OSError, match="No space"):
        report.write_all(doc([rec(), rec(case="d")]), tmp_path, charts=False)
    monkeypatch.undo()
    assert {n: (tmp_path / n).read_bytes() for n in good} == good
    assert sorted(p.name for p in tmp_path.iterdir()) == ["BENCHMARKS.md", "bench.json"]


def test_failed_chart_render_keeps_the_last_good_chart(tmp_path, monkeypatch):
    from PIL import Image

    d = doc([rec()])
    charts.write_charts(d, tmp_path, backend="pillow")
    good = (tmp_path / "time.png").read_bytes()

    def broken_save(self, fp, *args, **kwargs):
        with open(fp, "wb") as fh:
            fh.write(b"\x89PNG\r\n")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Image.Image, "save", broken_save)
    with pytest.raises(OSError, match="No space"):
        charts.write_charts(d, tmp_path, backend="pillow")
    monkeypatch.undo()
    assert (tmp_path / "time.png").read_bytes() == good
    assert sorted(p.name for p in tmp_path.iterdir()) == ["time.png"]


def test_readme_block_lists_skipped_cases_next_to_the_count():
    """A targeted case skipped for time makes no record, so the README block's "N of M targets pass" leaves it out
    of M; the block must say how many cases were skipped and which."""
    d = doc([rec()])
    suite(d, "s")["skipped"] = [{"case": "sdxl-1024/compile+cuda_graph", "reason": "not enough time"}]
    block = report.readme_markdown(d, "docs/bench")
    assert "1 case(s) skipped" in block
    assert "skipped `s/sdxl-1024/compile+cuda_graph`: not enough time" in block
    assert "neither passed nor failed" in block


# --------------------------------------------------------------------------------------------- tables and charts
def test_readme_counts_targets_not_records_and_lists_every_failure():
    """"N of M targets pass": M counts targeted records only (a comparison without a target is neither), and the
    table lists the failures next to the passes."""
    d = doc([rec(), rec(case="slow", ours=30.0, ratio=0.67, passed=False, **{"pass": False}),
             rec(case="info", target="", passed=None, **{"pass": None})])
    block = report.readme_markdown(d)
    assert "**1 of 2 targets pass.**" in block
    assert "| s | slow | step_ms | 30 ms | 20 ms (eager) | 0.67x | >= 1.5x eager | **FAIL** |" in block
    assert "| info |" not in block
    assert summary.counts(d) == {"pass": 1, "fail": 1, "records": 3}


def test_a_record_without_a_ratio_shows_a_dash_in_every_table():
    r = rec(peer=None, peer_name="", ratio=None)
    assert "| c | step_ms | 10 ms | - | - | >= 1.5x eager | **pass** |" in report.benchmarks_markdown(doc([r]))
    assert summary.format_row(r).split()[-5] == "-"  # ratio column (then the target ">= 1.5x eager", result)


def test_a_suite_that_failed_before_recording_shows_its_whole_error():
    d = doc([rec()], statuses={"dead": "crashed"})
    suite(d, "dead")["error"] = "Traceback (most recent call last):\n  File \"suite_dead.py\", line 3\nMemoryError"
    md = report.benchmarks_markdown(d)
    assert "## dead" in md and "File \"suite_dead.py\", line 3" in md


def test_pipes_and_newlines_in_text_cells_do_not_break_the_table():
    md = report.benchmarks_markdown(doc([rec(case="a|b", notes="x | y\nz")]))
    row = next(line for line in md.splitlines() if line.startswith("| a"))
    assert row.count("|") - row.count("\\|") == 9  # 8 columns and "a\\|b" in row and "x \\| y z" in row


def test_numbers_switch_to_exponent_form_at_the_documented_bounds():
    assert summary.fmt(100000.0) == "1.000e+05"
    assert summary.fmt(0.001) == "0.001" and summary.fmt(0.000999) == "9.990e-04"


def test_a_throughput_unit_per_second_is_charted_as_throughput():
    assert charts.chart_kind({"metric": "decode_fps", "unit": "frames/s"}) == "throughput"


@pytest.mark.parametrize("metric, unit", [("sampler_it_s", "it/s"), ("it_s", "")])
def test_iterations_per_second_are_throughput_not_time(metric, unit):
    """``chart_kind`` lists ``it_s`` as a throughput name, checked before the time rule (names ending in ``_s``)
    would match it, so an it/s record is never drawn on the time chart (lower is better)."""
    assert charts.chart_kind({"metric": metric, "unit": unit}) == "throughput"


@pytest.mark.parametrize("metric", ["wait_s", "init_s", "queue_wait_s", "split_s"])
def test_seconds_whose_name_ends_in_it_s_stay_times(metric):
    """Only ``it_s`` itself or a ``..._it_s`` name is iterations per second; a rule matching every name ending in
    ``it_s`` would turn a wait or an init time into a throughput."""
    assert charts.chart_kind({"metric": metric, "unit": "s"}) == "time"
    assert charts.chart_kind({"metric": metric, "unit": ""}) == "time"


def test_charts_skip_records_without_a_number(tmp_path):
    """A record whose ``ours`` is null (a non-finite measurement) has no bar: it is left out of the panels, and a
    kind whose every record is null gets no chart."""
    d = doc([rec(), rec(case="nan", ours=None, ratio=None, target="", passed=None, **{"pass": None}),
             rec(case="m", metric="peak_reserved_gb", unit="GB", ours=None, ratio=None, target="", passed=None,
                 **{"pass": None})])
    assert charts.chart_kinds(d) == ["time"]
    assert [item[0] for _, items in charts.chart_groups(d, "time") for item in items] == ["c · step_ms"]
    assert [p.name for p in charts.write_charts(d, tmp_path, backend="pillow")] == ["time.png"]


def test_write_all_stores_pass_beside_passed(tmp_path):
    r = rec()
    del r["pass"]
    report.write_all(doc([r]), tmp_path, charts=False)
    stored = json.loads((tmp_path / "bench.json").read_text())["records"][0]
    assert stored["pass"] is True and schema.validate_record(stored) == []


def test_summary_shows_exactly_max_rows_records_targets_first():
    records = [rec(case=f"t{i}") for i in range(7)]
    records += [rec(case=f"info{i}", target="", passed=None, **{"pass": None}) for i in range(200)]
    lines = summary.summary_lines(doc(records), max_rows=40)
    rows = [x for x in lines if x.startswith("s/")]
    assert len(rows) == 40 and all(x.startswith("s/t") for x in rows[:7])
    assert "... 167 more record(s) without a target in bench.json / BENCHMARKS.md" in lines

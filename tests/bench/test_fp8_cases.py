"""The fp8 benchmark parts in smoke mode (tiny models, CPU): ``zimage``'s ``fp8`` / ``stream_fp8`` and ``sampler``'s
``sdxl_fp8`` / ``sdxl_fp8_4gb``, asked for through the suites' environment variables in one CLI call each, as
``scripts/device_bench.sh`` passes them on the device.

Guards: a part that is asked for but never runs (the variable not reaching the suite's process, a part left out of
the smoke path) or runs without recording its rows; an fp8 engine that is not really fp8 (its latent equal to the
unquantized one: distance 0) or wrong (far from it: the fp8 rounding of a tiny model moves a latent by a few %, the
CPU smoke measured 0.025 for Z-Image and 0.12 for the tiny SDXL); a streamed fp8 run that differs from the resident
one (bit-identical on the CPU); targets attached to the wrong rows. The default part lists keep the fp8 parts out
(the ``--quick`` call's time).
"""
import os
import subprocess
import sys

import pytest

from leandiffusion.bench import schema, suite_sampler, suite_zimage

FP8_ENV = {"LEANDIFFUSION_BENCH_ZIMAGE_CASES": "cuda_graph,fp8,stream_fp8",
           "LEANDIFFUSION_BENCH_SAMPLER_CASES": "sdxl_fp8,sdxl_fp8_4gb"}


@pytest.fixture(scope="module")
def fp8_smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8_smoke")
    env = dict(os.environ, PYTHONUNBUFFERED="1", **FP8_ENV)
    proc = subprocess.run([sys.executable, "-m", "leandiffusion.bench", "--smoke", "--suite", "zimage", "sampler",
                           "--no-charts", "--budget", "300", "--out", str(out)], capture_output=True, text=True,
                          timeout=400, env=env)
    doc = schema.load(out / "bench.json")
    assert schema.validate(doc) == [], proc.stdout[-4000:]
    for status in doc["suites"]:
        assert status["status"] == "ok", f"{status['suite']}: {status.get('error')}\n{proc.stdout[-4000:]}"
    return {(r["suite"], r["case"], r["metric"]): r for r in doc["records"]}


def test_zimage_fp8_parts_record_their_rows(fp8_smoke):
    rows = {(case, metric): r for (suite, case, metric), r in fp8_smoke.items() if suite == "zimage"}
    for storage in ("fp8_e4m3fn", "fp8_e4m3fn_fast"):
        for metric in ("e2e_ms", "e2e_ms_{}_vs_bf16", "peak_reserved_gb", "rel_vs_bf16", "rel_vs_fp32"):
            name = metric.format(storage) if "{}" in metric else f"{metric}_{storage}"
            assert ("1024_9steps", name) in rows, name
        rel = rows[("1024_9steps", f"rel_vs_bf16_{storage}")]["ours"]
        assert 1e-3 < rel < 0.1, (storage, rel)
        assert rows[("1024_9steps", f"e2e_ms_{storage}")]["peer_name"] == "diffusers ZImagePipeline bf16"
    fast_compiled = "fp8_e4m3fn_fast_compile+cuda_graph"
    for metric in ("e2e_ms", "peak_reserved_gb", "rel_vs_bf16", "rel_vs_fp32"):
        assert ("1024_9steps", f"{metric}_{fast_compiled}") in rows, metric
    assert rows[("1024_9steps", f"e2e_ms_{fast_compiled}")]["target"].startswith(">= 1.6x")
    assert rows[("1024_9steps", "e2e_ms_fp8_e4m3fn_fast")]["target"] == ""
    assert rows[("1024_9steps", "e2e_ms_fp8_e4m3fn")]["target"] == ""
    assert ("1024_9steps", "e2e_ms_fp8_e4m3fn_compile+cuda_graph") not in rows
    stream = {m: r for (case, m), r in rows.items() if case == "stream_4gb_fp8"}
    assert set(stream) == {"peak_reserved_gb", "e2e_ms_vs_resident", "rel_vs_resident"}
    assert stream["rel_vs_resident"]["ours"] == 0.0
    assert stream["e2e_ms_vs_resident"]["peer_name"] == "resident fp8_e4m3fn cuda_graph"
    assert stream["peak_reserved_gb"]["target"] == "<= 4 GB"


def test_sampler_sdxl_fp8_cases_record_their_rows(fp8_smoke):
    rows = {(case, metric): r for (suite, case, metric), r in fp8_smoke.items() if suite == "sampler"}
    fast = {m: r for (case, m), r in rows.items() if case == "tiny-sdxl-64/fp8_e4m3fn_fast"}
    capped = {m: r for (case, m), r in rows.items() if case == "tiny-sdxl-64/fp8_e4m3fn_4gb"}
    assert set(fast) == {"loop_ms", "loop_ms_vs_fp16", "rel_vs_fp16", "rel_vs_diffusers", "peak_reserved_gb"}
    assert set(capped) == {"peak_reserved_gb", "loop_ms", "rel_vs_fp16"}
    assert fast["loop_ms"]["peer_name"].startswith("diffusers eager loop")
    assert capped["peak_reserved_gb"]["target"] == "<= 4 GB" and capped["peak_reserved_gb"]["passed"]
    assert "balanced policy" in capped["peak_reserved_gb"]["notes"]
    for r in (fast["rel_vs_fp16"], fast["rel_vs_diffusers"], capped["rel_vs_fp16"]):
        assert 1e-3 < r["ours"] < 0.3, r
    assert ("tiny-sdxl-64/cuda_graph", "rel_diff_vs_diffusers") in rows  # the smoke's own cases still ran


def test_the_stream_part_alone_runs_its_resident_reference_first(monkeypatch, tmp_path):
    from leandiffusion.bench.harness import BenchContext

    monkeypatch.setenv("LEANDIFFUSION_BENCH_ZIMAGE_CASES", "stream_fp8")
    ctx = BenchContext("zimage", tmp_path, smoke=True)
    suite_zimage.run(ctx)
    got = {(r.case, r.metric) for r in ctx.records}
    assert ("1024_9steps", "e2e_ms_fp8_e4m3fn") in got and ("stream_4gb_fp8", "rel_vs_resident") in got
    assert not any("fast" in m or m.endswith("_vs_bf16") for _, m in got)  # no bf16 row, no fast engine asked for
    assert ctx.skipped == []


def test_default_parts_leave_fp8_out_and_typos_are_refused(monkeypatch):
    monkeypatch.delenv("LEANDIFFUSION_BENCH_ZIMAGE_CASES", raising=False)
    monkeypatch.delenv("LEANDIFFUSION_BENCH_SAMPLER_CASES", raising=False)
    assert not {"fp8", "stream_fp8"} & set(suite_zimage.selected_parts())
    assert suite_sampler.wanted_cases() == ["sd15", "sdxl"]
    monkeypatch.setenv("LEANDIFFUSION_BENCH_SAMPLER_CASES", "sdxl,sdxl_fp8_8gb")
    with pytest.raises(ValueError, match="LEANDIFFUSION_BENCH_SAMPLER_CASES.*sdxl_fp8_8gb"):
        suite_sampler.wanted_cases()

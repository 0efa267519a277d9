"""CI's smoke run of the real suites: ``python -m leandiffusion.bench --smoke`` over every ``bench/suite_*.py``
on the CPU with tiny models, in under two minutes, and every suite's JSON records well-formed.

Tolerant of suites that do not exist yet (the parametrisation is whatever ``bench/`` holds now) and strict about
those that do: each must end ``ok`` (``skipped`` only for a suite that needs ``--comfyui``), make at least one
record, and every record must pass the schema check."""
import os
import subprocess
import sys
import time

import pytest

from leandiffusion.bench import schedule, schema

SUITES = schedule.discover()
SMOKE_LIMIT_S = 120


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("smoke")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "leandiffusion.bench", "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=SMOKE_LIMIT_S + 60, env=env)
    return proc, schema.load(out / "bench.json"), time.time() - t0


def test_smoke_run_is_well_formed_and_fast(smoke):
    proc, doc, seconds = smoke
    assert schema.validate(doc) == [], proc.stdout[-4000:]
    assert [s["suite"] for s in doc["suites"]] == sorted(SUITES)
    assert seconds < SMOKE_LIMIT_S, f"smoke run took {seconds:.0f}s"
    assert proc.stdout.strip().splitlines()[-1].startswith("TOTAL:")


@pytest.mark.parametrize("name", sorted(SUITES), ids=lambda n: f"suite_{n}")  # "comfyui" alone is a marker name
def test_each_suite_smokes(smoke, name):
    proc, doc, _ = smoke
    status = next(s for s in doc["suites"] if s["suite"] == name)
    allowed = ("ok", "skipped") if SUITES[name].requires_comfyui else ("ok",)
    assert status["status"] in allowed, f"{name}: {status['status']}: {status.get('error')}"
    records = [r for r in doc["records"] if r["suite"] == name]
    if status["status"] == "ok":
        assert records, f"suite {name} made no record in smoke mode"
    for r in records:
        assert schema.validate_record(r) == [], r
        assert r["device"].startswith("cpu")

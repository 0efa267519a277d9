"""The ``bench.json`` document: its schema, the check of a record and of a whole document, and loading.

``bench.json`` is one document::

    {"schema": 1, "meta": {date, mode, argv, device, versions, budget_s, ...},
     "suites": [{suite, status, error, seconds, budget_s, skipped: [{case, reason}], records: n}, ...],
     "records": [{suite, case, metric, ours, peer, peer_name, ratio, target, passed, pass, unit, device,
                  versions, notes}, ...]}

one record per measurement (``pass`` mirrors ``passed``: True / False, or null for a record without a target).
``ratio`` is how many times better ours is than the peer: ``peer/ours`` for times and memory, ``ours/peer`` for
throughput. Non-finite numbers are stored as null (strict JSON). ``load`` also accepts the bare list of records
that ``harness.write_json`` writes.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

SCHEMA_VERSION = 1
STATUSES = ("ok", "failed", "crashed", "timeout", "skipped", "running")
RECORD_KEYS = {"suite": str, "case": str, "metric": str, "peer_name": str, "target": str, "unit": str,
               "device": str, "versions": dict, "notes": str}
NUMBER_OR_NULL = ("ours", "peer", "ratio")


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def validate_record(rec) -> list[str]:
    """Problems with one record (an empty list when it is well-formed)."""
    if not isinstance(rec, dict):
        return [f"record is {type(rec).__name__}, expected an object"]
    errors = []
    for key, typ in RECORD_KEYS.items():
        if key not in rec:
            errors.append(f"missing key {key!r}")
        elif not isinstance(rec[key], typ):
            errors.append(f"{key}={rec[key]!r} is {type(rec[key]).__name__}, expected {typ.__name__}")
    for key in ("suite", "case", "metric", "device"):
        if isinstance(rec.get(key), str) and not rec[key].strip():
            errors.append(f"{key} is empty")
    for key in NUMBER_OR_NULL:
        if key not in rec:
            errors.append(f"missing key {key!r}")
        elif rec[key] is not None and not _is_number(rec[key]):
            errors.append(f"{key}={rec[key]!r} is not a number or null")
        elif _is_number(rec[key]) and not math.isfinite(rec[key]):
            errors.append(f"{key}={rec[key]!r} is not finite (store null)")
    passed = rec.get("passed", "missing")
    if passed == "missing":
        errors.append("missing key 'passed'")
    elif passed is not None and not isinstance(passed, bool):
        errors.append(f"passed={passed!r} is not true/false/null")
    if "pass" in rec and rec["pass"] != rec.get("passed"):
        errors.append(f"pass={rec['pass']!r} differs from passed={rec.get('passed')!r}")
    if isinstance(passed, bool) and not rec.get("target"):
        errors.append("passed is set but target is empty")
    if rec.get("target") and passed is None:
        errors.append(f"target {rec['target']!r} has no pass/fail")
    if passed is True and rec.get("ours") is None:
        errors.append("passed is true but ours is null")
    if rec.get("ratio") is not None and rec.get("peer") is None:
        errors.append("ratio without a peer")
    if rec.get("peer") is not None and not rec.get("peer_name"):
        errors.append("peer without a peer_name")
    if isinstance(rec.get("versions"), dict) and "torch" not in rec["versions"]:
        errors.append("versions lacks 'torch'")
    return errors


def validate(doc) -> list[str]:
    """Problems with a whole ``bench.json`` document, each prefixed by where it is."""
    if not isinstance(doc, dict):
        return ["document is not an object (load() it first)"]
    errors = []
    for key in ("meta", "suites", "records"):
        if key not in doc:
            errors.append(f"missing top-level key {key!r}")
    if errors:
        return errors
    names = set()
    for i, s in enumerate(doc["suites"]):
        where = f"suites[{i}]"
        if not isinstance(s, dict) or not isinstance(s.get("suite"), str):
            errors.append(f"{where}: not an object with a 'suite' name")
            continue
        names.add(s["suite"])
        if s.get("status") not in STATUSES:
            errors.append(f"{where} ({s['suite']}): status={s.get('status')!r}, expected one of {STATUSES}")
        if s.get("status") in ("failed", "crashed", "timeout") and not s.get("error"):
            errors.append(f"{where} ({s['suite']}): status {s['status']} without an error message")
        if not isinstance(s.get("skipped", []), list):
            errors.append(f"{where} ({s['suite']}): skipped is not a list")
    for i, rec in enumerate(doc["records"]):
        label = f"records[{i}]"
        if isinstance(rec, dict):
            label += f" ({rec.get('suite')}/{rec.get('case')}/{rec.get('metric')})"
            if rec.get("suite") not in names:
                errors.append(f"{label}: suite {rec.get('suite')!r} is not in 'suites'")
        errors.extend(f"{label}: {e}" for e in validate_record(rec))
    return errors


def duplicate_keys(doc: dict) -> dict[tuple, int]:
    """``{(suite, case, metric): n}`` for keys recorded more than once."""
    seen: dict[tuple, int] = {}
    for r in doc.get("records", []):
        if isinstance(r, dict):
            key = (r.get("suite"), r.get("case"), r.get("metric"))
            seen[key] = seen.get(key, 0) + 1
    return {k: n for k, n in seen.items() if n > 1}


def lint(doc: dict) -> list[str]:
    """Non-fatal problems: (suite, case, metric) keys recorded more than once, which tables and charts cannot
    tell apart (put the variant, e.g. the acceleration, into ``case``)."""
    return [f"{s}/{c} {m} recorded {n} times" for (s, c, m), n in duplicate_keys(doc).items()]


def normalise_record(rec: dict) -> dict:
    """A record with ``pass`` mirroring ``passed`` and non-finite numbers as None."""
    out = dict(rec)
    for key in NUMBER_OR_NULL:
        if _is_number(out.get(key)) and not math.isfinite(out[key]):
            out[key] = None
    out["pass"] = out.get("passed")
    return out


def load(path) -> dict:
    """Read a ``bench.json`` document (or a bare list of records, wrapped into one)."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, list):
        suites = sorted({r.get("suite", "?") for r in data if isinstance(r, dict)})
        data = {"schema": SCHEMA_VERSION, "meta": {},
                "suites": [{"suite": s, "status": "ok", "error": "", "seconds": None, "skipped": []} for s in suites],
                "records": [normalise_record(r) if isinstance(r, dict) else r for r in data]}
    return data

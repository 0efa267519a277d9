"""Plain-text rendering of benchmark records: number formatting, fixed-width rows and the end-of-run summary."""
from __future__ import annotations

import math
from typing import Optional

from .schema import lint


def fmt(x: Optional[float], digits: int = 4) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    ax = abs(x)
    if ax != 0 and (ax >= 1e5 or ax < 1e-3):
        return f"{x:.{digits - 1}e}"
    return f"{x:.{digits}g}"


def verdict(rec: dict) -> str:
    p = rec.get("passed")
    return "-" if p is None else ("PASS" if p else "FAIL")


def truncate(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters, a "~" marking the cut."""
    return text if len(text) <= width else text[: max(width - 1, 1)] + "~"


ROW_HEADER = (f"{'name':<44} {'ours':>10} {'peer':>10} {'unit':<8} {'peer name':<16} {'ratio':>7} "
              f"{'target':<18} result")


def format_row(rec: dict) -> str:
    """One fixed-width table row: name, ours, peer, unit, peer name, ratio, target, pass/fail (~125 chars)."""
    name = truncate(f"{rec['suite']}/{rec['case']} {rec['metric']}", 44)
    ratio = "-" if rec.get("ratio") is None else f"{rec['ratio']:.2f}x"
    ours, peer = truncate(fmt(rec.get("ours")), 10), truncate(fmt(rec.get("peer")), 10)
    unit, peer_name = truncate(rec.get("unit") or "", 8), truncate(rec.get("peer_name") or "-", 16)
    return (f"{name:<44} {ours:>10} {peer:>10} {unit:<8} {peer_name:<16} {ratio:>7} "
            f"{truncate(rec.get('target') or '-', 18):<18} {verdict(rec)}")


def error_headline(suite: dict) -> str:
    """One line for a suite's error: a traceback's last line (the exception), else the message's first line."""
    lines = [x for x in (suite.get("error") or "").strip().splitlines() if x.strip()]
    if not lines:
        return ""
    return lines[-1].strip() if lines[0].startswith("Traceback") else lines[0].strip()


def counts(doc: dict) -> dict:
    recs = doc.get("records", [])
    return {"pass": sum(r.get("passed") is True for r in recs), "fail": sum(r.get("passed") is False for r in recs),
            "records": len(recs)}


def summary_lines(doc: dict, max_rows: int = 70) -> list[str]:
    """The compact end-of-run summary: suite statuses, every targeted record, then peer comparisons if room.

    Bounded to about ``max_rows`` rows of ~120 characters, so it fits the device tool's 12,000-character tail.
    """
    meta = doc.get("meta", {})
    v = meta.get("versions", {})
    lines = [f"=== LeanDiffusion bench summary: mode {meta.get('mode', '?')}, {meta.get('device', '?')}, "
             f"torch {v.get('torch')}, diffusers {v.get('diffusers')}, {meta.get('date', '')} ===",
             ROW_HEADER]
    recs = doc.get("records", [])
    targeted = [r for r in recs if r.get("passed") is not None]
    compared = [r for r in recs if r.get("passed") is None and r.get("peer") is not None]
    shown = targeted + compared[: max(max_rows - len(targeted), 0)]
    lines += [format_row(r) for r in shown]
    hidden = len(recs) - len(shown)
    if hidden:
        lines.append(f"... {hidden} more record(s) without a target in bench.json / BENCHMARKS.md")
    for s in doc.get("suites", []):
        extra = f" | {truncate(error_headline(s), 90)}" if s.get("error") else ""
        skipped = len(s.get("skipped", []))
        secs = "" if s.get("seconds") is None else f" {s['seconds']:.0f}s"
        lines.append(f"suite {s['suite']}: {s['status'].upper()}{secs}, {s.get('records', '?')} records"
                     f"{f', {skipped} skipped' if skipped else ''}{extra}")
    dups = lint(doc)
    if dups:
        lines.append(truncate(f"WARN {len(dups)} ambiguous key(s): " + "; ".join(dups), 240))
    c = counts(doc)
    bad = [s["suite"] for s in doc.get("suites", []) if s.get("status") in ("failed", "crashed", "timeout")]
    lines.append(f"TOTAL: {c['pass']} pass, {c['fail']} fail, {c['records']} records; suites failed: "
                 f"{', '.join(bad) if bad else 'none'}")
    return lines

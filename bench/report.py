"""Benchmark report: a run's bench.json rendered as BENCHMARKS.md, the README block and PNG charts.

``BENCHMARKS.md`` holds every suite's table, the README block every target with pass/fail; ``write_all`` writes a
run's files (``bench.json``, ``BENCHMARKS.md``, the charts).

The document's schema is ``schema.py``, the text rows and summary ``summary.py``, the charts ``charts.py``.

Command line (renders a run's ``bench.json``; works on any machine, no GPU needed)::

    python -m leandiffusion.bench.report DIR/bench.json --markdown [--image-dir DIR]
    python -m leandiffusion.bench.report DIR/bench.json --write     # re-render BENCHMARKS.md and the charts
    python -m leandiffusion.bench.report DIR/bench.json --check     # schema check, exit 1 on errors
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Iterable

from .charts import CHART_FILES, chart_kinds, write_charts
from .schema import lint, load, normalise_record, validate
from .summary import counts, error_headline, fmt, summary_lines, truncate, verdict

MEMORY_NOTE = ("Memory is the peak of `torch.cuda.max_memory_reserved()` after `reset_peak_memory_stats()` unless "
               "the metric says `allocated`; the CUDA context (outside the caching allocator) is excluded. Memory "
               "figures labelled GB are GiB (2^30 bytes), the unit of the loader's `vram_budget_gb`; bandwidths "
               "(GB/s) are decimal.")
RATIO_NOTE = ("Ratio = how many times better ours is than the peer (peer/ours for times and memory, ours/peer for "
              "throughput); >1 means ours wins.")


# --------------------------------------------------------------------------------------------- markdown
def _md_escape(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _md_num(x, unit="") -> str:
    return "-" if x is None else f"{fmt(x)}{(' ' + unit) if unit else ''}"


def header_lines(doc: dict) -> list[str]:
    meta = doc.get("meta", {})
    v = meta.get("versions", {})
    vers = ", ".join(f"{k} {val}" for k, val in v.items() if val)
    return [f"Run {meta.get('date', '?')}, mode `{meta.get('mode', '?')}`, device **{meta.get('device', '?')}**.",
            f"Versions: {vers or '?'}.",
            f"Command: `{meta.get('command', '?')}`.",
            "", MEMORY_NOTE, RATIO_NOTE]


def record_table(recs: Iterable[dict], with_suite: bool = False) -> list[str]:
    cols = (["suite"] if with_suite else []) + ["case", "metric", "ours", "peer", "ratio", "target", "result", "notes"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in recs:
        peer = "-" if r.get("peer") is None else f"{_md_num(r['peer'], r.get('unit', ''))} ({_md_escape(r.get('peer_name', ''))})"
        cells = ([r["suite"]] if with_suite else []) + [
            _md_escape(r["case"]), _md_escape(r["metric"]), _md_num(r.get("ours"), r.get("unit", "")), peer,
            "-" if r.get("ratio") is None else f"{r['ratio']:.2f}x", _md_escape(r.get("target") or "-"),
            {"PASS": "**pass**", "FAIL": "**FAIL**", "-": "-"}[verdict(r)], _md_escape(r.get("notes", ""))]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def benchmarks_markdown(doc: dict, charts: Iterable[str] = ()) -> str:
    """The full BENCHMARKS.md: header, suite statuses, one table per suite, skipped cases, charts."""
    c = counts(doc)
    lines = ["# LeanDiffusion benchmarks", ""] + header_lines(doc) + [
        "", f"**{c['pass']} targets pass, {c['fail']} fail**, {c['records']} records.", ""]
    dups = lint(doc)
    if dups:
        lines += ["Ambiguous records (same suite, case and metric; see notes): " + "; ".join(dups) + ".", ""]
    lines += ["## Suites", "",
        "| suite | status | seconds | budget (s) | records | skipped | error |", "|---|---|---|---|---|---|---|"]
    for s in doc.get("suites", []):
        err = _md_escape(truncate(error_headline(s), 160))
        lines.append(f"| {s['suite']} | {s['status']} | {_md_num(s.get('seconds'))} | {_md_num(s.get('budget_s'))} | "
                     f"{s.get('records', '-')} | {len(s.get('skipped', []))} | {err} |")
    for s in doc.get("suites", []):
        recs = [r for r in doc.get("records", []) if r.get("suite") == s["suite"]]
        if not recs and not s.get("skipped") and not s.get("error"):
            continue
        lines += ["", f"## {s['suite']}", ""]
        if recs:
            lines += record_table(recs)
        for sk in s.get("skipped", []):
            lines.append(f"- skipped `{_md_escape(sk.get('case', '?'))}`: {_md_escape(sk.get('reason', ''))}")
        if s.get("error"):
            lines += ["", "```", s["error"].strip()[-2000:], "```"]
    charts = list(charts)
    if charts:
        lines += ["", "## Charts", ""] + [f"![{Path(c).stem}]({Path(c).name})" for c in charts]
    return "\n".join(lines) + "\n"


def readme_markdown(doc: dict, image_dir: str = "docs/bench") -> str:
    """The block the lead pastes into README.md: run facts, every target with pass/fail, chart links."""
    c = counts(doc)
    targeted = [r for r in doc.get("records", []) if r.get("passed") is not None]
    lines = ["<!-- generated by: python -m leandiffusion.bench.report bench.json --markdown -->"] + header_lines(doc)
    skipped = [(s["suite"], sk) for s in doc.get("suites", []) for sk in s.get("skipped", [])]
    headline = f"**{c['pass']} of {c['pass'] + c['fail']} targets pass.**"
    if skipped:  # a skipped case made no record, so it is in neither count: say so next to the count
        headline += (f" {len(skipped)} case(s) skipped (not measured, so neither passed nor failed; listed below "
                     f"the table).")
    lines += ["", headline, ""]
    lines += record_table(targeted, with_suite=True) if targeted else ["(no targeted records in this run)"]
    bad = [s for s in doc.get("suites", []) if s.get("status") in ("failed", "crashed", "timeout")]
    for s in bad:
        lines.append(f"- suite `{s['suite']}` {s['status']}: {_md_escape(error_headline(s))}")
    for name, sk in skipped:
        lines.append(f"- skipped `{name}/{_md_escape(sk.get('case', '?'))}`: {_md_escape(sk.get('reason', ''))}")
    kinds = chart_kinds(doc)
    if kinds:
        lines += [""] + [f"![{k}]({image_dir.rstrip('/')}/{CHART_FILES[k]})" for k in kinds]
    lines += ["", "Full tables: BENCHMARKS.md of the run; reproduce with `python -m leandiffusion.bench --quick --out DIR`."]
    return "\n".join(lines) + "\n"


def write_all(doc: dict, out_dir, charts: bool = True, backend: str = "auto") -> list[Path]:
    """Write bench.json, BENCHMARKS.md and (optionally) the charts into ``out_dir``; returns the paths."""
    from .harness import write_json, write_text_atomic

    out_dir = Path(out_dir)
    doc = dict(doc, records=[normalise_record(r) for r in doc.get("records", [])])
    write_json(doc, out_dir / "bench.json")
    chart_paths = write_charts(doc, out_dir, backend) if charts else [
        out_dir / CHART_FILES[k] for k in chart_kinds(doc) if (out_dir / CHART_FILES[k]).exists()]
    write_text_atomic(out_dir / "BENCHMARKS.md", benchmarks_markdown(doc, [p.name for p in chart_paths]))
    return [out_dir / "bench.json", out_dir / "BENCHMARKS.md", *chart_paths]


# --------------------------------------------------------------------------------------------- CLI
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m leandiffusion.bench.report", description=__doc__.split("\n")[0])
    ap.add_argument("bench_json", type=Path, help="a bench.json written by python -m leandiffusion.bench")
    ap.add_argument("--markdown", action="store_true", help="print the README.md block (targets, run facts, charts)")
    ap.add_argument("--image-dir", default="docs/bench", help="where README.md finds the chart PNGs (default docs/bench)")
    ap.add_argument("--write", action="store_true", help="re-render BENCHMARKS.md and the charts next to bench.json")
    ap.add_argument("--summary", action="store_true", help="print the compact text summary")
    ap.add_argument("--check", action="store_true", help="check the schema; exit 1 when a record is malformed")
    args = ap.parse_args(argv)
    if not args.bench_json.is_file():
        ap.error(f"bench_json={str(args.bench_json)!r} is not a file; pass the bench.json of a run")
    doc = load(args.bench_json)
    rc = 0
    if args.check:
        errors = validate(doc)
        for e in errors:
            print(f"schema: {e}")
        print(f"schema: {len(errors)} problem(s) in {len(doc.get('records', []))} records")
        rc = 1 if errors else 0
    if args.write:
        for p in write_all(doc, args.bench_json.parent):
            print(f"wrote {p}")
    if args.markdown:
        sys.stdout.write(readme_markdown(doc, args.image_dir))
    if args.summary or not (args.check or args.write or args.markdown):
        print("\n".join(summary_lines(doc)))
    return rc


if __name__ == "__main__":
    sys.exit(main())

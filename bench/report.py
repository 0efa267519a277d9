"""Benchmark report: the ``bench.json`` document, its schema check, text rows, Markdown tables and PNG charts.

``bench.json`` is one document::

    {"schema": 1, "meta": {date, mode, argv, device, versions, budget_s, ...},
     "suites": [{suite, status, error, seconds, budget_s, skipped: [{case, reason}], records: n}, ...],
     "records": [{suite, case, metric, ours, peer, peer_name, ratio, target, passed, pass, unit, device,
                  versions, notes}, ...]}

one record per measurement (``pass`` mirrors ``passed``: True / False, or null for a record without a target).
``ratio`` is how many times better ours is than the peer: ``peer/ours`` for times and memory, ``ours/peer`` for
throughput. Non-finite numbers are stored as null (strict JSON). ``load`` also accepts the bare list of records
that ``harness.write_json`` writes.

Command line (renders the latest run for README.md; works on any machine, no GPU needed)::

    python -m leandiffusion.bench.report DIR/bench.json --markdown [--image-dir docs/bench]
    python -m leandiffusion.bench.report DIR/bench.json --write     # re-render BENCHMARKS.md and the charts
    python -m leandiffusion.bench.report DIR/bench.json --check     # schema check, exit 1 on errors

Charts are drawn with matplotlib when it imports (its object API, no pyplot state), else with Pillow.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Iterable, Optional

SCHEMA_VERSION = 1
STATUSES = ("ok", "failed", "crashed", "timeout", "skipped", "running")
RECORD_KEYS = {"suite": str, "case": str, "metric": str, "peer_name": str, "target": str, "unit": str,
               "device": str, "versions": dict, "notes": str}
NUMBER_OR_NULL = ("ours", "peer", "ratio")
CHART_FILES = {"time": "time.png", "vram": "vram.png", "throughput": "throughput.png"}
MEMORY_NOTE = ("Memory is the peak of `torch.cuda.max_memory_reserved()` after `reset_peak_memory_stats()` unless "
               "the metric says `allocated`; the CUDA context (outside the caching allocator) is excluded. Memory "
               "figures labelled GB are GiB (2^30 bytes), the unit of the loader's `vram_budget_gb`; bandwidths "
               "(GB/s) are decimal.")
RATIO_NOTE = ("Ratio = how many times better ours is than the peer (peer/ours for times and memory, ours/peer for "
              "throughput); >1 means ours wins.")


# --------------------------------------------------------------------------------------------- schema
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


# --------------------------------------------------------------------------------------------- text
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


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 1, 1)] + "~"


ROW_HEADER = (f"{'name':<44} {'ours':>10} {'peer':>10} {'unit':<8} {'peer name':<16} {'ratio':>7} "
              f"{'target':<18} result")


def format_row(rec: dict) -> str:
    """One fixed-width table row: name, ours, peer, unit, peer name, ratio, target, pass/fail (~125 chars)."""
    name = _cut(f"{rec['suite']}/{rec['case']} {rec['metric']}", 44)
    ratio = "-" if rec.get("ratio") is None else f"{rec['ratio']:.2f}x"
    return (f"{name:<44} {_cut(fmt(rec.get('ours')), 10):>10} {_cut(fmt(rec.get('peer')), 10):>10} "
            f"{_cut(rec.get('unit') or '', 8):<8} {_cut(rec.get('peer_name') or '-', 16):<16} {ratio:>7} "
            f"{_cut(rec.get('target') or '-', 18):<18} {verdict(rec)}")


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
        extra = f" | {_cut(error_headline(s), 90)}" if s.get("error") else ""
        skipped = len(s.get("skipped", []))
        secs = "" if s.get("seconds") is None else f" {s['seconds']:.0f}s"
        lines.append(f"suite {s['suite']}: {s['status'].upper()}{secs}, {s.get('records', '?')} records"
                     f"{f', {skipped} skipped' if skipped else ''}{extra}")
    dups = lint(doc)
    if dups:
        lines.append(_cut(f"WARN {len(dups)} ambiguous key(s): " + "; ".join(dups), 240))
    c = counts(doc)
    bad = [s["suite"] for s in doc.get("suites", []) if s.get("status") in ("failed", "crashed", "timeout")]
    lines.append(f"TOTAL: {c['pass']} pass, {c['fail']} fail, {c['records']} records; suites failed: "
                 f"{', '.join(bad) if bad else 'none'}")
    return lines


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
        err = _md_escape(_cut(error_headline(s), 160))
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


# --------------------------------------------------------------------------------------------- charts
def chart_kind(rec: dict) -> Optional[str]:
    """Which chart a record belongs to: "time", "vram", "throughput" or None (ratios, errors, counts)."""
    unit = (rec.get("unit") or "").strip().lower()
    metric = rec.get("metric", "").lower()
    # iterations per second: "it_s" or "..._it_s" (not "wait_s", "init_s": those are times); checked before the
    # time rule because they end in "_s" too
    throughput = metric.endswith(("per_s", "_per_second", "_it_s", "_gbps")) or metric == "it_s"
    if unit.endswith("/s") or throughput:
        return "throughput"
    if unit in ("ms", "s", "us") or metric.endswith(("_ms", "_us", "_s")):
        return "time"
    if unit in ("gb", "gib", "mb", "mib") or any(k in metric for k in ("reserved", "allocated", "vram", "_gb")):
        return "vram"
    return None


def chart_kinds(doc: dict) -> list[str]:
    found = {chart_kind(r) for r in doc.get("records", []) if r.get("ours") is not None}
    return [k for k in CHART_FILES if k in found]


def chart_groups(doc: dict, kind: str) -> list[tuple[str, list[tuple[str, float, Optional[float], str, str]]]]:
    """Panels for one chart: [("suite [unit]", [(label, ours, peer, peer_name, unit), ...]), ...], record order."""
    panels: dict[str, list] = {}
    ambiguous = duplicate_keys(doc)
    for r in doc.get("records", []):
        if chart_kind(r) != kind or r.get("ours") is None:
            continue
        label = f"{r['case']} · {r['metric']}"
        if (r["suite"], r["case"], r["metric"]) in ambiguous and r.get("notes"):
            label += f" ({r['notes'].split(';')[0].strip()[:30]})"  # tell same-key records apart
        key = f"{r['suite']} [{r.get('unit') or r['metric']}]"  # one scale per suite and unit
        panels.setdefault(key, []).append((label, r["ours"], r.get("peer"), r.get("peer_name") or "", r.get("unit") or ""))
    return list(panels.items())


TITLES = {"time": "Time per case (lower is better)", "vram": "Peak VRAM per case (lower is better)",
          "throughput": "Throughput per case (higher is better)"}
OURS_COLOR = (46, 139, 87)
PEER_COLOR = (150, 150, 150)


def _render_matplotlib(panels, title: str, subtitle: str, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    heights = [max(len(items), 1) * 0.55 + 0.6 for _, items in panels]
    fig = Figure(figsize=(11, sum(heights) + 1.0), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, squeeze=False, gridspec_kw={"height_ratios": heights})[:, 0]
    ours_c = tuple(c / 255 for c in OURS_COLOR)
    peer_c = tuple(c / 255 for c in PEER_COLOR)
    for ax, (suite, items) in zip(axes, panels):
        n = len(items)
        ys = list(range(n))
        ax.barh([y - 0.2 for y in ys], [it[1] for it in items], height=0.38, color=ours_c, label="ours")
        peer_vals = [(y + 0.2, it[2]) for y, it in zip(ys, items) if it[2] is not None]
        if peer_vals:
            ax.barh([p[0] for p in peer_vals], [p[1] for p in peer_vals], height=0.38, color=peer_c, label="peer")
        top = max([it[1] for it in items] + [it[2] for it in items if it[2] is not None] + [1e-12])
        for y, it in zip(ys, items):
            ax.text(it[1] + top * 0.01, y - 0.2, f"{fmt(it[1])} {it[4]}", va="center", fontsize=7)
            if it[2] is not None:
                ax.text(it[2] + top * 0.01, y + 0.2, f"{fmt(it[2])} {it[4]} {it[3]}", va="center", fontsize=7)
        ax.set_yticks(ys)
        ax.set_yticklabels([it[0] for it in items], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, top * 1.35)
        ax.set_title(suite, fontsize=10, loc="left")
        ax.tick_params(axis="x", labelsize=7)
    axes[0].legend(loc="lower right", fontsize=8)
    fig.suptitle(f"{title}\n{subtitle}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)


def _font(size: int):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1 has only the fixed bitmap font
        return ImageFont.load_default()


def _render_pillow(panels, title: str, subtitle: str, path: Path) -> None:
    from PIL import Image, ImageDraw

    width, label_w, row_h, bar_h, pad = 1100, 380, 16, 7, 12
    value_w = 250
    bar_w = width - label_w - value_w - 2 * pad
    height = 60 + sum(28 + len(items) * row_h * 2 + 8 for _, items in panels) + 30
    img = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(img)
    f_title, f_text = _font(16), _font(11)
    draw.text((pad, 8), title, fill="black", font=f_title)
    draw.text((pad, 30), subtitle, fill=(80, 80, 80), font=f_text)
    y = 56
    for suite, items in panels:
        draw.text((pad, y), suite, fill="black", font=f_title)
        y += 24
        top = max([it[1] for it in items] + [it[2] for it in items if it[2] is not None] + [1e-12])
        for label, ours, peer, peer_name, unit in items:
            draw.text((pad, y + 2), _cut(label, 56), fill="black", font=f_text)
            for value, color, text in ((ours, OURS_COLOR, f"{fmt(ours)} {unit} ours"),
                                       (peer, PEER_COLOR, f"{fmt(peer)} {unit} {peer_name}")):
                if value is not None:
                    w = max(int(bar_w * max(value, 0) / top), 1)
                    draw.rectangle([label_w, y + 4, label_w + w, y + 4 + bar_h * 2 - 4], fill=color)
                    draw.text((label_w + w + 6, y + 1), _cut(text, 40), fill=(60, 60, 60), font=f_text)
                y += row_h
        y += 8
    draw.text((pad, height - 22), "green: ours, grey: peer; each panel has its own linear scale", fill=(80, 80, 80),
              font=f_text)
    img.save(path)


def write_charts(doc: dict, out_dir, backend: str = "auto") -> list[Path]:
    """Write one PNG per chart kind present in the records (see CHART_FILES); returns the paths written.

    ``backend``: "matplotlib", "pillow" or "auto" (matplotlib when it imports, else Pillow).
    """
    from .harness import replaced_atomically

    if backend not in ("auto", "matplotlib", "pillow"):
        raise ValueError(f"backend={backend!r}: expected 'auto', 'matplotlib' or 'pillow'")
    if backend == "auto":
        try:
            import matplotlib  # noqa: F401

            backend = "matplotlib"
        except ImportError:
            backend = "pillow"
    render = _render_matplotlib if backend == "matplotlib" else _render_pillow
    meta = doc.get("meta", {})
    subtitle = f"{meta.get('device', '?')} · torch {meta.get('versions', {}).get('torch')} · mode {meta.get('mode', '?')} · {meta.get('date', '')}"
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for kind in chart_kinds(doc):
        panels = chart_groups(doc, kind)
        path = out_dir / CHART_FILES[kind]
        with replaced_atomically(path) as tmp:  # a drawing error never leaves a broken chart over the last good one
            render(panels, TITLES[kind], subtitle, tmp)
        written.append(path)
    return written


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

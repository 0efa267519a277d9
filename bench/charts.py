"""PNG charts of a ``bench.json`` document: one chart per kind (time, VRAM, throughput), one panel per suite and
unit, ours beside the peer.

Drawn with matplotlib when it imports (its object API, no pyplot state), else with Pillow.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from .schema import duplicate_keys
from .summary import fmt, truncate

CHART_FILES = {"time": "time.png", "vram": "vram.png", "throughput": "throughput.png"}


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
            draw.text((pad, y + 2), truncate(label, 56), fill="black", font=f_text)
            for value, color, text in ((ours, OURS_COLOR, f"{fmt(ours)} {unit} ours"),
                                       (peer, PEER_COLOR, f"{fmt(peer)} {unit} {peer_name}")):
                if value is not None:
                    w = max(int(bar_w * max(value, 0) / top), 1)
                    draw.rectangle([label_w, y + 4, label_w + w, y + 4 + bar_h * 2 - 4], fill=color)
                    draw.text((label_w + w + 6, y + 1), truncate(text, 40), fill=(60, 60, 60), font=f_text)
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

"""Workflow thumbnails: a diagram of the graph (node boxes on the workflow's column/row grid, typed links as curves,
the LeanDiffusion name and the workflow's title), drawn with Pillow's bundled font so the JPEG bytes depend only on
the declaration and the Pillow version. Link colours follow ComfyUI's editor (LATENT pink, IMAGE blue, ...).
"""
from __future__ import annotations

import io

from PIL import Image, ImageDraw, ImageFont

W, H = 640, 400
BG, HEADER, TEXT, SUBTEXT = (24, 26, 30), (36, 40, 46), (236, 238, 240), (170, 178, 186)
ACCENT = (72, 200, 170)
PACK_FILL, PACK_EDGE = (34, 78, 76), (72, 200, 170)
CORE_FILL, CORE_EDGE = (52, 55, 60), (120, 126, 134)
LINK_COLORS = {"LEAN_MODEL": (179, 157, 219), "LATENT": (255, 156, 249), "IMAGE": (100, 181, 246),
               "CONDITIONING": (255, 169, 49), "CLIP": (255, 213, 0), "VAE": (255, 110, 110)}


def _font(size: int):
    return ImageFont.load_default(size=size)


def _fit(draw, text: str, font, width: int) -> str:
    if draw.textlength(text, font=font) <= width:
        return text
    while text and draw.textlength(text + "...", font=font) > width:
        text = text[:-1]
    return text.rstrip() + "..."


def _wrap(draw, text: str, font, width: int, lines: int = 2) -> list[str]:
    """Greedy word wrap into at most ``lines`` lines; the last one is cut with '...' when the text is longer."""
    words, out, line = text.split(), [], ""
    for i, word in enumerate(words):
        trial = f"{line} {word}".strip()
        if draw.textlength(trial, font=font) <= width or not line:
            line = trial
            continue
        out.append(line)
        line = word
        if len(out) == lines - 1:
            line = " ".join(words[i:])
            break
    out.append(line)
    return [_fit(draw, s, font, width) for s in out[:lines]]


def _subtitle(node, specs) -> str:
    v = node.values
    t = node.type
    if t == "LeanModelLoader":
        budget = f" {v['vram_budget_gb']:g} GB" if v["vram_policy"] == "stream" else ""
        return f"{v['model']} | {v['vram_policy']}{budget}"
    if t == "LeanFusedDDIMSampler":
        extra = f" | denoise {v['denoise']:g}" if v.get("denoise", 1.0) < 1.0 else f" | {v['width']}x{v['height']}"
        return f"{v['steps']} steps | cfg {v['cfg']:g}{extra} | {v['acceleration']}"
    if t == "LeanStreamSampler":
        n = len([p for p in v["prompts"].splitlines() if p.strip()])
        return f"{n} prompts x {v['images_per_prompt']} | {v['steps']} steps | {v['acceleration']}"
    if t == "LeanLoraInjector":
        return f"{v['lora_name']} | {v['strength']:g} | {v['target_blocks'] or 'all blocks'}"
    if t in ("LeanTiledVAEDecode", "LeanTiledVAEEncode"):
        return f"tile {v['tile_size'] or 'auto'} | {v['seam_mode']}"
    if t == "LeanESRGANUpscale":
        return f"{v['model_name']} | {'x' + format(v['output_scale'], 'g') if v['output_scale'] else 'native'}"
    if t == "SaveImage":
        return v["filename_prefix"]
    if t == "LoadImage":
        return v["image"]
    if t == "CLIPTextEncode":
        return v["text"]
    if t == "CLIPLoader":
        return v["clip_name"]
    return ""


def _bezier(p0, p1, p2, p3, n=32):
    pts = []
    for i in range(n + 1):
        s = i / n
        a, b, c, d = (1 - s) ** 3, 3 * (1 - s) ** 2 * s, 3 * (1 - s) * s ** 2, s ** 3
        pts.append((a * p0[0] + b * p1[0] + c * p2[0] + d * p3[0], a * p0[1] + b * p1[1] + c * p2[1] + d * p3[1]))
    return pts


def thumbnail(wf, specs) -> bytes:
    """JPEG bytes of ``wf``'s diagram (``wf``: a ``make_workflows.W``; ``specs``: object_info)."""
    img = Image.new("RGB", (W, H), BG)
    draw = ImageDraw.Draw(img)
    draw.rectangle([0, 0, W, 62], fill=HEADER)
    draw.text((20, 10), "LeanDiffusion", font=_font(22), fill=ACCENT)
    draw.text((20, 38), _fit(draw, wf.title, _font(15), W - 40), font=_font(15), fill=TEXT)
    cols = sorted({n.col for n in wf.nodes})
    gap = 22
    box_w = min(180, (W - 40 - gap * (len(cols) - 1)) // len(cols))
    total_w = box_w * len(cols) + gap * (len(cols) - 1)
    x0 = (W - total_w) // 2
    box_h, vgap, top, bottom = 84, 22, 82, H - 16
    boxes, by_id = {}, {n.id: n for n in wf.nodes}
    for ci, c in enumerate(cols):
        members = sorted((n for n in wf.nodes if n.col == c), key=lambda n: n.row)
        height = len(members) * box_h + (len(members) - 1) * vgap
        y = top + (bottom - top - height) // 2
        for n in members:
            boxes[n.id] = (x0 + ci * (box_w + gap), y, x0 + ci * (box_w + gap) + box_w, y + box_h)
            y += box_h + vgap
    # links under the boxes
    for n in wf.nodes:
        for name, (src, slot) in n.links.items():
            conf = None
            for section in ("required", "optional"):
                conf = conf or (specs[n.type]["input"].get(section) or {}).get(name)
            color = LINK_COLORS.get(conf[0] if conf else "", (200, 200, 200))
            a, b = boxes[src], boxes[n.id]
            outs = len(specs[by_id[src].type].get("output") or [1])
            start = (a[2], a[1] + box_h * ((slot + 1) / (outs + 1) if outs > 1 else 0.5))
            end = (b[0], b[1] + box_h / 2)
            if end[0] <= start[0]:  # same column: go down the right edge
                start, end = (a[0] + box_w / 2, a[3]), (b[0] + box_w / 2, b[1])
                pts = [start, end]
            else:
                dx = max(30, (end[0] - start[0]) / 2)
                pts = _bezier(start, (start[0] + dx, start[1]), (end[0] - dx, end[1]), end)
            draw.line(pts, fill=color, width=3, joint="curve")
            ex, ey = end
            if pts[-1][1] != pts[-2][1] and pts[-1][0] == pts[-2][0]:
                draw.polygon([(ex - 6, ey - 9), (ex + 6, ey - 9), (ex, ey)], fill=color)
            else:
                draw.polygon([(ex - 9, ey - 6), (ex - 9, ey + 6), (ex, ey)], fill=color)
    title_font, sub_font = _font(13), _font(11)
    for n in wf.nodes:
        x1, y1, x2, y2 = boxes[n.id]
        pack = n.type.startswith("Lean")
        draw.rounded_rectangle([x1, y1, x2, y2], radius=8, fill=PACK_FILL if pack else CORE_FILL,
                               outline=PACK_EDGE if pack else CORE_EDGE, width=2)
        title = n.title or specs[n.type].get("display_name") or n.type
        y = y1 + 8
        for line in _wrap(draw, title, title_font, box_w - 16):
            draw.text((x1 + 8, y), line, font=title_font, fill=TEXT)
            y += 16
        y = max(y + 4, y1 + 44)
        for line in _wrap(draw, _subtitle(n, specs), sub_font, box_w - 16):
            draw.text((x1 + 8, y), line, font=sub_font, fill=SUBTEXT)
            y += 14
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90, optimize=False, progressive=False, subsampling=0)
    return buf.getvalue()


def icon(size: int = 400) -> bytes:
    """PNG bytes of the pack's registry icon: three stacked blocks (a streamed model) over the name."""
    img = Image.new("RGB", (size, size), BG)
    draw = ImageDraw.Draw(img)
    s = size / 400
    for i, color in enumerate((PACK_FILL, (46, 120, 112), ACCENT)):
        y = (70 + i * 62) * s
        draw.rounded_rectangle([(90 + i * 22) * s, y, (310 - i * 22) * s, y + 48 * s], radius=int(10 * s),
                               fill=color, outline=PACK_EDGE, width=max(1, int(3 * s)))
    font = _font(int(44 * s))
    text = "LeanDiffusion"
    draw.text(((size - draw.textlength(text, font=font)) / 2, 290 * s), text, font=font, fill=TEXT)
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=False)
    return buf.getvalue()

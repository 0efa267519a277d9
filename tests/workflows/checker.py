"""Static checks of a shipped workflow pair (editor ``NAME.json`` + API ``NAME.api.json``) against node specs.

``check_pair(ui, api, object_info, dynamic)`` returns a list of problems, one readable line each (empty = fine):
- every node type exists in ``object_info`` (the pack's nodes + ComfyUI core); editor-only nodes (Note, Reroute,
  PrimitiveNode) are skipped;
- every input a node names (editor socket or API key) is one the node declares, and every required input is given;
- every link joins an output to an input of the same declared type, and the editor's link records, node sockets and
  output link lists agree with each other;
- every literal value has its input's type, lies within min/max, and, for a COMBO with a fixed option list, is one
  of the options (COMBOs in ``dynamic``, which list model or input files, take any string);
- ``widgets_values`` has exactly one value per widget (plus the editor's ``control_after_generate`` value after a
  seed and the upload-button value after LoadImage's image);
- the editor workflow converted by the runner's converter (``runner.convert.ui_to_api``, the editor's own rules)
  equals the API twin, ``_meta`` aside.
Problems name the node id, its type and the input, e.g. ``node 5 (LeanStreamSampler): unknown node type``.
"""
from __future__ import annotations

from typing import Any

from leandiffusion.runner.convert import UI_ONLY_TYPES, input_names, ui_to_api, widget_slots
from leandiffusion.runner.errors import WorkflowError

SCALARS = {"INT": (int,), "FLOAT": (int, float), "STRING": (str,), "BOOLEAN": (bool,)}


def _conf(spec: dict, name: str) -> tuple[Any, dict, bool] | None:
    """(type or option list, options dict, required) of input ``name``, or None when undeclared."""
    for section in ("required", "optional"):
        conf = (spec.get("input", {}).get(section) or {}).get(name)
        if conf is not None:
            typ = conf[0]
            opts = conf[1] if len(conf) > 1 and isinstance(conf[1], dict) else {}
            if typ == "COMBO":
                typ = list(opts.get("options") or [])
            return typ, opts, section == "required"
    return None


def _declared(spec: dict) -> str:
    return ", ".join(input_names(spec)) or "none"


def _link_type(typ: Any) -> str:
    return "COMBO" if isinstance(typ, list) else str(typ)


def _check_value(where: str, value: Any, typ: Any, opts: dict, dynamic: bool) -> list[str]:
    if isinstance(typ, list):
        if not isinstance(value, str):
            return [f"{where} = {value!r} is not a string option"]
        if not dynamic and value not in typ:
            return [f"{where} = {value!r} is not one of its options {typ}"]
        return []
    kinds = SCALARS.get(typ)
    if kinds is None:
        return [f"{where} has type {typ}, which needs a link, but is given the literal {value!r}"]
    if isinstance(value, bool) and typ != "BOOLEAN" or not isinstance(value, kinds):
        return [f"{where} = {value!r} is not a valid {typ} value"]
    problems = []
    if typ in ("INT", "FLOAT"):
        if "min" in opts and value < opts["min"]:
            problems.append(f"{where} = {value!r} is below its minimum {opts['min']}")
        if "max" in opts and value > opts["max"]:
            problems.append(f"{where} = {value!r} is above its maximum {opts['max']}")
    return problems


# --------------------------------------------------------------------------------------------- API format
def check_api(api: dict, object_info: dict, dynamic: set) -> list[str]:
    problems = []
    for nid, node in sorted(api.items()):
        ctype = node.get("class_type")
        spec = object_info.get(ctype)
        label = f"node {nid} ({ctype})"
        if spec is None:
            problems.append(f"{label}: unknown node type; neither the pack nor ComfyUI core declares it")
            continue
        inputs = node.get("inputs") or {}
        for name, value in inputs.items():
            conf = _conf(spec, name)
            if conf is None:
                problems.append(f"{label}: input '{name}' is not declared by the node (its inputs: {_declared(spec)})")
                continue
            typ, opts, _ = conf
            if isinstance(value, list) and len(value) == 2 and isinstance(value[0], str):
                src = api.get(value[0])
                src_spec = object_info.get((src or {}).get("class_type"))
                if src is None:
                    problems.append(f"{label}: input '{name}' is linked to node {value[0]}, which does not exist")
                elif src_spec is not None:
                    outs = src_spec.get("output") or []
                    if not isinstance(value[1], int) or not 0 <= value[1] < len(outs):
                        problems.append(f"{label}: input '{name}' uses output {value[1]} of node {value[0]} "
                                        f"({src['class_type']}), which has {len(outs)} outputs")
                    elif _link_type(outs[value[1]]) != _link_type(typ) and "*" not in (outs[value[1]], typ):
                        problems.append(f"{label}: input '{name}' expects {_link_type(typ)} but is linked to "
                                        f"output {value[1]} of node {value[0]} ({src['class_type']}), which is "
                                        f"{outs[value[1]]}")
            else:
                problems += _check_value(f"{label}: input '{name}'", value, typ, opts, (ctype, name) in dynamic)
        for name in input_names(spec):
            if _conf(spec, name)[2] and name not in inputs:
                problems.append(f"{label}: required input '{name}' is missing")
    return problems


# --------------------------------------------------------------------------------------------- editor format
def _check_widgets(label: str, node: dict, spec: dict, dynamic: set) -> list[str]:
    values = node.get("widgets_values")
    values = [] if values is None else values
    if not isinstance(values, list):
        return [f"{label}: widgets_values must be a list"]
    expected = sum(1 + int(control) + int(upload) for _, control, upload in widget_slots(spec))
    if len(values) != expected:
        names = ", ".join(n + (" (+control_after_generate)" if c else "") + (" (+upload)" if u else "")
                          for n, c, u in widget_slots(spec))
        return [f"{label}: widgets_values has {len(values)} values, the node's widgets need {expected}: {names}"]
    problems, i = [], 0
    for name, control, upload in widget_slots(spec):
        typ, opts, _ = _conf(spec, name)
        problems += _check_value(f"{label}: widget '{name}'", values[i], typ, opts, (node["type"], name) in dynamic)
        i += 1
        if control:
            if values[i] not in ("fixed", "increment", "decrement", "randomize"):
                problems.append(f"{label}: the value after '{name}' must be its control_after_generate mode, "
                                f"got {values[i]!r}")
            i += 1
        if upload:
            i += 1
    return problems


def check_ui(ui: dict, object_info: dict, dynamic: set) -> list[str]:
    problems = []
    nodes = {n.get("id"): n for n in ui.get("nodes") or []}
    links = {}
    for rec in ui.get("links") or []:
        if not isinstance(rec, list) or len(rec) != 6:
            problems.append(f"link record {rec!r} is not [id, origin, origin_slot, target, target_slot, type]")
            continue
        links[rec[0]] = rec
    for nid, node in sorted(nodes.items()):
        ntype = node.get("type")
        label = f"node {nid} ({ntype})"
        if ntype in UI_ONLY_TYPES:
            continue
        spec = object_info.get(ntype)
        if spec is None:
            problems.append(f"{label}: unknown node type; neither the pack nor ComfyUI core declares it")
            continue
        problems += _check_widgets(label, node, spec, dynamic)
        linked = set()
        for slot, inp in enumerate(node.get("inputs") or []):
            name = (inp.get("widget") or {}).get("name") or inp.get("name")
            conf = _conf(spec, name)
            if conf is None:
                problems.append(f"{label}: input '{name}' is not declared by the node (its inputs: {_declared(spec)})")
                continue
            if inp.get("type") != _link_type(conf[0]) and not (isinstance(conf[0], list) and inp.get("widget")):
                problems.append(f"{label}: input '{name}' is typed {inp.get('type')} in the editor file, the node "
                                f"declares {_link_type(conf[0])}")
            if inp.get("link") is not None:
                linked.add(name)
                rec = links.get(inp["link"])
                if rec is None or rec[3] != nid or rec[4] != slot:
                    problems.append(f"{label}: input '{name}' names link {inp['link']}, whose record does not end "
                                    f"at this node's input slot {slot}")
        for name in input_names(spec):
            typ, _, required = _conf(spec, name)
            is_widget = any(name == w for w, _, _ in widget_slots(spec))
            if required and not is_widget and name not in linked:
                problems.append(f"{label}: required input '{name}' is not linked")
        outs = spec.get("output") or []
        for slot, out in enumerate(node.get("outputs") or []):
            if slot >= len(outs):
                problems.append(f"{label}: output slot {slot} does not exist (the node has {len(outs)} outputs)")
            elif out.get("type") != outs[slot]:
                problems.append(f"{label}: output {slot} is typed {out.get('type')} in the editor file, the node "
                                f"declares {outs[slot]}")
            for link_id in out.get("links") or []:
                rec = links.get(link_id)
                if rec is None or rec[1] != nid or rec[2] != slot:
                    problems.append(f"{label}: output {slot} lists link {link_id}, whose record does not start here")
    for lid, (_, origin, oslot, target, tslot, ltype) in sorted(links.items()):
        src, dst = nodes.get(origin), nodes.get(target)
        if src is None or dst is None:
            problems.append(f"link {lid}: node {origin if src is None else target} does not exist")
            continue
        src_spec, dst_spec = object_info.get(src.get("type")), object_info.get(dst.get("type"))
        if src_spec is None or dst_spec is None:
            continue  # reported above as an unknown node type
        outs, ins = src_spec.get("output") or [], dst.get("inputs") or []
        if oslot >= len(outs) or tslot >= len(ins):
            problems.append(f"link {lid}: slot out of range (node {origin} output {oslot}, node {target} input {tslot})")
            continue
        name = (ins[tslot].get("widget") or {}).get("name") or ins[tslot].get("name")
        conf = _conf(dst_spec, name)
        if conf is None:
            continue  # reported above as an undeclared input
        declared_in = _link_type(conf[0])
        if not (outs[oslot] == declared_in == ltype) and "*" not in (outs[oslot], declared_in):
            problems.append(f"link {lid}: node {origin} ({src['type']}) output {oslot} is {outs[oslot]}, node "
                            f"{target} ({dst['type']}) input '{name}' expects {declared_in}, the link says {ltype}")
        if lid not in (src.get("outputs") or [{}] * (oslot + 1))[oslot].get("links") or []:
            problems.append(f"link {lid}: node {origin} output {oslot} does not list it in its 'links'")
    return problems


# --------------------------------------------------------------------------------------------- both
def strip_meta(prompt: dict) -> dict:
    return {nid: {k: v for k, v in node.items() if k != "_meta"} for nid, node in prompt.items()}


def check_pair(ui: dict, api: dict, object_info: dict, dynamic: set) -> list[str]:
    problems = [f"editor file: {p}" for p in check_ui(ui, object_info, dynamic)]
    problems += [f"API file: {p}" for p in check_api(api, object_info, dynamic)]
    try:
        converted = strip_meta(ui_to_api(ui, object_info))
    except WorkflowError as exc:
        return problems + [f"editor file does not convert: {p}" for p in (exc.args[1] if len(exc.args) > 1
                                                                           else [str(exc)])]
    twin = strip_meta(api)
    for nid in sorted(set(converted) | set(twin)):
        a, b = converted.get(nid), twin.get(nid)
        if a is None or b is None:
            problems.append(f"node {nid} is only in the {'API' if a is None else 'editor'} file")
        elif a != b:
            keys = sorted(k for k in set(a.get("inputs", {})) | set(b.get("inputs", {}))
                          if a.get("inputs", {}).get(k, "<absent>") != b.get("inputs", {}).get(k, "<absent>"))
            detail = ", ".join(f"'{k}': editor {a['inputs'].get(k, '<absent>')!r} vs API "
                               f"{b['inputs'].get(k, '<absent>')!r}" for k in keys)
            if a.get("class_type") != b.get("class_type"):
                detail = f"type {a.get('class_type')} vs {b.get('class_type')}"
            problems.append(f"node {nid} differs between the editor and API files: {detail}")
    return problems

"""Workflow formats: detect API vs UI format, convert UI (litegraph) workflows to API prompts, apply ``--set``.

Invariant: ``ui_to_api(workflow, object_info)`` returns the prompt ComfyUI's editor would queue for the same graph
(its "graphToPrompt"): node ids become string keys, every linked input becomes ``[origin_id, origin_slot]`` and every
widget value becomes a literal input.

How a UI node's ``widgets_values`` list maps onto input names (the editor serialises its widgets in creation order):
- the widgets are the node's inputs, required then optional in ``/object_info``'s ``input_order``, whose type is
  INT, FLOAT, STRING, BOOLEAN or a COMBO (a list of options, or ``"COMBO"``), unless the input is ``forceInput``;
- an INT or COMBO widget with ``control_after_generate`` (implicitly every INT named ``seed`` / ``noise_seed``) is
  followed by one UI-only value (``fixed``/``increment``/``decrement``/``randomize``, or a bool in old files);
- a COMBO with an ``*_upload`` flag (LoadImage) is followed by the UI-only upload button value (``image`` ...).
A UI-only value is skipped only where the spec announces it AND the value looks like one (files saved by editors
that did not write it still map).
A dict ``widgets_values`` (some packs) maps by name.

Graph rules, as the editor applies them (frontend 1.27 ``graphToPrompt``, ``ExecutableNodeDTO.resolveInput`` /
``resolveOutput``; checked against the real editor by ``tests/integration/test_frontend.py``):
- every queued node starts from its widget values; a linked input is then resolved upstream and, when it reaches a
  node's output, overrides the widget value (a "converted widget");
- a bypassed node (mode 4) passes on one of its inputs: the one at the output's slot index when its type fits, else
  the first of exactly the wanted type, else the first that fits, in the editor's socket order (``editor_sockets``);
- a ``Reroute`` passes on its input, whatever its mode; a ``PrimitiveNode``, whatever its mode, copies its value
  into the widget of every input its output is linked to directly;
- an input that resolves to nothing (a bypass without a fitting input, or a fitting one that is unlinked, a reroute
  without input) keeps its widget value; an input that reaches a muted node (mode 2) is deleted;
- muted and bypassed nodes, ``Reroute``, ``PrimitiveNode``, ``Note`` and ``MarkdownNote`` are not queued; any other
  type missing from ``/object_info`` is an error naming the node.
Subgraphs (the editor's ``definitions.subgraphs``) and group nodes (``extra.groupNodes``) are not expanded: such files
must be exported in API format.

Why hand-written: the conversion is done by ComfyUI's TypeScript frontend (``graphToPrompt``); no well-kept Python
library provides it, and the runner must queue UI-format files headless.
"""
from __future__ import annotations

import json
from typing import Any, Iterable

from .errors import WorkflowError
from .wellformed import MAX_DEPTH, check_depth, check_ui_nodes, short_repr, check_prompt

WIDGET_TYPES = frozenset({"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"})
CONTROL_VALUES = frozenset({"fixed", "increment", "decrement", "randomize"})
UPLOAD_FLAGS = ("image_upload", "video_upload", "animated_image_upload", "audio_upload", "upload")
UPLOAD_VALUES = frozenset({"image", "video", "audio"})
UI_ONLY_TYPES = frozenset({"Note", "MarkdownNote", "Reroute", "PrimitiveNode"})
MODE_MUTED = 2
MODE_BYPASS = 4


# --------------------------------------------------------------------------------------------- formats
def is_api_prompt(data: Any) -> bool:
    """True for an API-format prompt: ``{node_id: {"class_type": ..., "inputs": {...}}, ...}``."""
    return (isinstance(data, dict) and bool(data)
            and all(isinstance(v, dict) and "class_type" in v for v in data.values()))


def is_ui_workflow(data: Any) -> bool:
    """True for an editor (litegraph) workflow: a dict with a ``nodes`` list."""
    return isinstance(data, dict) and isinstance(data.get("nodes"), list)


def load_workflow(text: str, source: str = "workflow") -> tuple[str, dict]:
    """Parse ``text``; return ``("api", prompt)`` or ``("ui", workflow)``. Raises ``WorkflowError`` otherwise."""
    try:
        data = json.loads(text)
    except RecursionError as exc:
        raise WorkflowError(f"{source} nests JSON deeper than {MAX_DEPTH} levels; no workflow does, so it is not "
                            f"one: export it again from ComfyUI") from exc
    except ValueError as exc:
        raise WorkflowError(f"{source} is not valid JSON: {exc}") from exc
    check_depth(data, source)
    if isinstance(data, dict) and is_api_prompt(data.get("prompt")):
        data = data["prompt"]  # a saved POST /prompt body
    if is_api_prompt(data):
        check_prompt(data, source)
        return "api", data
    if is_ui_workflow(data):
        return "ui", data
    raise WorkflowError(
        f"{source} is neither an API-format prompt (an object of nodes with 'class_type' and 'inputs') nor an "
        f"editor workflow (an object with a 'nodes' list); export it from ComfyUI with 'Save' or 'Export (API)'")


# --------------------------------------------------------------------------------------------- widgets
def _input_spec(conf: Any) -> tuple[Any, dict]:
    if not isinstance(conf, (list, tuple)) or not conf:
        return None, {}
    opts = conf[1] if len(conf) > 1 and isinstance(conf[1], dict) else {}
    return conf[0], opts


def _is_combo(typ: Any) -> bool:
    return isinstance(typ, list) or typ == "COMBO"


def input_names(spec: dict) -> list[str]:
    """Every declared (required + optional) input name of an ``/object_info`` node spec, in declared order."""
    order = spec.get("input_order") or {}
    sections = spec.get("input") or {}
    names: list[str] = []
    for section in ("required", "optional"):
        declared = sections.get(section) or {}
        names.extend(n for n in (order.get(section) or list(declared)) if n in declared)
    return names


def widget_slots(spec: dict) -> list[tuple[str, bool, bool]]:
    """``(input name, has a control_after_generate value, has an upload button value)`` per widget, in UI order."""
    sections = spec.get("input") or {}
    slots = []
    for name in input_names(spec):
        conf = (sections.get("required") or {}).get(name, (sections.get("optional") or {}).get(name))
        typ, opts = _input_spec(conf)
        if not (_is_combo(typ) or typ in WIDGET_TYPES) or opts.get("forceInput"):
            continue
        control = bool(opts.get("control_after_generate", typ == "INT" and name in ("seed", "noise_seed")))
        upload = _is_combo(typ) and any(opts.get(flag) for flag in UPLOAD_FLAGS)
        slots.append((name, control, upload))
    return slots


def _is_control_value(value: Any) -> bool:
    return isinstance(value, bool) or (isinstance(value, str) and value in CONTROL_VALUES)


def widget_inputs(node: dict, spec: dict) -> dict[str, Any]:
    """The literal inputs a UI node's ``widgets_values`` give, keyed by input name."""
    values = node.get("widgets_values")
    slots = widget_slots(spec)
    if isinstance(values, dict):
        names = {name for name, _, _ in slots}
        return {k: v for k, v in values.items() if k in names}
    if not isinstance(values, list):
        return {}
    out: dict[str, Any] = {}
    i = 0
    for name, control, upload in slots:
        if i >= len(values):
            break
        out[name] = values[i]
        i += 1
        if control and i < len(values) and _is_control_value(values[i]):
            i += 1  # the editor's control_after_generate value
        elif upload and i < len(values) and isinstance(values[i], str) and values[i] in UPLOAD_VALUES:
            i += 1  # the upload button's value
    return out


# --------------------------------------------------------------------------------------------- graph
def _link_table(workflow: dict) -> dict[int, tuple[Any, int, Any, int, Any]]:
    """link id -> (origin id, origin slot, target id, target slot, type); accepts list and dict link records."""
    table = {}
    for link in workflow.get("links") or []:
        if isinstance(link, dict):
            rec = (link.get("id"), link.get("origin_id"), link.get("origin_slot"), link.get("target_id"),
                   link.get("target_slot"), link.get("type"))
        elif isinstance(link, (list, tuple)) and len(link) >= 5:
            rec = tuple(link[:6]) if len(link) >= 6 else tuple(link[:5]) + (None,)
        else:
            raise WorkflowError(f"workflow link {link!r} is not a link record [id, origin, slot, target, slot, type]")
        try:
            table[int(rec[0])] = (rec[1], int(rec[2]), rec[3], int(rec[4]), rec[5])
        except (TypeError, ValueError) as exc:
            raise WorkflowError(f"workflow link {short_repr(link)}: its id and slots must be integers (id, origin "
                                f"slot, target slot); save the workflow again from ComfyUI") from exc
    return table


def types_fit(a: Any, b: Any) -> bool:
    """The editor's ``LiteGraph.isValidConnection``: equal, either is ``*`` or empty, or comma lists sharing a type
    (case-insensitive)."""
    a = 0 if a in ("", "*", None) else a
    b = 0 if b in ("", "*", None) else b
    if not a or not b or a == b:
        return True
    a, b = str(a).lower(), str(b).lower()
    if "," not in a and "," not in b:
        return a == b
    return any(types_fit(x, y) for x in a.split(",") for y in b.split(","))


def editor_sockets(node: dict, spec: dict | None) -> list[dict]:
    """A node's input sockets in the order the editor holds them once loaded, the order its slot indices refer to:
    the declared inputs without a widget (declared order), then the widget inputs, then sockets only the file has.
    Each is the file's socket of that name (with its link) or, where the file does not list it, an unlinked one."""
    listed = node.get("inputs") or []
    if spec is None:
        return list(listed)
    by_name = {(inp.get("widget") or {}).get("name") or inp.get("name"): inp for inp in listed}
    sections = spec.get("input") or {}
    widgets = {name for name, _, _ in widget_slots(spec)}
    names = input_names(spec)
    sockets = []
    for name in [n for n in names if n not in widgets] + [n for n in names if n in widgets]:
        typ = _input_spec((sections.get("required") or {}).get(name, (sections.get("optional") or {}).get(name)))[0]
        sockets.append(by_name.get(name) or {"name": name, "type": "COMBO" if _is_combo(typ) else typ, "link": None})
    return sockets + [inp for name, inp in by_name.items() if name not in names]


class _Graph:
    """The editor's link resolution (frontend ``ExecutableNodeDTO.resolveInput`` / ``resolveOutput``)."""

    def __init__(self, workflow: dict, object_info: dict):
        self.nodes = {str(n.get("id")): n for n in workflow["nodes"]}  # entries checked by check_ui_nodes
        self.links = _link_table(workflow)
        self.object_info = object_info

    def link(self, link_id: Any, where: str) -> tuple[str, int]:
        try:
            origin, slot, _, _, _ = self.links[int(link_id)]
        except (KeyError, TypeError, ValueError) as exc:
            raise WorkflowError(f"{where} uses link {link_id!r}, which the workflow's 'links' list does not define") from exc
        return str(origin), slot

    def resolve(self, link_id: Any, typ: Any, where: str) -> tuple[str, int] | None:
        """The output an input of type ``typ`` on link ``link_id`` reads, ``(node id, slot)``, or ``None`` when it
        resolves to nothing (the input then keeps its widget value). A muted origin is returned like any other.
        A loop, not recursion: a chain of thousands of reroutes must not end in a ``RecursionError``."""
        seen: set[tuple[str, int]] = set()
        while True:
            origin, slot = self.link(link_id, where)
            node = self.nodes.get(origin)
            if node is None:
                raise WorkflowError(f"{where} is linked to node {origin}, which the workflow does not contain")
            if (origin, slot) in seen:
                raise WorkflowError(f"{where}: the links form a cycle through reroute/bypassed nodes")
            seen.add((origin, slot))
            if node.get("mode", 0) == MODE_BYPASS:
                sockets = editor_sockets(node, self.object_info.get(node.get("type")))
                index = self._bypass_index(node, sockets, slot, typ)
                if index < 0 or sockets[index].get("link") is None:
                    return None
                link_id, typ = sockets[index]["link"], sockets[index].get("type")
            elif node.get("type") in UI_ONLY_TYPES:  # virtual: passes on its input at that slot, whatever its mode
                sockets = node.get("inputs") or []
                if not (0 <= slot < len(sockets) and sockets[slot].get("link") is not None):
                    return None
                link_id = sockets[slot]["link"]
            else:
                return origin, slot

    def _bypass_index(self, node: dict, sockets: list[dict], slot: int, typ: Any) -> int:
        """The input a bypassed node passes on for its output ``slot`` (frontend ``getBypassSlotIndex``), or -1."""
        if typ in ("*", ""):
            return slot if len(sockets) > slot else 0
        spec = self.object_info.get(node.get("type")) or {}
        outputs = spec.get("output") or [out.get("type") for out in node.get("outputs") or []]
        out_type = outputs[slot] if slot < len(outputs) else None
        fits = [types_fit(inp.get("type"), out_type) and types_fit(inp.get("type"), typ) for inp in sockets]
        if slot < len(sockets) and fits[slot]:
            return slot
        exact = [i for i, inp in enumerate(sockets) if inp.get("type") == typ]
        return exact[0] if exact else next((i for i, ok in enumerate(fits) if ok), -1)

    def primitive_values(self) -> dict[str, dict[str, Any]]:
        """node id -> {widget name: value} that PrimitiveNodes copy into the widgets their output links reach
        directly (frontend ``PrimitiveNode.applyToGraph``, run for every primitive whatever its mode)."""
        values: dict[str, dict[str, Any]] = {}
        for node in self.nodes.values():
            widgets = node.get("widgets_values")
            if node.get("type") != "PrimitiveNode" or not isinstance(widgets, list) or not widgets:
                continue
            for link_id in (node.get("outputs") or [{}])[0].get("links") or []:
                record = self.links.get(link_id) if isinstance(link_id, int) else None
                target = self.nodes.get(str(record[2])) if record else None
                socket = next((inp for inp in (target or {}).get("inputs") or [] if inp.get("link") == link_id), {})
                name = (socket.get("widget") or {}).get("name")
                if name:
                    values.setdefault(str(target.get("id")), {})[name] = widgets[0]
        return values


def _check_no_subgraphs(workflow: dict) -> None:
    subgraphs = ((workflow.get("definitions") or {}).get("subgraphs")) or []
    ids = {sg.get("id") for sg in subgraphs if isinstance(sg, dict)}
    used = [str(n.get("id")) for n in workflow["nodes"] if n.get("type") in ids]
    if used:
        raise WorkflowError(f"nodes {', '.join(used)} are subgraphs, which the converter does not expand; "
                            f"export the workflow from ComfyUI with 'Export (API)' and run that file")
    # The editor's older "group nodes": type "workflow>NAME" ("workflow/NAME" before), defined in extra.groupNodes.
    groups = ((workflow.get("extra") or {}).get("groupNodes")) or {}
    grouped = [f"node {n.get('id')} ({n.get('type')})" for n in workflow["nodes"]
               if any(str(n.get("type")) == f"workflow{sep}{name}" for name in groups for sep in ">/")]
    if grouped:
        raise WorkflowError(f"{', '.join(grouped)}: group node, which the converter does not expand; export the "
                            f"workflow from ComfyUI with 'Export (API)' and run that file")


def ui_to_api(workflow: dict, object_info: dict) -> dict:
    """Convert an editor workflow to an API prompt using ``object_info`` (``GET /object_info``)."""
    if not is_ui_workflow(workflow):
        raise WorkflowError("the workflow has no 'nodes' list, so it is not an editor (UI-format) workflow")
    check_ui_nodes(workflow)
    _check_no_subgraphs(workflow)
    graph = _Graph(workflow, object_info)
    from_primitives = graph.primitive_values()
    prompt: dict[str, dict] = {}
    linked: list[tuple[dict, str, str]] = []  # (inputs, input name, origin node id) of every resolved link
    problems: list[str] = []
    for node_id, node in graph.nodes.items():
        node_type = node.get("type")
        if node.get("mode", 0) in (MODE_MUTED, MODE_BYPASS) or node_type in UI_ONLY_TYPES:
            continue
        spec = object_info.get(node_type)
        if spec is None:
            problems.append(f"node {node_id} ({node_type}): unknown node type; this ComfyUI does not provide it "
                            f"(install the node pack that does, or remove the node)")
            continue
        inputs = widget_inputs(node, spec)
        inputs.update((k, v) for k, v in from_primitives.get(node_id, {}).items() if k in inputs)
        for inp in node.get("inputs") or []:
            name = (inp.get("widget") or {}).get("name") or inp.get("name")
            if inp.get("link") is None or not name:
                continue
            source = graph.resolve(inp["link"], inp.get("type"), f"node {node_id} ({node_type}) input '{name}'")
            if source is not None:
                inputs[name] = list(source)
                linked.append((inputs, name, source[0]))
        prompt[node_id] = {"inputs": inputs, "class_type": node_type,
                           "_meta": {"title": node.get("title") or spec.get("display_name") or node_type}}
    if problems:
        raise WorkflowError(problems[0], problems)
    for inputs, name, origin in linked:  # a link to a node that is not queued (a muted one) is deleted, as the
        if origin not in prompt:         # editor does
            del inputs[name]
    if not prompt:
        raise WorkflowError("the workflow has no node that ComfyUI can execute (all are notes, muted or bypassed)")
    return prompt


# --------------------------------------------------------------------------------------------- overrides
def parse_override(text: str) -> tuple[str, str, Any]:
    """``NODE.INPUT=VALUE`` -> (node selector, input name, value); VALUE is parsed as JSON when it is JSON."""
    key, sep, raw = text.partition("=")
    selector, dot, name = key.partition(".")
    if not sep or not dot or not selector or not name:
        raise WorkflowError(f"--set {text!r}: expected NODE_ID.INPUT=VALUE (or CLASS_TYPE.INPUT=VALUE), "
                            f"e.g. --set 3.seed=42")
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    return selector, name, value


def apply_overrides(prompt: dict, overrides: Iterable[tuple[str, str, Any]], object_info: dict | None = None) -> dict:
    """Return a copy of ``prompt`` with each override applied.

    A selector that is a node id sets that node's input; otherwise it must be a class type, and every node of that
    type gets the value. With ``object_info`` the input name must be one the node declares.
    """
    result = json.loads(json.dumps(prompt))
    for selector, name, value in overrides:
        if selector in result:
            targets = [selector]
        else:
            targets = [nid for nid, node in result.items() if node.get("class_type") == selector]
        if not targets:
            raise WorkflowError(f"--set {selector}.{name}: the workflow has no node with id {selector!r} and no node "
                                f"of type {selector!r} (node ids: {', '.join(sorted(result, key=_id_key))})")
        for nid in targets:
            node = result[nid]
            spec = (object_info or {}).get(node.get("class_type"))
            if spec is not None:
                declared = input_names(spec)
                if name not in declared:
                    raise WorkflowError(f"--set {selector}.{name}: node {nid} ({node['class_type']}) has no input "
                                        f"{name!r} (its inputs: {', '.join(declared) or 'none'})")
            if not isinstance(node.setdefault("inputs", {}), dict):
                raise WorkflowError(f"--set {selector}.{name}: node {nid}'s 'inputs' is {short_repr(node['inputs'])}, "
                                    f"not an object of input name -> value; fix the workflow file")
            node["inputs"][name] = value
    return result


def _id_key(node_id: str):
    return (0, int(node_id), "") if node_id.isdigit() else (1, 0, node_id)

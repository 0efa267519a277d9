"""Shape checks for workflow files: what the converter and the CLI index must have the type they expect.

Invariant: a workflow that passes these checks cannot make the conversion or ``--set`` fail with a raw
``TypeError``/``AttributeError``/``RecursionError``; one that fails them is refused with a ``WorkflowError`` (exit 2)
naming the node or link and the bad value. Why: the runner's exit codes are an API, and a traceback (exit 1) is
outside it.
"""
from __future__ import annotations

from typing import Any

from .errors import WorkflowError

MAX_DEPTH = 64  # JSON nesting; workflows need about 8


def check_depth(data: Any, source: str) -> None:
    """Refuse JSON nested deeper than ``MAX_DEPTH``: every later step (conversion, ``json.dumps``) recurses per
    level, so a deeper file would end in a ``RecursionError`` instead of a plain refusal."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise WorkflowError(f"{source} nests JSON deeper than {MAX_DEPTH} levels; no workflow does, so it is "
                                f"not one: export it again from ComfyUI")
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))


def check_prompt(prompt: dict, source: str = "workflow") -> None:
    """Refuse an API prompt whose node is not ``{"class_type": str, "inputs": dict}``, naming the node: later
    steps index these fields and would fail with a raw ``TypeError``."""
    for node_id, node in prompt.items():
        where = f"{source}: node {node_id}"
        if not isinstance(node, dict):
            raise WorkflowError(f"{where} is {short_repr(node)}, not an object with 'class_type' and 'inputs'")
        if not isinstance(node.get("class_type"), str) or not node["class_type"]:
            raise WorkflowError(f"{where}: 'class_type' is {short_repr(node.get('class_type'))}; it must be the "
                                f"node type's name, a string such as \"KSampler\"")
        if not isinstance(node.get("inputs", {}), dict):
            raise WorkflowError(f"{where} ({node['class_type']}): 'inputs' is {short_repr(node.get('inputs'))}; it "
                                f"must be an object of input name -> value or [node_id, output_index]")


def short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_ui_nodes(workflow: dict) -> None:
    """Refuse an editor workflow whose nodes, sockets, links or sections have a type the conversion does not read,
    naming the bad value: the conversion indexes these fields and would otherwise fail with a raw ``TypeError`` or
    ``AttributeError``."""
    for field, kind in (("links", list), ("extra", dict), ("definitions", dict)):
        if workflow.get(field) is not None and not isinstance(workflow[field], kind):
            raise WorkflowError(f"the workflow's '{field}' is {short_repr(workflow[field])}, not a {kind.__name__}; "
                                f"save the workflow again from ComfyUI")
    for i, node in enumerate(workflow["nodes"]):
        if not isinstance(node, dict):
            raise WorkflowError(f"workflow 'nodes' entry {i} is {short_repr(node)}, not a node object; save the "
                                f"workflow again from ComfyUI")
        where = f"node {short_repr(node.get('id'))}"
        if not isinstance(node.get("type"), (str, type(None))):
            raise WorkflowError(f"{where}: 'type' is {short_repr(node.get('type'))}; it must be the node type's "
                                f"name, a string")
        if not isinstance(node.get("widgets_values"), (list, dict, type(None))):
            raise WorkflowError(f"{where} ({node['type']}): 'widgets_values' is {short_repr(node['widgets_values'])}, "
                                f"not a list; save the workflow again from ComfyUI")
        for field in ("inputs", "outputs"):
            sockets = node.get(field) or []
            if not isinstance(sockets, list) or not all(_plain_socket(sock) for sock in sockets):
                raise WorkflowError(f"{where} ({node.get('type')}): '{field}' is {short_repr(sockets)}, not a list "
                                    f"of socket objects; save the workflow again from ComfyUI")


def _plain_socket(sock: Any) -> bool:
    """A socket object whose name, widget and links have the types the editor writes."""
    if not isinstance(sock, dict) or not isinstance(sock.get("name"), (str, type(None))):
        return False
    widget = sock.get("widget")
    if widget is not None and not (isinstance(widget, dict) and isinstance(widget.get("name"), (str, type(None)))):
        return False
    return isinstance(sock.get("links"), (list, type(None)))

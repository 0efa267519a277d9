"""Progress display for a running prompt: one bar over the prompt's nodes, with the current node's steps.

Invariant: display only; it never raises from an event and writes to stderr (tqdm when installed, else one plain
line per node), so stdout carries only the runner's results.
"""
from __future__ import annotations

import sys
from typing import Optional


class RunProgress:
    """Feed it websocket events (``event(type, data)``); ``close()`` ends the bar."""

    def __init__(self, prompt: dict, quiet: bool = False, stream=None):
        self.prompt = prompt
        self.quiet = quiet
        self.stream = stream or sys.stderr
        self.done: set[str] = set()
        self.current: Optional[str] = None
        self._bar = None
        if not quiet:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=len(prompt), desc="nodes", unit="node", file=self.stream, leave=False,
                                 dynamic_ncols=True)

    def _label(self, node_id) -> str:
        node = self.prompt.get(str(node_id)) or {}
        return f"{node_id} {node.get('class_type', '?')}"

    def _finish(self, node_id) -> None:
        node_id = str(node_id)
        if node_id in self.done or node_id not in self.prompt:
            return
        self.done.add(node_id)
        if self._bar is not None:
            self._bar.update(1)

    def event(self, kind: str, data: dict) -> None:
        if self.quiet:
            return
        if kind == "execution_cached":
            for node_id in data.get("nodes") or []:
                self._finish(node_id)
        elif kind == "executing":
            if self.current is not None:
                self._finish(self.current)
            self.current = data.get("node")
            if self.current is not None:
                if self._bar is not None:
                    self._bar.set_postfix_str(self._label(self.current), refresh=True)
                else:
                    print(f"running node {self._label(self.current)}", file=self.stream)
        elif kind == "progress" and self._bar is not None:
            node = data.get("node") or self.current
            self._bar.set_postfix_str(f"{self._label(node)} step {data.get('value')}/{data.get('max')}", refresh=True)
        elif kind == "executed":
            self._finish(data.get("node"))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "RunProgress":
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

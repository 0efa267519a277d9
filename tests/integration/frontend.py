"""ComfyUI's own web frontend (the editor) driven in headless Chromium, for checks that must not trust our converter.

``Editor(url, chromium)`` opens the page a ComfyUI server serves (its pip package ``comfyui-frontend-package``) through
Playwright and waits until the app has registered the server's nodes. Then, in that real editor:

- ``load(workflow)`` runs ``app.loadGraphData`` on a workflow, or on the one the server serves at a path (a template
  browser entry, ``/workflow_templates/PACK/NAME.json``, fetched in the page), and returns what the editor made of
  it: the prompt its own ``app.graphToPrompt()`` queues (``prompt``), the graph it would save again (``saved``),
  every node's widgets as the editor holds them (name, type, value, options, the value an edit that keeps it
  leaves) and every problem it raised meanwhile;
- ``create(node_type)`` adds one node with its defaults (``LiteGraph.createNode`` + ``app.graph.add``) and returns
  its widgets, sockets, the saved node, the queued prompt, what its widgets' arrow buttons step to, and the node
  definition the editor shows tooltips from;
- ``set_widgets(values)`` sets widget values on the node last created and returns the new saved node and prompt.

Problems are what a user would see or the browser would log while a graph loads: toasts (the workflow schema
validation and link fixes report there), dialogs (missing node types, missing models, load errors), the node types
the editor could not find (its ``afterConfigureGraph`` hook), page errors and console errors or warnings. Messages
logged while the app starts are not counted (the frontend 1.27 logs its own start-up errors, none about any graph).

Why hand-written: Playwright drives the browser; this module only holds the page-side snippets that read the
editor's state, which no library provides. The browser is an installed Chromium (``LEANDIFFUSION_CHROMIUM``, else
``chromium`` / ``chromium-browser`` / ``google-chrome`` on ``PATH``): nothing is downloaded.
"""
from __future__ import annotations

import os
import shutil
import time
from typing import Any

CHROMIUM_ENV = "LEANDIFFUSION_CHROMIUM"
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
READY_TIMEOUT_MS = 180_000
SETTLE_S = 0.3  # quiet network time after a load before its problems are read


def find_chromium() -> str | None:
    """The Chromium executable to drive: ``$LEANDIFFUSION_CHROMIUM``, else the first of CHROMIUM_NAMES on PATH."""
    named = os.environ.get(CHROMIUM_ENV)
    if named:
        return named if os.path.isfile(named) else shutil.which(named)
    return next((path for path in map(shutil.which, CHROMIUM_NAMES) if path), None)


# Page-side snippets. Widget records: {name, type, value, options{min,max,step2,round,precision,values}}.
_WIDGETS = """(node) => (node.widgets || []).map(w => ({
    name: w.name, type: w.type, value: w.value === undefined ? null : w.value,
    options: Object.fromEntries(['min', 'max', 'step2', 'round', 'precision', 'values', 'serialize']
        .filter(k => w.options && w.options[k] !== undefined).map(k => [k, w.options[k]]))}))"""

_INSTALL_HOOKS = """() => {
    const pinia = document.querySelector('#vue-app').__vue_app__.config.globalProperties.$pinia;
    window.__ldProblems = [];
    const note = (text) => window.__ldProblems.push(text);
    pinia._s.get('toast').$onAction(({name, args}) => {
        if (name === 'add') note('toast: ' + JSON.stringify(args[0]));
        if (name === 'addAlert') note('alert toast: ' + String(args[0]));
    });
    pinia._s.get('dialog').$onAction(({name, args}) => {
        if (name === 'showDialog') note('dialog: ' + (args[0] && (args[0].key || args[0].title)));
    });
    window.app.registerExtension({name: 'leandiffusion.frontend-check', afterConfigureGraph(missing) {
        if (missing && missing.length) note('missing node types: ' + JSON.stringify(missing));
    }});
    window.__ldWidgets = %s;
}""" % _WIDGETS

_LOAD = """async (workflow) => {
    window.__ldProblems.length = 0;
    if (typeof workflow === 'string')  // a template, fetched as the template browser does
        workflow = await fetch(window.app.api.apiURL(workflow)).then(r => r.json());
    await window.app.loadGraphData(workflow);
    const {output, workflow: saved} = await window.app.graphToPrompt();
    const widgets = {};
    for (const node of window.app.graph.nodes) {
        const ws = window.__ldWidgets(node);
        for (const w of ws) {  // what an edit that keeps the value (typing it again) leaves: the widget's own callback
            const live = node.widgets.find(x => x.name === w.name);
            if (w.type === 'number' && live.callback) {
                live.callback.call(live, w.value); w.after_edit = live.value; live.value = w.value;
            }
        }
        widgets[String(node.id)] = {type: node.type, widgets: ws};
    }
    return {prompt: output, saved, widgets};
}"""

_CREATE = """async (type) => {
    const app = window.app;
    window.__ldProblems.length = 0;
    app.graph.clear();
    const node = LiteGraph.createNode(type);
    if (!node) return null;
    app.graph.add(node);
    window.__ldNode = node;
    const widgets = window.__ldWidgets(node);
    for (const w of widgets) {  // the value each of three clicks on the arrows gives, up then down from the default
        const live = node.widgets.find(x => x.name === w.name);
        if (w.type !== 'number') continue;
        w.arrows = {up: [], down: []};
        for (const [dir, list] of [['incrementValue', w.arrows.up], ['decrementValue', w.arrows.down]]) {
            live.value = w.value;
            for (let i = 0; i < 3; i++) { live[dir]({e: {}, node, canvas: app.canvas}); list.push(live.value); }
        }
        live.value = w.value;
    }
    const pinia = document.querySelector('#vue-app').__vue_app__.config.globalProperties.$pinia;
    const def = pinia._s.get('nodeDef').nodeDefsByName[type];
    const definition = {display_name: def.display_name, category: def.category, description: def.description,
        inputs: Object.fromEntries(Object.entries(def.inputs).map(([k, v]) => [k, v.tooltip ?? null])),
        outputs: def.outputs.map(o => ({name: o.name, type: o.type, tooltip: o.tooltip ?? null}))};
    const {output} = await app.graphToPrompt();
    return {title: node.title, widgets, definition,
        inputs: node.inputs.map(i => ({name: i.name, type: i.type, widget: i.widget ? i.widget.name : null})),
        outputs: node.outputs.map(o => ({name: o.name, type: o.type})),
        saved: app.graph.serialize().nodes[0], prompt: output};
}"""

_SET_WIDGETS = """async (values) => {
    const node = window.__ldNode;
    for (const [name, value] of Object.entries(values)) node.widgets.find(w => w.name === name).value = value;
    const {output} = await window.app.graphToPrompt();
    return {saved: window.app.graph.serialize().nodes[0], prompt: output};
}"""


class Editor:
    """One headless Chromium page on ComfyUI's editor; ``close()`` ends the browser and Playwright."""

    def __init__(self, url: str, chromium: str):
        from playwright.sync_api import sync_playwright

        self._pw = sync_playwright().start()
        try:
            self._browser = self._pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            self.page = self._browser.new_page()
            self._log: list[str] = []
            self._pending = 0
            self.page.on("console", self._console)
            self.page.on("pageerror", lambda exc: self._log.append(f"page error: {exc}"))
            self.page.on("request", lambda _: self._count(1))
            self.page.on("requestfinished", lambda _: self._count(-1))
            self.page.on("requestfailed", lambda _: self._count(-1))
            self.page.goto(url)
            self.page.wait_for_function("() => window.app && window.app.graph && window.LiteGraph && "
                                        "window.LiteGraph.registered_node_types['SaveImage']",
                                        timeout=READY_TIMEOUT_MS)
            self.page.evaluate(_INSTALL_HOOKS)
            self._settle()
            self.startup_log, self._log = self._log, []  # kept for debugging, never counted as a problem
        except BaseException:
            self.close()
            raise

    def _console(self, message) -> None:
        if message.type in ("error", "warning"):
            where = (message.location or {}).get("url", "")
            self._log.append(f"console {message.type}: {message.text}" + (f" ({where})" if where else ""))

    def _count(self, delta: int) -> None:
        self._pending += delta

    def _settle(self, timeout: float = 15.0) -> None:
        """Wait until no request has been in flight for SETTLE_S (image previews a loaded graph asks for...)."""
        deadline, quiet_since = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            if self._pending <= 0:
                quiet_since = quiet_since or time.monotonic()
                if time.monotonic() - quiet_since >= SETTLE_S:
                    return
            else:
                quiet_since = None
            self.page.wait_for_timeout(50)

    def _problems(self) -> list[str]:
        self._settle()
        problems = self.page.evaluate("() => window.__ldProblems.slice()") + self._log
        self._log = []
        return problems

    def load(self, workflow: dict | str) -> dict[str, Any]:
        """Load an editor workflow, or the server path of one (``/workflow_templates/PACK/NAME.json``)."""
        result = self.page.evaluate(_LOAD, workflow)
        result["problems"] = self._problems()
        return result

    def create(self, node_type: str) -> dict[str, Any] | None:
        result = self.page.evaluate(_CREATE, node_type)
        if result is not None:
            result["problems"] = self._problems()
        return result

    def set_widgets(self, values: dict[str, Any]) -> dict[str, Any]:
        return self.page.evaluate(_SET_WIDGETS, values)

    def close(self) -> None:
        browser, self._browser = getattr(self, "_browser", None), None
        if browser is not None:
            browser.close()
        pw, self._pw = getattr(self, "_pw", None), None
        if pw is not None:
            pw.stop()

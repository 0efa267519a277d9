"""The pack in ComfyUI's real web frontend (the editor), not in our model of it: headless Chromium opens the page the
test ComfyUI serves (``tests/integration/frontend.py``) and

- loads every shipped editor workflow as the template browser does (fetched from ``/workflow_templates/``, then
  ``app.loadGraphData``): no problem raised (missing nodes, schema or link
  validation, dialogs, page or console errors), the editor's own ``app.graphToPrompt()`` queues exactly the API twin
  (``_meta`` aside), it would save the same widget values again (and our converter reads that saved file as the
  twin too), every number lies within its widget's limits and survives an edit (the widget's own rounding) and
  every fixed-option COMBO value is one of its options;
- creates every pack node with its defaults: widgets in the order our converter assumes, the declared defaults,
  limits, options and tooltips, arrow buttons that step by the declared step, and a queued prompt equal to our
  converter's for the node the editor saves, with defaults and with every widget changed;
- queues the small graphs of ``tests/fixtures/editor_graphs.py`` (bypass, mute, reroute, primitive rules) and the
  core fixture as their hand-written expectations say, which our converter must match too.

Opt-in (marker ``comfyui``): needs ``COMFYUI_PATH``, the Python package ``playwright`` and an installed Chromium
(``apt-get install chromium``; ``LEANDIFFUSION_CHROMIUM`` names another executable). Nothing is downloaded: Playwright
drives that Chromium. How to run it: docs/workflows.md ("Checking the workflows in ComfyUI's editor").
"""
import json
from pathlib import Path

import pytest

import leandiffusion
from leandiffusion.runner.client import ComfyClient
from leandiffusion.runner.convert import is_api_prompt, ui_to_api, widget_slots
from leandiffusion.runner.local import PACK_ROOT
from leandiffusion.tests.fixtures import editor_graphs
from leandiffusion.tests.integration.frontend import CHROMIUM_ENV, Editor, find_chromium
from leandiffusion.tests.integration.model_files import write_input_images
from leandiffusion.tests.workflows.specs import combined

pytestmark = pytest.mark.comfyui

try:
    import playwright.sync_api  # noqa: F401
except ImportError:
    pytest.skip("needs the Python package playwright (pip install playwright; no browser download: the test drives "
                "an installed Chromium)", allow_module_level=True)
CHROMIUM = find_chromium()
if CHROMIUM is None:
    pytest.skip(f"needs a Chromium executable (apt-get install chromium, or set {CHROMIUM_ENV})",
                allow_module_level=True)

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
WORKFLOWS = PACK_ROOT / "workflows"
API_DIR = PACK_ROOT / "workflows_api"
UI_FILES = sorted(WORKFLOWS.glob("*.json"))
NODES = sorted(leandiffusion.NODE_CLASS_MAPPINGS)
CONTROL = "control_after_generate"


def _strip_meta(prompt):
    return {nid: {k: v for k, v in node.items() if k != "_meta"} for nid, node in prompt.items()}


def _same_number(a, b):
    return a is not None and b is not None and round(a, 9) == round(b, 9)


@pytest.fixture(scope="module")
def object_info(comfyui):
    return ComfyClient(comfyui.url).object_info()


@pytest.fixture(scope="module")
def editor(comfyui, object_info):
    for api in API_DIR.glob("*.api.json"):
        write_input_images(json.loads(api.read_text()), comfyui.input_dir)
    page = Editor(comfyui.url, CHROMIUM)
    for name, spec in editor_graphs.SPECS.items():
        if name not in object_info:  # made-up node types of the graph-rule cases
            page.page.evaluate("async ([name, spec]) => { await window.app.registerNodeDef(name, spec); }",
                               [name, spec])
    yield page
    page.close()


@pytest.fixture(scope="module")
def templates(comfyui):
    """The template browser's folder for the pack: the ``/workflow_templates`` entry listing its workflows."""
    listing = ComfyClient(comfyui.url).get_json("/workflow_templates")
    stems = {p.stem for p in UI_FILES}
    folders = [folder for folder, names in listing.items() if stems <= set(names)]
    assert len(folders) == 1, f"no single template folder lists {sorted(stems)}: {listing}"
    return f"/workflow_templates/{folders[0]}"


def test_shipped_workflows_are_all_checked():
    assert len(UI_FILES) == len(list(API_DIR.glob("*.api.json"))) > 0
    assert all((API_DIR / f"{p.stem}.api.json").exists() for p in UI_FILES)


# --------------------------------------------------------------------------------------------- shipped workflows
@pytest.mark.parametrize("ui_path", UI_FILES, ids=lambda p: p.stem)
def test_editor_loads_the_workflow_and_queues_its_api_twin(editor, object_info, templates, ui_path):
    workflow = json.loads(ui_path.read_text())
    twin = json.loads((API_DIR / f"{ui_path.stem}.api.json").read_text())
    assert is_api_prompt(twin)
    result = editor.load(f"{templates}/{ui_path.name}")  # as the template browser opens it
    assert result["problems"] == [], f"the editor reported problems loading {ui_path.name}"
    assert _strip_meta(result["prompt"]) == _strip_meta(twin)
    saved = {node["id"]: node.get("widgets_values") for node in result["saved"]["nodes"]}
    assert saved == {node["id"]: node.get("widgets_values") for node in workflow["nodes"]}, \
        "the editor would save other widget values than it loaded"
    assert _strip_meta(ui_to_api(result["saved"], object_info)) == _strip_meta(twin), \
        "our converter reads the file the editor saves again (every widget with a socket) differently"


@pytest.mark.parametrize("ui_path", UI_FILES, ids=lambda p: p.stem)
def test_every_loaded_widget_value_is_valid_in_the_editor(editor, ui_path):
    _, dynamic = combined()
    result = editor.load(json.loads(ui_path.read_text()))
    problems = []
    for nid, node in result["widgets"].items():
        for w in node["widgets"]:
            where, value, opts = f"node {nid} ({node['type']}) widget '{w['name']}'", w["value"], w["options"]
            if w["type"] == "number":
                if not opts.get("min", value) <= value <= opts.get("max", value):
                    problems.append(f"{where} = {value} is outside the editor's limits {opts}")
                if w.get("after_edit") != value:
                    problems.append(f"{where} = {value} becomes {w.get('after_edit')} when edited")
                if round(value, opts.get("precision", 0)) != value:
                    problems.append(f"{where} = {value} shows as {round(value, opts.get('precision', 0))}")
            elif w["type"] == "combo" and (node["type"], w["name"]) not in dynamic and w["name"] != CONTROL:
                if value not in opts.get("values", []):
                    problems.append(f"{where} = {value!r} is not one of its options {opts.get('values')}")
    assert problems == []


# --------------------------------------------------------------------------------------------- pack nodes
def _declared(node_type, object_info):
    """name -> (type or options, options dict) of every declared input, COMBO file lists as the server lists them."""
    cls = leandiffusion.NODE_CLASS_MAPPINGS[node_type]
    out = {}
    for section, inputs in cls.INPUT_TYPES().items():
        for name, decl in inputs.items():
            typ, opts = decl[0], (decl[1] if len(decl) > 1 else {})
            if isinstance(typ, (list, tuple)):
                typ = object_info[node_type]["input"][section][name][0]
            out[name] = (list(typ) if isinstance(typ, (list, tuple)) else typ, opts)
    return out


def _default(typ, opts):
    if isinstance(typ, list):
        return opts.get("default", typ[0] if typ else None)
    return opts.get("default")


@pytest.mark.parametrize("node_type", NODES)
def test_new_node_has_the_declared_widgets_and_defaults(editor, object_info, node_type):
    created = editor.create(node_type)
    assert created is not None, f"the editor cannot create {node_type}"
    assert created["problems"] == []
    declared = _declared(node_type, object_info)
    expected_names = []
    for name, control, upload in widget_slots(object_info[node_type]):
        expected_names += [name] + [CONTROL] * control + ["upload"] * upload
    assert [w["name"] for w in created["widgets"]] == expected_names
    for w in created["widgets"]:
        if w["name"] == CONTROL:
            continue
        typ, opts = declared[w["name"]]
        where = f"{node_type}.{w['name']}"
        if isinstance(typ, list):
            assert w["type"] == "combo" and w["options"]["values"] == typ, where
        elif typ in ("INT", "FLOAT"):
            o = w["options"]
            assert [float(o["min"]), float(o["max"])] == [float(opts["min"]), float(opts["max"])], f"{where}: {o}"
            assert o["step2"] == opts.get("step", 1 if typ == "INT" else None), f"{where}: step {o}"
        assert w["value"] == _default(typ, opts), where
    sockets = [(i["name"], i["type"]) for i in created["inputs"] if i["widget"] is None]
    assert sockets == [(n, t) for n, (t, _) in declared.items()
                       if not isinstance(t, list) and t not in ("INT", "FLOAT", "STRING", "BOOLEAN")]


@pytest.mark.parametrize("node_type", NODES)
def test_arrow_buttons_step_by_the_declared_step(editor, object_info, node_type):
    """Three clicks up and three down from the default move the value by exactly ``step`` each (clamped to min/max):
    the editor rounds a FLOAT to the decimals of its step's magnitude, so a step of 0.25 went 4 -> 4.3 -> 4.5."""
    created = editor.create(node_type)
    declared = _declared(node_type, object_info)
    for w in created["widgets"]:
        if w["type"] != "number":
            continue
        _, opts = declared[w["name"]]
        step = opts.get("step", 1)
        want_up = [min(w["value"] + k * step, opts["max"]) for k in (1, 2, 3)]
        want_down = [max(w["value"] - k * step, opts["min"]) for k in (1, 2, 3)]
        got = w["arrows"]
        assert all(map(_same_number, got["up"], want_up)) and all(map(_same_number, got["down"], want_down)), \
            f"{node_type}.{w['name']}: arrows give {got}, the step {step} wants up {want_up}, down {want_down}"


@pytest.mark.parametrize("node_type", NODES)
def test_editor_shows_the_declared_tooltips(editor, node_type):
    cls = leandiffusion.NODE_CLASS_MAPPINGS[node_type]
    definition = editor.create(node_type)["definition"]
    assert definition["display_name"] == leandiffusion.NODE_DISPLAY_NAME_MAPPINGS[node_type]
    assert definition["category"] == cls.CATEGORY and definition["description"] == cls.DESCRIPTION
    declared = {name: decl[1]["tooltip"] for inputs in cls.INPUT_TYPES().values() for name, decl in inputs.items()}
    assert definition["inputs"] == declared
    assert [o["tooltip"] for o in definition["outputs"]] == list(cls.OUTPUT_TOOLTIPS)
    assert [(o["name"], o["type"]) for o in definition["outputs"]] == \
        list(zip(getattr(cls, "RETURN_NAMES", cls.RETURN_TYPES), cls.RETURN_TYPES))


def _changed_values(widgets, declared):
    """A valid value other than the default for every widget (distinct per widget, so a shifted order shows)."""
    values = {}
    for i, w in enumerate(widgets):
        if w["name"] == CONTROL:
            values[w["name"]] = "fixed"
            continue
        typ, opts = declared[w["name"]]
        if isinstance(typ, list):
            if len(typ) > 1:
                values[w["name"]] = typ[-1] if typ[-1] != w["value"] else typ[0]
        elif typ in ("INT", "FLOAT"):
            step = opts.get("step", 1)
            up = round(w["value"] + (i + 1) * step, 9)
            values[w["name"]] = up if up <= opts["max"] else round(w["value"] - (i + 1) * step, 9)
        elif typ == "STRING":
            values[w["name"]] = f"text for {w['name']}"
        elif typ == "BOOLEAN":
            values[w["name"]] = not w["value"]
    return values


@pytest.mark.parametrize("node_type", NODES)
def test_editor_queues_the_node_as_our_converter_does(editor, object_info, node_type):
    created = editor.create(node_type)
    ours = ui_to_api({"nodes": [created["saved"]], "links": []}, object_info)
    assert created["prompt"] == ours, "with its defaults"
    values = _changed_values(created["widgets"], _declared(node_type, object_info))
    changed = editor.set_widgets(values)
    queued = changed["prompt"][str(created["saved"]["id"])]["inputs"]
    assert {k: queued[k] for k in values if k != CONTROL} == {k: v for k, v in values.items() if k != CONTROL}
    assert changed["prompt"] == ui_to_api({"nodes": [changed["saved"]], "links": []}, object_info), \
        "with every widget changed"


# --------------------------------------------------------------------------------------------- graph rules
@pytest.mark.parametrize("name", sorted(editor_graphs.CASES))
def test_editor_queues_the_graph_rule_cases_as_written(editor, object_info, name):
    workflow, expected = editor_graphs.case(name)
    result = editor.load(workflow)
    assert result["problems"] == []
    assert _strip_meta(result["prompt"]) == expected
    info = {**editor_graphs.SPECS, **object_info}
    assert _strip_meta(ui_to_api(workflow, info)) == expected


def test_editor_queues_the_core_fixture_as_written(editor, object_info):
    workflow = json.loads((FIXTURES / "core_image.json").read_text())
    expected = json.loads((FIXTURES / "core_image_ui.expected.api.json").read_text())
    result = editor.load(workflow)
    assert result["problems"] == []
    assert _strip_meta(result["prompt"]) == expected == _strip_meta(ui_to_api(workflow, object_info))


# --------------------------------------------------------------------------------------------- the check itself
@pytest.mark.parametrize("break_it, expected", [
    (lambda wf: wf["nodes"][0].update(type="NoSuchNodeType"), 'missing node types: ["NoSuchNodeType"]'),
    (lambda wf: wf["links"][0].__setitem__(4, 5), "Workflow Links Fixed"),
    (lambda wf: wf["nodes"][0].pop("pos"), 'Required at "nodes[0].pos"'),
], ids=["missing_node_type", "broken_link", "schema"])
def test_problems_the_editor_raises_are_seen(editor, break_it, expected):
    """The problem capture is not blind: a missing node type (dialog), a link record that disagrees with its socket
    (link fix toast) and a node without a position (schema alert) each show up."""
    workflow = json.loads((WORKFLOWS / "quickstart.json").read_text())
    break_it(workflow)
    problems = editor.load(workflow)["problems"]
    assert any(expected in p for p in problems), problems

"""The runner's workflow handling: format detection, UI -> API conversion, --set overrides.

Guards the promise that an editor (UI-format) workflow is queued exactly as ComfyUI's editor would queue it:
widget order from /object_info, control_after_generate and upload values skipped, converted widgets, primitive and
reroute nodes, muted and bypassed nodes. The expected prompts are written by hand from the editor's rules (and the
fixture's expectation is checked against the real ComfyUI by tests/integration).
"""
import json
from pathlib import Path

import pytest

from leandiffusion.runner.convert import (apply_overrides, editor_sockets, load_workflow, parse_override, types_fit,
                                          ui_to_api, widget_inputs, widget_slots)
from leandiffusion.runner.errors import WorkflowError
from leandiffusion.tests.fixtures import editor_graphs

FIXTURES = Path(__file__).parent / "fixtures"
OBJECT_INFO = json.loads((FIXTURES / "comfyui_0.3.64_recorded.json").read_text())["object_info"]


def _strip_meta(prompt):
    return {nid: {k: v for k, v in node.items() if k != "_meta"} for nid, node in prompt.items()}


def _node(node_id, node_type, widgets=None, inputs=(), outputs=(), mode=0):
    return {"id": node_id, "type": node_type, "mode": mode, "inputs": list(inputs), "outputs": list(outputs),
            "widgets_values": widgets}


def test_fixture_ui_workflow_converts_to_expected_prompt():
    kind, workflow = load_workflow((FIXTURES / "core_image.json").read_text())
    assert kind == "ui"
    expected = json.loads((FIXTURES / "core_image_ui.expected.api.json").read_text())
    prompt = ui_to_api(workflow, OBJECT_INFO)
    assert _strip_meta(prompt) == expected
    assert prompt["2"]["_meta"]["title"] == "Upscale Image"  # display name when the node has no title


@pytest.mark.parametrize("control", ["randomize", "fixed", True])
def test_seed_control_value_is_skipped(control):
    node = _node(3, "KSampler", [156680208700286, control, 20, 8, "euler", "normal", 1])
    assert widget_inputs(node, OBJECT_INFO["KSampler"]) == {
        "seed": 156680208700286, "steps": 20, "cfg": 8, "sampler_name": "euler", "scheduler": "normal", "denoise": 1}


def test_seed_without_control_value_still_maps():
    node = _node(3, "KSampler", [7, 20, 8, "euler", "normal", 1])
    assert widget_inputs(node, OBJECT_INFO["KSampler"])["steps"] == 20


def test_upload_button_value_is_skipped_and_slots_announce_it():
    assert widget_slots(OBJECT_INFO["LoadImage"]) == [("image", False, True)]
    assert widget_inputs(_node(1, "LoadImage", ["photo.png", "image"]), OBJECT_INFO["LoadImage"]) == {"image": "photo.png"}


def test_forced_inputs_and_links_are_not_widgets():
    names = [name for name, _, _ in widget_slots(OBJECT_INFO["KSampler"])]
    assert names == ["seed", "steps", "cfg", "sampler_name", "scheduler", "denoise"]


def test_dict_widgets_values_map_by_name():
    node = _node(1, "EmptyImage", {"width": 8, "height": 16, "batch_size": 1, "color": 0, "junk": 1})
    assert widget_inputs(node, OBJECT_INFO["EmptyImage"]) == {"width": 8, "height": 16, "batch_size": 1, "color": 0}


def test_dict_link_records_are_accepted():
    workflow = {"nodes": [
        _node(1, "EmptyImage", [8, 8, 1, 0], outputs=[{"name": "IMAGE", "type": "IMAGE", "links": [1]}]),
        _node(2, "SaveImage", ["p"], inputs=[{"name": "images", "type": "IMAGE", "link": 1}])],
        "links": [{"id": 1, "origin_id": 1, "origin_slot": 0, "target_id": 2, "target_slot": 0, "type": "IMAGE"}]}
    assert ui_to_api(workflow, OBJECT_INFO)["2"]["inputs"] == {"filename_prefix": "p", "images": ["1", 0]}


def test_bypass_without_matching_input_drops_the_input():
    # A bypassed MaskToImage has no IMAGE input to pass through: the editor leaves SaveImage's input unlinked (and
    # ComfyUI then reports it missing); a bypassed ImageInvert passes its IMAGE input through.
    workflow = {"nodes": [
        _node(1, "EmptyImage", [8, 8, 1, 0], outputs=[{"name": "IMAGE", "type": "IMAGE", "links": [1, 4]}]),
        _node(2, "ImageToMask", ["red"], inputs=[{"name": "image", "type": "IMAGE", "link": 1}],
              outputs=[{"name": "MASK", "type": "MASK", "links": [2]}]),
        _node(3, "MaskToImage", None, inputs=[{"name": "mask", "type": "MASK", "link": 2}],
              outputs=[{"name": "IMAGE", "type": "IMAGE", "links": [3]}], mode=4),
        _node(4, "SaveImage", ["p"], inputs=[{"name": "images", "type": "IMAGE", "link": 3}]),
        _node(5, "ImageInvert", None, inputs=[{"name": "image", "type": "IMAGE", "link": 4}],
              outputs=[{"name": "IMAGE", "type": "IMAGE", "links": [5]}], mode=4),
        _node(6, "SaveImage", ["q"], inputs=[{"name": "images", "type": "IMAGE", "link": 5}])],
        "links": [[1, 1, 0, 2, 0, "IMAGE"], [2, 2, 0, 3, 0, "MASK"], [3, 3, 0, 4, 0, "IMAGE"],
                  [4, 1, 0, 5, 0, "IMAGE"], [5, 5, 0, 6, 0, "IMAGE"]]}
    prompt = ui_to_api(workflow, OBJECT_INFO)
    assert set(prompt) == {"1", "2", "4", "6"}
    assert prompt["4"]["inputs"] == {"filename_prefix": "p"}
    assert prompt["6"]["inputs"] == {"filename_prefix": "q", "images": ["1", 0]}



def test_seed_input_without_the_flag_still_has_a_control_value():
    """The editor gives every INT input named ``seed`` or ``noise_seed`` a control_after_generate widget even when the
    spec does not announce one (ComfyUI's ``INT:seed`` / ``INT:noise_seed`` widgets; older packs rely on it), so its
    UI-only value must be skipped; another INT without the flag has none."""
    spec = {"input": {"required": {"noise_seed": ["INT", {"default": 0}], "steps": ["INT", {"default": 20}],
                                   "count": ["INT", {"default": 1}], "name": ["STRING", {}]}},
            "input_order": {"required": ["noise_seed", "steps", "count", "name"]}}
    assert widget_slots(spec) == [("noise_seed", True, False), ("steps", False, False), ("count", False, False),
                                  ("name", False, False)]
    node = _node(1, "OldPackSampler", [5, "randomize", 30, 2, "fixed"])
    assert widget_inputs(node, spec) == {"noise_seed": 5, "steps": 30, "count": 2, "name": "fixed"}


def test_inputs_fed_by_a_muted_node_are_dropped():
    """A muted node (mode 2) is not in the prompt, and the editor deletes every input linked to it (so ComfyUI reports
    the input missing instead of a link to a node that does not exist)."""
    workflow = {"nodes": [
        _node(1, "EmptyImage", [8, 8, 1, 0], outputs=[{"name": "IMAGE", "type": "IMAGE", "links": [1]}], mode=2),
        _node(2, "ImageInvert", None, inputs=[{"name": "image", "type": "IMAGE", "link": 1}],
              outputs=[{"name": "IMAGE", "type": "IMAGE", "links": [2]}]),
        _node(3, "SaveImage", ["p"], inputs=[{"name": "images", "type": "IMAGE", "link": 2}])],
        "links": [[1, 1, 0, 2, 0, "IMAGE"], [2, 2, 0, 3, 0, "IMAGE"]]}
    prompt = ui_to_api(workflow, OBJECT_INFO)
    assert set(prompt) == {"2", "3"}
    assert prompt["2"]["inputs"] == {}
    assert prompt["3"]["inputs"] == {"filename_prefix": "p", "images": ["2", 0]}


def test_bypass_passes_the_input_of_the_same_slot_first():
    """A bypassed node with several inputs of the output's type passes through the input at the output's slot index
    (the editor tries ``origin_slot`` first, then the inputs in order)."""
    workflow = {"nodes": [
        _node(1, "EmptyImage", [8, 8, 1, 0], outputs=[{"name": "IMAGE", "type": "IMAGE", "links": [1]}]),
        _node(2, "EmptyImage", [16, 16, 1, 0], outputs=[{"name": "IMAGE", "type": "IMAGE", "links": [2]}]),
        _node(3, "TwoImagesPack", None,
              inputs=[{"name": "a", "type": "IMAGE", "link": 1}, {"name": "b", "type": "IMAGE", "link": 2}],
              outputs=[{"name": "A", "type": "IMAGE", "links": [3]}, {"name": "B", "type": "IMAGE", "links": [4]}],
              mode=4),
        _node(4, "SaveImage", ["a"], inputs=[{"name": "images", "type": "IMAGE", "link": 3}]),
        _node(5, "SaveImage", ["b"], inputs=[{"name": "images", "type": "IMAGE", "link": 4}])],
        "links": [[1, 1, 0, 3, 0, "IMAGE"], [2, 2, 0, 3, 1, "IMAGE"], [3, 3, 0, 4, 0, "IMAGE"],
                  [4, 3, 1, 5, 0, "IMAGE"]]}
    prompt = ui_to_api(workflow, OBJECT_INFO)
    assert prompt["4"]["inputs"]["images"] == ["1", 0]
    assert prompt["5"]["inputs"]["images"] == ["2", 0]  # slot 1 -> input 1, not the first IMAGE input

@pytest.mark.parametrize("name", sorted(editor_graphs.CASES))
def test_editor_graph_rules(name):
    """Bypassed, muted and virtual nodes in front of linked and widget inputs (``tests/fixtures/editor_graphs.py``;
    the same graphs are queued by the real editor in tests/integration/test_frontend.py). The old converter dropped
    the input where the editor keeps the widget value (a bypass without a fitting input, a reroute without input),
    passed another linked input through where the editor takes the unlinked one at the output's slot, and dropped
    the value of a muted primitive and everything behind a muted reroute."""
    workflow, expected = editor_graphs.case(name)
    assert _strip_meta(ui_to_api(workflow, {**OBJECT_INFO, **editor_graphs.SPECS})) == expected


def test_editor_sockets_put_widget_inputs_last():
    """The editor's socket order, which bypass slot indices count: inputs without a widget first (declared order),
    then widget inputs, then sockets only the file lists; unlisted ones come unlinked."""
    node = {"inputs": [{"name": "extra", "type": "MASK", "link": 9}, {"name": "b", "type": "IMAGE", "link": 2}]}
    sockets = editor_sockets(node, editor_graphs.SPECS["TwoWay"])
    assert [(s["name"], s["type"], s["link"]) for s in sockets] == [("a", "IMAGE", None), ("b", "IMAGE", 2),
                                                                   ("n", "INT", None), ("extra", "MASK", 9)]


@pytest.mark.parametrize("a, b, fits", [("IMAGE", "IMAGE", True), ("IMAGE", "*", True), ("", "MASK", True),
                                        ("image", "IMAGE", True), ("IMAGE,MASK", "MASK", True),
                                        ("IMAGE", "MASK", False), ("IMAGE,MASK", "LATENT", False)])
def test_types_fit_like_the_editor(a, b, fits):
    assert types_fit(a, b) is fits and types_fit(b, a) is fits


def test_reroute_cycle_is_refused_with_the_input():
    workflow = {"nodes": [
        _node(1, "Reroute", None, inputs=[{"name": "", "type": "*", "link": 2}],
              outputs=[{"name": "", "type": "*", "links": [1, 3]}]),
        _node(2, "Reroute", None, inputs=[{"name": "", "type": "*", "link": 1}],
              outputs=[{"name": "", "type": "*", "links": [2]}]),
        _node(3, "SaveImage", ["p"], inputs=[{"name": "images", "type": "IMAGE", "link": 3}])],
        "links": [[1, 1, 0, 2, 0, "*"], [2, 2, 0, 1, 0, "*"], [3, 1, 0, 3, 0, "IMAGE"]]}
    with pytest.raises(WorkflowError, match=r"node 3 \(SaveImage\) input 'images': the links form a cycle"):
        ui_to_api(workflow, OBJECT_INFO)


def test_bypass_read_by_an_any_type_input_passes_the_input_of_the_same_slot():
    """Read by an input of type ``*`` (an any-type node, or through reroutes), a bypassed node passes on the input at
    the output's slot whatever its type (frontend 1.27 ``getBypassSlotIndex``: ``type === "*"`` returns ``slot``
    before any type test); a typed reader would get the first IMAGE input instead."""
    info = dict(OBJECT_INFO, AnyIn={"input": {"required": {"value": ["*", {}]}},
                                    "input_order": {"required": ["value"]}, "output": [], "output_node": True})
    workflow = {"nodes": [
        _node(1, "EmptyImage", [8, 8, 1, 0], outputs=[{"name": "IMAGE", "type": "IMAGE", "links": [1, 3]}]),
        _node(2, "ImageToMask", ["red"], inputs=[{"name": "image", "type": "IMAGE", "link": 1}],
              outputs=[{"name": "MASK", "type": "MASK", "links": [2]}]),
        _node(3, "MaskAndImagePack", None,
              inputs=[{"name": "mask", "type": "MASK", "link": 2}, {"name": "image", "type": "IMAGE", "link": 3}],
              outputs=[{"name": "IMAGE", "type": "IMAGE", "links": [4, 5]}], mode=4),
        _node(4, "AnyIn", None, inputs=[{"name": "value", "type": "*", "link": 4}]),
        _node(5, "SaveImage", ["p"], inputs=[{"name": "images", "type": "IMAGE", "link": 5}])],
        "links": [[1, 1, 0, 2, 0, "IMAGE"], [2, 2, 0, 3, 0, "MASK"], [3, 1, 0, 3, 1, "IMAGE"],
                  [4, 3, 0, 4, 0, "IMAGE"], [5, 3, 0, 5, 0, "IMAGE"]]}
    prompt = ui_to_api(workflow, info)
    assert prompt["4"]["inputs"] == {"value": ["2", 0]}  # slot 0 -> the MASK input, as the editor does
    assert prompt["5"]["inputs"]["images"] == ["1", 0]  # a typed IMAGE reader gets the IMAGE input


def test_bypass_prefers_an_input_of_exactly_the_wanted_type_to_an_earlier_one_that_only_fits():
    """When the input at the output's slot does not fit, the editor takes the first input of exactly the wanted
    type before the first that merely fits (an any-type ``*`` input fits everything)."""
    workflow = {"nodes": [
        _node(1, "EmptyImage", [8, 8, 1, 0], outputs=[{"name": "IMAGE", "type": "IMAGE", "links": [1]}]),
        _node(2, "EmptyImage", [16, 16, 1, 0], outputs=[{"name": "IMAGE", "type": "IMAGE", "links": [3]}]),
        _node(3, "ThreeInputsPack", None,
              inputs=[{"name": "latent", "type": "LATENT", "link": None}, {"name": "any", "type": "*", "link": 1},
                      {"name": "image", "type": "IMAGE", "link": 3}],
              outputs=[{"name": "IMAGE", "type": "IMAGE", "links": [4]}], mode=4),
        _node(4, "SaveImage", ["p"], inputs=[{"name": "images", "type": "IMAGE", "link": 4}])],
        "links": [[1, 1, 0, 3, 1, "*"], [3, 2, 0, 3, 2, "IMAGE"], [4, 3, 0, 4, 0, "IMAGE"]]}
    prompt = ui_to_api(workflow, OBJECT_INFO)
    assert prompt["4"]["inputs"]["images"] == ["2", 0]  # the IMAGE input (index 2), not the '*' one (index 1)


def test_a_primitive_sets_only_widgets_the_node_has():
    """A PrimitiveNode linked to a socket whose widget the node no longer declares sets nothing (the editor's
    ``applyToGraph`` finds no widget of that name and skips it); the node's real widgets keep their values."""
    workflow = {"nodes": [
        _node(1, "PrimitiveNode", [24, "fixed"], outputs=[{"name": "INT", "type": "INT", "links": [1],
                                                           "widget": {"name": "gone"}}]),
        _node(2, "EmptyImage", [8, 16, 1, 0], inputs=[{"name": "gone", "type": "INT", "widget": {"name": "gone"},
                                                       "link": 1}],
              outputs=[{"name": "IMAGE", "type": "IMAGE", "links": [2]}]),
        _node(3, "SaveImage", ["p"], inputs=[{"name": "images", "type": "IMAGE", "link": 2}])],
        "links": [[1, 1, 0, 2, 0, "INT"], [2, 2, 0, 3, 0, "IMAGE"]]}
    prompt = ui_to_api(workflow, OBJECT_INFO)
    assert prompt["2"]["inputs"] == {"width": 8, "height": 16, "batch_size": 1, "color": 0}


def test_unknown_ui_nodes_get_one_line_each():
    workflow = {"nodes": [_node(1, "Mystery", []), _node(2, "AlsoMissing", []), _node(3, "Note", ["x"])], "links": []}
    with pytest.raises(WorkflowError) as info:
        ui_to_api(workflow, OBJECT_INFO)
    assert len(info.value.lines) == 2
    assert info.value.lines[0].startswith("node 1 (Mystery): unknown node type")
    assert info.value.lines[1].startswith("node 2 (AlsoMissing): unknown node type")


def test_undefined_link_is_reported_with_its_place():
    workflow = {"nodes": [_node(2, "SaveImage", ["p"], inputs=[{"name": "images", "type": "IMAGE", "link": 9}])],
                "links": []}
    with pytest.raises(WorkflowError, match=r"node 2 \(SaveImage\) input 'images' uses link 9"):
        ui_to_api(workflow, OBJECT_INFO)


def test_subgraphs_are_refused_with_the_fix():
    workflow = {"nodes": [_node(5, "0f2c-uuid", [])], "links": [],
                "definitions": {"subgraphs": [{"id": "0f2c-uuid", "nodes": []}]}}
    with pytest.raises(WorkflowError, match="Export \\(API\\)"):
        ui_to_api(workflow, OBJECT_INFO)


@pytest.mark.parametrize("node_type", ["workflow>Upscale pair", "workflow/Upscale pair"])
def test_group_nodes_are_refused_with_the_fix(node_type):
    # Bug: an editor "group node" (extra.groupNodes; type "workflow>NAME", "workflow/NAME" in older editors) was
    # reported as "unknown node type; install the node pack that does", sending users looking for a node pack.
    workflow = {"nodes": [_node(1, "EmptyImage", [8, 8, 1, 0]), _node(4, node_type, [8, 8])], "links": [],
                "extra": {"groupNodes": {"Upscale pair": {"nodes": [], "links": []}}}}
    with pytest.raises(WorkflowError) as info:
        ui_to_api(workflow, OBJECT_INFO)
    assert info.value.lines == [info.value.lines[0]]
    line = info.value.lines[0]
    assert "node 4" in line and "group node" in line and "Export (API)" in line and "install" not in line


def test_only_notes_is_an_error():
    with pytest.raises(WorkflowError, match="no node that ComfyUI can execute"):
        ui_to_api({"nodes": [_node(1, "Note", ["x"])], "links": []}, OBJECT_INFO)


# --------------------------------------------------------------------------------------------- formats
def test_load_workflow_detects_api_and_wrapped_api():
    api = (FIXTURES / "core_image.api.json").read_text()
    assert load_workflow(api)[0] == "api"
    kind, prompt = load_workflow(json.dumps({"prompt": json.loads(api), "client_id": "x"}))
    assert kind == "api" and prompt["3"]["class_type"] == "SaveImage"


@pytest.mark.parametrize("text, match", [("{not json", "not valid JSON"), ("[1, 2]", "neither"),
                                         ('{"1": {"inputs": {}}}', "neither")])
def test_load_workflow_refuses_other_files(text, match):
    with pytest.raises(WorkflowError, match=match):
        load_workflow(text, source="wf.json")


# --------------------------------------------------------------------------------------------- overrides
@pytest.mark.parametrize("text, expected", [
    ("3.seed=42", ("3", "seed", 42)),
    ("3.cfg=7.5", ("3", "cfg", 7.5)),
    ("4.model=tiny-random (test)", ("4", "model", "tiny-random (test)")),
    ('6.text="a=b"', ("6", "text", "a=b")),
    ("6.flag=true", ("6", "flag", True)),
    ("LeanModelLoader.model=x.safetensors", ("LeanModelLoader", "model", "x.safetensors")),
])
def test_parse_override(text, expected):
    assert parse_override(text) == expected


@pytest.mark.parametrize("text", ["3seed=1", "3.seed", ".seed=1", "3.=1"])
def test_parse_override_refuses_malformed(text):
    with pytest.raises(WorkflowError, match="NODE_ID.INPUT=VALUE"):
        parse_override(text)


def test_apply_overrides_by_id_and_by_class_without_mutating():
    prompt = json.loads((FIXTURES / "core_image.api.json").read_text())
    before = json.dumps(prompt)
    out = apply_overrides(prompt, [("1", "width", 40), ("SaveImage", "filename_prefix", "x")], OBJECT_INFO)
    assert out["1"]["inputs"]["width"] == 40 and out["3"]["inputs"]["filename_prefix"] == "x"
    assert json.dumps(prompt) == before


def test_apply_overrides_refuses_unknown_node_and_input():
    prompt = json.loads((FIXTURES / "core_image.api.json").read_text())
    with pytest.raises(WorkflowError, match="no node with id '9'.*node ids: 1, 2, 3"):
        apply_overrides(prompt, [("9", "width", 1)], OBJECT_INFO)
    with pytest.raises(WorkflowError, match=r"node 1 \(EmptyImage\) has no input 'wdth'.*width, height"):
        apply_overrides(prompt, [("1", "wdth", 1)], OBJECT_INFO)

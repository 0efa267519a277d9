"""The shipped workflows are consistent with the nodes they use, without ComfyUI.

For every ``workflows/NAME.json`` (editor) and its ``workflows_api/NAME.api.json`` twin: both describe the same
graph and values (the editor file converted by the runner's converter equals the API file), every node type and
input exists in the pack (its own ``INPUT_TYPES``/``RETURN_TYPES``) or in ComfyUI core
(``tests/fixtures/core_object_info.json``, recorded by ``snapshot_core_nodes.py``), every link joins outputs and
inputs of the same type, and fixed COMBO values are legal; the template browser lists only editor files. A failure
lists one line per problem naming the node, its type and the input, so a pack node that has not landed yet reads
``node 2 (LeanStreamSampler): unknown node type ...``.

The negative tests mutate copies of a hand-written core-node fixture (the runner's ``tests/fixtures/core_image*``)
and of the quickstart pair, and prove the checker fails on a missing node, a missing or undeclared input, a wrong
link type, an illegal COMBO value, an out-of-range number and a miscounted ``widgets_values``.
"""
import copy
import json
from pathlib import Path

import pytest

from leandiffusion import NODE_CLASS_MAPPINGS
from leandiffusion.tests.workflows.checker import check_api, check_pair, check_ui
from leandiffusion.tests.workflows.specs import API_WORKFLOWS_DIR, PACK_ROOT, WORKFLOWS_DIR, combined, core_snapshot

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
ISSUE_WORKFLOWS = {"quickstart", "sdxl_4gb_product_shot", "sd15_fast", "lora_hot_swap", "batch_catalogue",
                   "image_edit", "upscale_only", "comfy_conditioning", "qwen_image_edit", "qwen_image_edit_batch"}
UI_FILES = sorted(WORKFLOWS_DIR.glob("*.json"))
NAMES = [p.name[:-len(".json")] for p in UI_FILES]
QUICKSTART_NODES = {"LeanModelLoader", "LeanFusedDDIMSampler", "LeanTiledVAEDecode"}
needs_quickstart_nodes = pytest.mark.skipif(
    not QUICKSTART_NODES <= set(NODE_CLASS_MAPPINGS),
    reason=f"the pack does not declare {sorted(QUICKSTART_NODES - set(NODE_CLASS_MAPPINGS))} yet")


@pytest.fixture(scope="module")
def specs():
    return combined()


def _pair(name):
    return (json.loads((WORKFLOWS_DIR / f"{name}.json").read_text()),
            json.loads((API_WORKFLOWS_DIR / f"{name}.api.json").read_text()))


# --------------------------------------------------------------------------------------------- the shipped files
def test_every_issue_workflow_ships_with_api_twin_and_thumbnail():
    missing = [f"{folder.name}/{name}{ext}" for name in sorted(ISSUE_WORKFLOWS)
               for folder, ext in ((WORKFLOWS_DIR, ".json"), (API_WORKFLOWS_DIR, ".api.json"),
                                   (WORKFLOWS_DIR, ".jpg"))
               if not (folder / f"{name}{ext}").is_file()]
    assert not missing, f"missing: {missing}"
    orphans = [p.name for p in API_WORKFLOWS_DIR.glob("*.api.json")
               if not (WORKFLOWS_DIR / f"{p.name[:-len('.api.json')]}.json").exists()]
    assert not orphans, f"API files without an editor twin: {orphans}"
    for name in NAMES:
        assert (API_WORKFLOWS_DIR / f"{name}.api.json").is_file(), f"{name}.json has no API twin"
        assert (WORKFLOWS_DIR / f"{name}.jpg").read_bytes()[:3] == b"\xff\xd8\xff", f"{name}.jpg is not a JPEG"


# ComfyUI's template browser (app/custom_node_manager.py, ComfyUI 0.3.64) lists ``<pack>/<folder>/*.json`` for these
TEMPLATE_FOLDERS = ("example_workflows", "example", "examples", "workflow", "workflows")


def test_the_template_browser_lists_only_editor_workflows():
    """Every file the template browser lists opens in the editor: an API-format file listed there showed a blank
    thumbnail and opened as an empty canvas with a schema-version alert."""
    listed = sorted(p for folder in TEMPLATE_FOLDERS for p in (PACK_ROOT / folder).glob("*.json"))
    assert listed, "no workflow is listed in the template browser"
    not_editor = []
    for path in listed:
        data = json.loads(path.read_text())
        if not (isinstance(data, dict) and isinstance(data.get("nodes"), list) and "links" in data):
            not_editor.append(f"{path.parent.name}/{path.name}")
    assert not not_editor, f"not editor workflows, move them to workflows_api/: {not_editor}"
    assert API_WORKFLOWS_DIR.name not in TEMPLATE_FOLDERS


@pytest.mark.parametrize("name", NAMES)
def test_editor_file_is_a_loadable_litegraph_workflow(name):
    ui, _ = _pair(name)
    assert ui["version"] == 0.4
    ids = [n["id"] for n in ui["nodes"]]
    assert len(ids) == len(set(ids)) and ui["last_node_id"] == max(ids)
    assert ui["last_link_id"] == max([rec[0] for rec in ui["links"]], default=0)
    for node in ui["nodes"]:
        assert len(node["pos"]) == 2 and len(node["size"]) == 2 and node["size"][0] > 0 and node["size"][1] > 0
    for group in ui["groups"]:
        assert group["title"] and len(group["bounding"]) == 4
    boxes = [(n["pos"][0], n["pos"][1], n["pos"][0] + n["size"][0], n["pos"][1] + n["size"][1]) for n in ui["nodes"]]
    overlaps = [(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:]
                if a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]]
    assert not overlaps, f"{name}: nodes overlap in the editor: {overlaps}"


@pytest.mark.parametrize("name", NAMES)
def test_shipped_workflow_matches_the_nodes_and_its_api_twin(specs, name):
    info, dynamic = specs
    ui, api = _pair(name)
    problems = check_pair(ui, api, info, dynamic)
    assert not problems, f"workflows/{name}: {len(problems)} problem(s):\n" + "\n".join(problems)


def test_core_snapshot_is_a_recorded_object_info():
    snap = core_snapshot()
    assert snap["comfyui_version"] and snap["object_info"]
    for name, spec in snap["object_info"].items():
        assert spec["name"] == name and "input" in spec and "output" in spec, name
    for name, inputs in snap["dynamic_combos"].items():
        assert all(i in spec_inputs for i in inputs
                   for spec_inputs in [[*snap["object_info"][name]["input"].get("required", {}),
                                        *snap["object_info"][name]["input"].get("optional", {})]]), name


# --------------------------------------------------------------------------------------------- negative tests
@pytest.fixture
def core_pair():
    ui = json.loads((FIXTURES / "core_image.json").read_text())
    api = json.loads((FIXTURES / "core_image_ui.expected.api.json").read_text())
    return ui, api


def test_checker_passes_the_hand_written_core_fixture(specs, core_pair):
    assert check_pair(*core_pair, *specs) == []


def test_checker_fails_on_a_missing_node(specs, core_pair):
    ui, api = copy.deepcopy(core_pair)
    next(n for n in ui["nodes"] if n["id"] == 2)["type"] = "NoSuchNode"
    api["2"]["class_type"] = "NoSuchNode"
    problems = check_pair(ui, api, *specs)
    assert "editor file: node 2 (NoSuchNode): unknown node type; neither the pack nor ComfyUI core declares it" \
        in problems
    assert "API file: node 2 (NoSuchNode): unknown node type; neither the pack nor ComfyUI core declares it" \
        in problems


@needs_quickstart_nodes
def test_checker_fails_on_a_missing_pack_node(specs):
    info, dynamic = specs
    ui, api = _pair("quickstart")
    info = {k: v for k, v in info.items() if k != "LeanTiledVAEDecode"}
    problems = check_pair(ui, api, info, dynamic)
    assert "API file: node 3 (LeanTiledVAEDecode): unknown node type; neither the pack nor ComfyUI core declares " \
           "it" in problems


def test_checker_fails_on_an_undeclared_and_a_missing_input(specs, core_pair):
    ui, api = copy.deepcopy(core_pair)
    api["2"]["inputs"]["widht"] = api["2"]["inputs"].pop("width")
    next(n for n in ui["nodes"] if n["id"] == 2)["inputs"][1]["name"] = "widht"
    next(n for n in ui["nodes"] if n["id"] == 2)["inputs"][1]["widget"]["name"] = "widht"
    problems = check_pair(ui, api, *specs)
    assert any(p.startswith("API file: node 2 (ImageScale): input 'widht' is not declared by the node") for p in problems)
    assert "API file: node 2 (ImageScale): required input 'width' is missing" in problems
    assert any(p.startswith("editor file: node 2 (ImageScale): input 'widht' is not declared") for p in problems)


@needs_quickstart_nodes
def test_checker_fails_when_a_pack_node_lacks_an_input_the_workflow_uses(specs):
    info, dynamic = specs
    ui, api = _pair("quickstart")
    info = copy.deepcopy(info)
    del info["LeanTiledVAEDecode"]["input"]["optional"]["lean_model"]
    info["LeanTiledVAEDecode"]["input_order"]["optional"].remove("lean_model")
    problems = check_pair(ui, api, info, dynamic)
    assert any(p.startswith("API file: node 3 (LeanTiledVAEDecode): input 'lean_model' is not declared by the node")
               for p in problems)
    assert any(p.startswith("editor file: node 3 (LeanTiledVAEDecode): input 'lean_model' is not declared")
               for p in problems)


def test_checker_fails_on_a_wrong_link_type(specs, core_pair):
    ui, api = copy.deepcopy(core_pair)
    api["4"]["inputs"]["images"] = ["1", 0]
    api["1"]["class_type"] = "LoadImage"
    api["1"]["inputs"] = {"image": "example.png"}
    api["4"]["inputs"]["images"] = ["1", 1]  # LoadImage's MASK into SaveImage's IMAGE
    assert "node 4 (SaveImage): input 'images' expects IMAGE but is linked to output 1 of node 1 (LoadImage), " \
           "which is MASK" in check_api(api, *specs)
    link = next(rec for rec in ui["links"] if rec[0] == 5)  # ImageInvert -> SaveImage
    link[5] = "MASK"
    assert "link 5: node 3 (ImageInvert) output 0 is IMAGE, node 4 (SaveImage) input 'images' expects IMAGE, " \
           "the link says MASK" in check_ui(ui, *specs)


@needs_quickstart_nodes
def test_checker_fails_on_a_pack_link_of_the_wrong_type(specs):
    info, dynamic = specs
    ui, api = copy.deepcopy(_pair("quickstart"))
    api["3"]["inputs"]["lean_model"] = ["2", 0]  # the sampler's LATENT into the decoder's LEAN_MODEL
    assert "node 3 (LeanTiledVAEDecode): input 'lean_model' expects LEAN_MODEL but is linked to output 0 of node 2 " \
           "(LeanFusedDDIMSampler), which is LATENT" in check_api(api, info, dynamic)


def test_checker_fails_on_bad_values_and_miscounted_widgets(specs, core_pair):
    ui, api = copy.deepcopy(core_pair)
    api["2"]["inputs"]["upscale_method"] = "sharpest"
    api["1"]["inputs"]["width"] = -5
    api["1"]["inputs"]["height"] = "tall"
    problems = check_api(api, *specs)
    assert any("node 2 (ImageScale): input 'upscale_method' = 'sharpest' is not one of its options" in p
               for p in problems)
    assert any(p.startswith("node 1 (EmptyImage): input 'width' = -5 is below its minimum") for p in problems)
    assert "node 1 (EmptyImage): input 'height' = 'tall' is not a valid INT value" in problems
    next(n for n in ui["nodes"] if n["id"] == 1)["widgets_values"].append(7)
    assert any(p.startswith("node 1 (EmptyImage): widgets_values has 5 values, the node's widgets need 4")
               for p in check_ui(ui, *specs))


def test_checker_fails_when_editor_and_api_files_disagree(specs, core_pair):
    ui, api = copy.deepcopy(core_pair)
    api["2"]["inputs"]["height"] = 25
    problems = check_pair(ui, api, *specs)
    assert "node 2 differs between the editor and API files: 'height': editor 24 vs API 25" in problems


@needs_quickstart_nodes
def test_checker_takes_any_file_name_for_file_list_combos_only(specs):
    info, dynamic = specs
    assert ("LeanModelLoader", "model") in dynamic and ("LoadImage", "image") in dynamic
    assert ("LeanModelLoader", "vram_policy") not in dynamic
    _, api = copy.deepcopy(_pair("quickstart"))
    api["1"]["inputs"]["model"] = "my_own_model.safetensors"
    assert check_api(api, info, dynamic) == []
    api["1"]["inputs"]["vram_policy"] = "turbo"
    assert any("input 'vram_policy' = 'turbo' is not one of its options" in p for p in check_api(api, info, dynamic))

"""Malformed workflow files and a stalled image download, run through the CLI against the in-process fake ComfyUI.

Guards the exit-code promise of ``runner/cli.py`` (0 / 2 / 3 / 4 / 130, never a traceback's exit 1):
- a ``class_type`` that is not a string, ``inputs`` that are not an object (with or without ``--set``), a link
  whose id is ``null`` or whose slot is ``"x"``, a node entry that is not an object and JSON nested 100k deep each
  crashed the runner with a ``TypeError``/``AttributeError``/``ValueError``/``RecursionError``; they exit 2 with
  one ``error:`` line naming the bad value (as do the other wrongly typed fields a mutation of every field of the
  fixture workflows found);
- 3000 chained reroutes ended in a ``RecursionError``: the link resolution is a loop, so the chain converts;
- ``--timeout`` did not bound the image downloads (each waited the client's 60 s request timeout).
"""
import copy
import json
import time
from pathlib import Path

import pytest

from leandiffusion.runner.cli import main
from leandiffusion.runner.convert import apply_overrides
from leandiffusion.runner.errors import EXIT_EXECUTION, EXIT_INVALID, EXIT_OK, WorkflowError
from leandiffusion.tests.fixtures.fake_comfyui import FakeComfyUI

FIXTURES = Path(__file__).parent / "fixtures"
UI = json.loads((FIXTURES / "core_image.json").read_text())
API = json.loads((FIXTURES / "core_image.api.json").read_text())


@pytest.fixture
def fake():
    with FakeComfyUI() as server:
        yield server


def _run_file(fake, tmp_path, text, *args):
    path = tmp_path / "workflow.json"
    path.write_text(text)
    return main([str(path), "--server", fake.url, "-q", "--out", str(tmp_path / "out"), *args])


def _with(data, edit):
    data = copy.deepcopy(data)
    edit(data)
    return json.dumps(data)


def _first_api_node(data):
    return data[sorted(data)[0]]


MALFORMED = {
    "class_type a list": (_with(API, lambda d: _first_api_node(d).update(class_type=["EmptyImage"])),
                          "'class_type' is ['EmptyImage']"),
    "inputs a list": (_with(API, lambda d: _first_api_node(d).update(inputs=[1, 2])), "'inputs' is [1, 2]"),
    "link id null": (_with(UI, lambda d: d["links"][0].__setitem__(0, None)), "must be integers"),
    "link slot 'x'": (_with(UI, lambda d: d["links"][0].__setitem__(2, "x")), "must be integers"),
    "node entry a number": (_with(UI, lambda d: d["nodes"].append(5)), "'nodes' entry 8 is 5, not a node object"),
    "node inputs a string": (_with(UI, lambda d: d["nodes"][0].update(inputs="x")), "'inputs' is 'x'"),
    "node type a list": (_with(UI, lambda d: d["nodes"][0].update(type=["EmptyImage"])), "'type' is ['EmptyImage']"),
    "links a number": (_with(UI, lambda d: d.update(links=5)), "'links' is 5, not a list"),
    "extra a list": (_with(UI, lambda d: d.update(extra=[])), "'extra' is [], not a dict"),
    "socket name a list": (_with(UI, lambda d: d["nodes"][3]["inputs"][0].update(name=["a"])), "socket objects"),
    "socket widget a string": (_with(UI, lambda d: d["nodes"][3]["inputs"][1].update(widget="w")), "socket objects"),
    "output links a number": (_with(UI, lambda d: d["nodes"][0]["outputs"][0].update(links=1)), "socket objects"),
    "widgets_values a number": (_with(UI, lambda d: d["nodes"][0].update(widgets_values=3)),
                                "'widgets_values' is 3"),
    "JSON nested 100k deep": ("[" * 100_000 + "]" * 100_000, "nests JSON deeper than 64 levels"),
    "JSON nested 65 deep": (json.dumps({"nodes": [], "extra": json.loads("[" * 64 + "]" * 64)}),
                            "nests JSON deeper than 64 levels"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_workflow_exits_2_with_one_plain_line(fake, tmp_path, capsys, case):
    text, expected = MALFORMED[case]
    code = _run_file(fake, tmp_path, text, "--set", "1.width=8")
    err = capsys.readouterr().err
    assert code == EXIT_INVALID, err
    assert "Traceback" not in err and err.startswith("error: ") and expected in err
    assert not fake.prompts


def test_overrides_refuse_inputs_that_are_not_an_object():
    """``apply_overrides`` is public: called without the loader's checks it still refuses, naming the node."""
    with pytest.raises(WorkflowError, match=r"--set 1.width: node 1's 'inputs' is \[\]"):
        apply_overrides({"1": {"class_type": "EmptyImage", "inputs": []}}, [("1", "width", 8)])


def _reroute_chain(n: int) -> dict:
    """EmptyImage -> n Reroutes -> SaveImage, as the editor saves it."""
    nodes = [{"id": 1, "type": "EmptyImage", "mode": 0, "inputs": [],
              "outputs": [{"name": "IMAGE", "type": "IMAGE", "links": [1]}], "widgets_values": [8, 8, 1, 0]}]
    links = []
    for i in range(n):
        nid = 2 + i
        nodes.append({"id": nid, "type": "Reroute", "mode": 0, "inputs": [{"name": "", "type": "*", "link": i + 1}],
                      "outputs": [{"name": "", "type": "IMAGE", "links": [i + 2]}]})
        links.append([i + 1, nid - 1, 0, nid, 0, "IMAGE"])
    save = n + 2
    nodes.append({"id": save, "type": "SaveImage", "mode": 0, "inputs": [{"name": "images", "type": "IMAGE",
                                                                         "link": n + 1}], "widgets_values": ["c"]})
    links.append([n + 1, save - 1, 0, save, 0, "IMAGE"])
    return {"nodes": nodes, "links": links}


def test_thousands_of_chained_reroutes_convert(fake, tmp_path, capsys):
    code = _run_file(fake, tmp_path, json.dumps(_reroute_chain(3000)), "--convert-only")
    out, err = capsys.readouterr()
    assert code == EXIT_OK, err
    prompt = json.loads(out)
    assert sorted(prompt) == ["1", "3002"] and prompt["3002"]["inputs"]["images"] == ["1", 0]


class _StalledViews(dict):
    """``FakeComfyUI.files`` whose lookups stall, as a server that stops sending mid-download does."""

    def get(self, key, default=None):
        time.sleep(8)
        return default


def test_a_stalled_download_ends_at_timeout_with_exit_3(fake, tmp_path, capsys):
    fake.files = _StalledViews()
    start = time.monotonic()
    code = main([str(FIXTURES / "core_image.api.json"), "--server", fake.url, "-q", "--out", str(tmp_path / "out"),
                 "--timeout", "2"])
    elapsed = time.monotonic() - start
    err = capsys.readouterr().err
    assert code == EXIT_EXECUTION, err
    assert "within --timeout" in err and elapsed < 5

"""``runner/progress.py``: the node bar counts every node once, cached ones included, and never raises.

Guards: nodes ComfyUI reports as cached (``execution_cached``, every run after the first) advance the bar; a node
reported twice or not in the prompt is not counted; without tqdm each node is one plain line on stderr, and stdout stays
empty.
"""
import io

from leandiffusion.runner.progress import RunProgress
from leandiffusion.tests.kit.faults import refuse_import

PROMPT = {"1": {"class_type": "EmptyImage"}, "2": {"class_type": "ImageInvert"}, "3": {"class_type": "SaveImage"}}
EVENTS = [("execution_start", {}), ("execution_cached", {"nodes": ["1", "99"]}),
          ("executing", {"node": "2"}), ("progress", {"value": 1, "max": 2}), ("executed", {"node": "2"}),
          ("executing", {"node": "3"}), ("executed", {"node": "3"}), ("executed", {"node": "3"}),
          ("executing", {"node": None})]


def test_cached_and_run_nodes_each_count_once():
    stream = io.StringIO()
    progress = RunProgress(PROMPT, stream=stream)
    for kind, data in EVENTS:
        progress.event(kind, data)
    assert progress.done == {"1", "2", "3"} and progress._bar.n == 3
    progress.close()


def test_without_tqdm_each_node_is_one_line(monkeypatch, capsys):
    refuse_import(monkeypatch, "tqdm")
    stream = io.StringIO()
    with RunProgress(PROMPT, stream=stream) as progress:
        assert progress._bar is None
        for kind, data in EVENTS:
            progress.event(kind, data)
    assert stream.getvalue().splitlines() == ["running node 2 ImageInvert", "running node 3 SaveImage"]
    assert progress.done == {"1", "2", "3"}
    assert capsys.readouterr().out == ""


def test_a_node_without_an_executed_message_counts_when_the_next_one_starts():
    """ComfyUI sends ``executed`` only for nodes with UI output (SaveImage, PreviewImage): every other node is
    finished when the next ``executing`` arrives, and the last one by ``executing`` with ``node: null``."""
    progress = RunProgress(PROMPT, stream=io.StringIO())
    for kind, data in [("execution_start", {}), ("executing", {"node": "1"}), ("executing", {"node": "2"}),
                       ("executing", {"node": "3"}), ("executed", {"node": "3"}), ("executing", {"node": None})]:
        progress.event(kind, data)
        if kind == "executing" and data["node"] == "3":
            assert progress.done == {"1", "2"} and progress._bar.n == 2
    assert progress.done == {"1", "2", "3"} and progress._bar.n == 3
    progress.close()

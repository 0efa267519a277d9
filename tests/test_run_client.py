"""``runner/client.py`` against answers ComfyUI (or something in front of it) can give, one case at a time.

Guards:
- every refusal kind ComfyUI 0.3.64's ``validate_inputs``/``validate_prompt`` writes (``execution.py``) becomes one
  plain sentence naming the input and the value (bodies shaped as that file builds them);
- a non-JSON answer to ``POST /prompt`` (a proxy's 502 page, another service) was reported as a refused workflow
  (exit 2, "invalid workflow"); it is no ComfyUI answer, so it is ``ServerUnreachable`` (exit 4) like a non-JSON
  ``GET``;
- an output listed with a subfolder outside ``--out`` (``../``, absolute) is refused before anything is fetched;
  a ``/view`` error names the image; a write that fails midway (disk full, Ctrl-C) leaves no partial file;
- without websocket-client the run is followed by polling ``/history``; websocket frames that are not ComfyUI
  JSON messages are skipped; a failed run's history without messages still fails with a plain line.
"""
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from leandiffusion.runner.client import ComfyClient, describe_refusal, explain_error
from leandiffusion.runner.errors import ExecutionFailed, ServerUnreachable
from leandiffusion.tests.kit.faults import refuse_import


# --------------------------------------------------------------------------------------------- refusals
def _input_error(kind, name, value, config, **extra):
    return {"type": kind, "message": "m", "details": f"{name}", **extra,
            "extra_info": {"input_name": name, "input_config": config, "received_value": value}}


@pytest.mark.parametrize("err,sentence", [
    (_input_error("value_bigger_than_max", "steps", 20000, ["INT", {"min": 1, "max": 10000}]),
     "input 'steps' = 20000 is above its maximum 10000"),
    (_input_error("value_not_in_list", "sampler_name", "ddim2", [["euler", "ddim"], {}]),
     "input 'sampler_name' = 'ddim2' is not one of the allowed values (euler, ddim)"),
    # more than 20 options: ComfyUI sends no input_config and says "(list of length N)" in the details
    ({"type": "value_not_in_list", "message": "Value not in list", "details": "ckpt_name: 'x' not in (list of length "
      "25)", "extra_info": {"input_name": "ckpt_name", "input_config": None, "received_value": "x"}},
     "input 'ckpt_name' = 'x' is not one of the allowed values ((list of length 25))"),
    (_input_error("bad_linked_input", "image", ["5"], ["IMAGE", {}]),
     "input 'image' is a malformed link [\"5\"]; a link is [node_id, output_index]"),
    ({"type": "custom_validation_failed", "message": "Custom validation failed for node",
      "details": "image - Invalid image file: x.png", "extra_info": {"input_name": "image"}},
     "input 'image' was refused by the node's own check: image - Invalid image file: x.png"),
    ({"type": "exception_during_validation", "message": "Exception when validating node",
      "details": "list index out of range", "extra_info": {"exception_type": "IndexError", "traceback": []}},
     "validation raised an exception: list index out of range"),
    ({"type": "some_future_kind", "message": "Something new", "details": "about width"},
     "Something new: about width"),
    # no input_name in extra_info (a custom node's own entry, older servers): the name is read from the details,
    # which ComfyUI starts with it ("width", "ckpt_name: 'x' not in [...]", "width, received_type(...)")
    ({"type": "required_input_missing", "message": "Required input is missing", "details": "width"},
     "required input 'width' is missing"),
    ({"type": "value_not_in_list", "message": "Value not in list", "details": "ckpt_name: 'x' not in ['a', 'b']",
      "extra_info": {"input_config": [["a", "b"], {}], "received_value": "x"}},
     "input 'ckpt_name' = 'x' is not one of the allowed values (a, b)"),
])
def test_every_refusal_kind_is_one_sentence(err, sentence):
    assert explain_error(err) == sentence
    body = {"error": {"type": "prompt_outputs_failed_validation"}, "node_errors": {"3": {
        "errors": [err], "class_type": "KSampler"}}}
    assert describe_refusal(body) == [f"node 3 (KSampler): {sentence}"]


@pytest.mark.parametrize("body,line", [
    ({"error": {"type": "prompt_no_outputs", "message": "Prompt has no outputs", "details": "", "extra_info": {}},
      "node_errors": []}, "the workflow has no output node (such as SaveImage), so ComfyUI has nothing to run"),
    ({"error": {"type": "invalid_prompt", "message": "Cannot execute because of reasons", "details": "x"}},
     "Cannot execute because of reasons: x"),
    ({"detail": "nothing ComfyUI says"}, 'ComfyUI refused the workflow: {"detail": "nothing ComfyUI says"}'),
])
def test_whole_prompt_refusals_are_one_line(body, line):
    assert describe_refusal(body) == [line]


# --------------------------------------------------------------------------------------------- a canned server
class Canned:
    """A stdlib HTTP server answering each (method, path) with a canned (status, bytes), or with what a callable
    returns; records requests."""

    def __init__(self, answers: dict):
        self.answers, self.requests = answers, []
        canned = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, method):
                path = self.path.split("?", 1)[0]
                canned.requests.append((method, self.path))
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                answer = canned.answers.get((method, path), (404, b'{"error": "not found"}'))
                status, data = answer() if callable(answer) else answer
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._answer("GET")

            def do_POST(self):
                self._answer("POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"127.0.0.1:{self.server.server_address[1]}"  # no scheme: the client adds http://
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def canned():
    servers = []

    def start(answers):
        servers.append(Canned(answers))
        return servers[-1]
    yield start
    for s in servers:
        s.close()


def test_a_non_json_answer_to_post_prompt_is_no_comfyui_answer(canned):
    server = canned({("POST", "/prompt"): (502, b"<html><body>502 Bad Gateway</body></html>")})
    client = ComfyClient(server.url)
    assert client.base_url.startswith("http://")
    with pytest.raises(ServerUnreachable, match=r"answered 502 to POST /prompt with a non-JSON body "
                                                r"\('<html><body>502 Bad Gateway.*'\); is this a ComfyUI server"):
        client.submit({"1": {"class_type": "SaveImage", "inputs": {}}}, "client")


@pytest.mark.parametrize("answer,match", [
    ((500, b'{"error": "boom"}'), r"answered 500 to GET /object_info"),
    ((200, b"<html>not json</html>"), r"/object_info did not answer JSON; is this a ComfyUI server\?"),
])
def test_get_answers_that_are_not_comfyuis_are_unreachable(canned, answer, match):
    server = canned({("GET", "/object_info"): answer})
    with pytest.raises(ServerUnreachable, match=match):
        ComfyClient(server.url).object_info()


def test_a_failed_cancel_is_logged_not_raised(caplog):
    client = ComfyClient("http://127.0.0.1:9", request_timeout=2)  # discard port: nothing listens
    client.cancel("p-1")
    assert "could not cancel prompt p-1" in caplog.text


def test_history_and_queue_that_are_not_json_count_as_unknown(canned):
    server = canned({("GET", "/queue"): (200, b"not json"), ("GET", "/history/p-1"): (200, b"[]")})
    client = ComfyClient(server.url)
    assert client.in_queue("p-1") is None and client.history("p-1") is None


def test_a_failed_run_without_messages_still_fails_plainly(canned):
    entry = {"p-1": {"status": {"status_str": "error", "completed": False, "messages": []}, "outputs": {}}}
    server = canned({("GET", "/history/p-1"): (200, json.dumps(entry).encode())})
    with pytest.raises(ExecutionFailed, match=r"ComfyUI reports the run failed \(see its log\)"):
        ComfyClient(server.url).follow("p-1", None, timeout=5, poll_interval=0.05)


# --------------------------------------------------------------------------------------------- websocket
class FakeSocket:
    def __init__(self, frames):
        self.frames = list(frames)

    def settimeout(self, value):
        pass

    def recv(self):
        return self.frames.pop(0)


def test_frames_that_are_not_comfyui_messages_are_skipped(canned):
    entry = {"p-1": {"status": {"status_str": "success", "completed": True, "messages": []}, "outputs": {}}}
    server = canned({("GET", "/history/p-1"): (200, json.dumps(entry).encode())})
    frames = [b"\x00\x01binary preview", "not json", "[1, 2]",
              json.dumps({"type": "executing", "data": {"node": "4", "prompt_id": "other"}}),
              json.dumps({"type": "executing", "data": {"node": "4", "prompt_id": "p-1"}}),
              json.dumps({"type": "execution_success", "data": {"prompt_id": "p-1"}})]
    seen = []
    result = ComfyClient(server.url).follow("p-1", FakeSocket(frames), timeout=10,
                                             on_event=lambda kind, data: seen.append((kind, data.get("prompt_id"))),
                                             poll_interval=5)
    assert result == entry["p-1"]
    assert seen == [("executing", "p-1"), ("execution_success", "p-1")]  # the other prompt's message is skipped


def test_only_this_prompts_end_of_execution_ends_the_run(canned):
    """``executing`` with ``node: null`` ends the run only when it names this prompt; one without a prompt id is
    passed to the display and following goes on (here to the node error that comes next), instead of waiting for
    a history entry that is not written yet."""
    server = canned({("GET", "/history/p-1"): (200, b"{}")})
    frames = [json.dumps({"type": "executing", "data": {"node": None}}),
              json.dumps({"type": "execution_error", "data": {"prompt_id": "p-1", "node_id": "2",
                                                             "node_type": "ImageScale", "exception_type": "ValueError",
                                                             "exception_message": "bad size"}})]
    with pytest.raises(ExecutionFailed) as info:
        ComfyClient(server.url).follow("p-1", FakeSocket(frames), timeout=2, poll_interval=5)
    assert info.value.lines == ["node 2 (ImageScale) failed: ValueError: bad size"]


def test_without_websocket_client_the_run_is_polled(monkeypatch, caplog):
    refuse_import(monkeypatch, "websocket")
    assert ComfyClient("http://127.0.0.1:9").open_websocket("client") is None
    assert "websocket-client is not installed; following the run by polling /history" in caplog.text


def test_success_announced_before_the_history_is_written_waits_for_it(canned):
    """ComfyUI announces success just before it writes the history entry: the runner asks again until it is there,
    and gives up with a plain line when it never comes."""
    entry = {"p-1": {"status": {"status_str": "success", "completed": True, "messages": []}, "outputs": {}}}
    asked = []

    def history():
        asked.append(1)
        return 200, (json.dumps(entry) if len(asked) > 2 else "{}").encode()

    server = canned({("GET", "/history/p-1"): history})
    done = [json.dumps({"type": "execution_success", "data": {"prompt_id": "p-1"}})]
    assert ComfyClient(server.url).follow("p-1", FakeSocket(done), timeout=10, poll_interval=5) == entry["p-1"]
    assert len(asked) == 3
    never = canned({("GET", "/history/p-1"): (200, b"{}")})
    with pytest.raises(ExecutionFailed, match=r"ComfyUI has no history for prompt p-1 after it finished"):
        ComfyClient(never.url).follow("p-1", FakeSocket(list(done)), timeout=0.5, poll_interval=5)


# --------------------------------------------------------------------------------------------- images
@pytest.mark.parametrize("subfolder", ["../outside", "/etc", "a/../../b"])
def test_an_output_outside_the_out_folder_is_refused_before_fetching(canned, tmp_path, subfolder):
    server = canned({})
    entry = {"outputs": {"9": {"images": [{"filename": "x.png", "subfolder": subfolder, "type": "output"}]}}}
    with pytest.raises(ExecutionFailed, match=r"ComfyUI listed an output image with an unusable name"):
        ComfyClient(server.url).save_images(entry, tmp_path / "out")
    assert server.requests == [] and not (tmp_path / "out").exists()


def test_an_image_view_refuses_is_named(canned, tmp_path):
    server = canned({("GET", "/view"): (404, b"")})
    entry = {"outputs": {"9": {"images": [{"filename": "x.png", "subfolder": "sub", "type": "output"}]}}}
    with pytest.raises(ExecutionFailed, match=r"could not fetch output image sub/x.png from /view \(HTTP 404\)"):
        ComfyClient(server.url).save_images(entry, tmp_path)


@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_a_write_failing_midway_leaves_no_partial_file(canned, tmp_path, monkeypatch, failure):
    server = canned({("GET", "/view"): (200, b"\x89PNG" + bytes(1000))})
    entry = {"outputs": {"9": {"images": [{"filename": "x.png", "subfolder": "", "type": "output"}]}}}
    real_fdopen = os.fdopen

    class Failing:
        def __init__(self, fd, mode):
            self.file = real_fdopen(fd, mode)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()
            return False

        def write(self, data):
            self.file.write(data[:10])
            raise failure

    monkeypatch.setattr(os, "fdopen", Failing)
    expected = ExecutionFailed if isinstance(failure, OSError) else KeyboardInterrupt
    with pytest.raises(expected) as info:
        ComfyClient(server.url).save_images(entry, tmp_path)
    if expected is ExecutionFailed:
        assert f"could not save x.png in {tmp_path}: No space left on device" in str(info.value)
    assert list(Path(tmp_path).iterdir()) == []

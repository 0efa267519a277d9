"""The runner's failure paths a user hits, against in-process fake servers (no ComfyUI, no GPU).

Each test names the bug it guards. The promise (runner/cli.py): one plain ``error:`` line per problem and an exit
code of 2 / 3 / 4, never a Python traceback; a run never waits out ``--timeout`` for a prompt that is gone; the
images of a finished run are not lost to a bad ``--out``.
"""
import json
import socket
import threading
import time
from pathlib import Path

import pytest

from leandiffusion.runner.cli import main
from leandiffusion.runner.errors import EXIT_EXECUTION, EXIT_INVALID, EXIT_OK, EXIT_UNREACHABLE
from leandiffusion.tests.fixtures.fake_comfyui import FakeComfyUI
from leandiffusion.tests.kit.runner_process import runner_process

FIXTURES = Path(__file__).parent / "fixtures"
API = str(FIXTURES / "core_image.api.json")


class QueueFake(FakeComfyUI):
    """The fixture's fake plus ``GET /queue`` (ComfyUI 0.3.64's shape) and four more behaviours:
    ``vanish`` (a prompt is accepted but then deleted from the queue, as by another client's /queue delete or
    "Clear queue"), ``interrupt_node`` (that node is interrupted, as by the editor's Cancel button) and
    ``drop_ws_after`` (the websocket is cut after that many seconds of a run while the run goes on, as a proxy
    with an idle timeout does) and ``answer_delay`` (``POST /prompt`` answers that many seconds after the run
    started, as a busy server may)."""

    def __init__(self):
        super().__init__()
        self.answer_delay = 0.0
        self.vanish = False
        self.interrupt_node = None
        self.drop_ws_after = None
        self.running: dict[str, dict] = {}
        self.ws_socks: dict[str, socket.socket] = {}

    def handle_prompt(self, body):
        if self.vanish:
            self.prompts.append(body)
            return 200, {"prompt_id": "gone-1", "number": 1, "node_errors": {}}
        answer = super().handle_prompt(body)
        time.sleep(self.answer_delay)
        return answer

    def _execute(self, prompt_id, prompt, client_id):
        self.running[prompt_id] = prompt
        try:
            if self.drop_ws_after is not None:
                time.sleep(self.drop_ws_after)
                for sock in list(self.ws_socks.values()):
                    sock.shutdown(socket.SHUT_RDWR)
                time.sleep(0.3)
            if self.interrupt_node is not None:
                messages = [["execution_start", {"prompt_id": prompt_id}]]
                data = {"prompt_id": prompt_id, "node_id": self.interrupt_node,
                        "node_type": prompt[self.interrupt_node]["class_type"], "executed": []}
                self.send(client_id, "execution_interrupted", data)
                messages.append(["execution_interrupted", data])
                self.history[prompt_id] = {"prompt": [0, prompt_id, prompt, {}, []], "outputs": {},
                                           "status": {"status_str": "error", "completed": False,
                                                      "messages": messages}, "meta": {}}
                return
            super()._execute(prompt_id, prompt, client_id)
        finally:
            self.running.pop(prompt_id, None)

    def _handler_class(self):
        base = super()._handler_class()
        fake = self

        class Handler(base):
            def do_GET(self):
                if self.path == "/queue":
                    running = [[0, pid, p, {}, []] for pid, p in list(fake.running.items())
                               if pid not in fake.history]
                    return self._json(200, {"queue_running": running, "queue_pending": []})
                return super().do_GET()

            def _websocket(self, client_id):
                fake.ws_socks[client_id] = self.connection
                return super()._websocket(client_id)

        return Handler


@pytest.fixture
def fake():
    with QueueFake() as server:
        yield server


def _error_lines(capsys):
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]


# --------------------------------------------------------------------------------------------- the run
def test_prompt_removed_from_the_queue_is_reported_at_once(fake, tmp_path, capsys):
    # Bug: a prompt deleted from ComfyUI's queue (another client, "Clear queue", a restarted server) never gets a
    # history entry; the runner waited out the whole --timeout and then blamed the timeout.
    fake.vanish = True
    start = time.monotonic()
    code = main([API, "--server", fake.url, "-q", "--out", str(tmp_path), "--timeout", "30"])
    assert code == EXIT_EXECUTION
    assert time.monotonic() - start < 15
    lines = _error_lines(capsys)
    assert len(lines) == 1 and "no longer in ComfyUI's queue" in lines[0] and "--timeout" not in lines[0]


def test_a_running_prompt_is_not_mistaken_for_a_removed_one(fake, tmp_path):
    fake.drop_websocket = True  # polling only: the queue is asked while the prompt runs
    fake.hang = True
    assert main([API, "--server", fake.url, "-q", "--out", str(tmp_path), "--timeout", "2.5"]) == EXIT_EXECUTION
    assert [path for path, _ in fake.cancelled] == ["/queue", "/interrupt"]  # a timeout, not "removed"


@pytest.mark.parametrize("websocket", [True, False])
def test_interruption_on_the_server_is_named_with_or_without_websocket(fake, tmp_path, capsys, websocket):
    # Bug: without a websocket (polling /history) a run cancelled in the editor said "ComfyUI reports the run
    # failed (see its log)"; the websocket path said what happened.
    fake.drop_websocket = not websocket
    fake.interrupt_node = "2"
    assert main([API, "--server", fake.url, "-q", "--out", str(tmp_path)]) == EXIT_EXECUTION
    lines = _error_lines(capsys)
    assert len(lines) == 1 and "interrupted on the server (node 2)" in lines[0]


def test_lost_websocket_falls_back_to_polling_and_saves_the_images(fake, tmp_path, capsys):
    # Bug: a websocket cut while ComfyUI ran on (a proxy's idle timeout) ended the runner with exit 4 and left
    # the prompt running on the server; the run's images were never fetched.
    fake.drop_ws_after = 0.5
    code = main([API, "--server", fake.url, "-q", "--out", str(tmp_path)])
    assert code == EXIT_OK, capsys.readouterr().err
    assert len(list(tmp_path.glob("*.png"))) == 2


# --------------------------------------------------------------------------------------------- --out
def test_out_that_is_a_file_is_refused_before_running(fake, tmp_path, capsys):
    # Bug: --out naming an existing file ran the whole workflow, then died with a FileExistsError traceback
    # (with --comfyui the images went away with the server's temporary folder).
    target = tmp_path / "results.png"
    target.write_bytes(b"mine")
    assert main([API, "--server", fake.url, "-q", "--out", str(target)]) == EXIT_INVALID
    lines = _error_lines(capsys)
    assert len(lines) == 1 and "--out" in lines[0] and "not a folder" in lines[0]
    assert not fake.prompts and target.read_bytes() == b"mine"


def test_out_under_a_file_is_refused_before_running(fake, tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    assert main([API, "--server", fake.url, "-q", "--out", str(tmp_path / "f" / "sub")]) == EXIT_INVALID
    assert "--out" in _error_lines(capsys)[0] and not fake.prompts


def test_out_in_a_folder_without_write_permission_is_refused_before_running(fake, tmp_path, capsys, monkeypatch):
    """The suite may run as root, who may write anywhere: os.access stands in for a read-only folder."""
    import os

    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False if Path(path) == tmp_path
                        else real_access(path, mode, **kw))
    assert main([API, "--server", fake.url, "-q", "--out", str(tmp_path / "new" / "sub")]) == EXIT_INVALID
    assert _error_lines(capsys) == [f"error: --out {tmp_path / 'new' / 'sub'}: no permission to write in {tmp_path}; "
                                    f"name another folder"]
    assert not fake.prompts


def test_save_failure_is_one_line_not_a_traceback(fake, tmp_path, capsys, monkeypatch):
    import os

    real_open = os.open

    def full_disk(path, *a, **k):
        if ".partial-" in str(path):
            raise OSError(28, "No space left on device")
        return real_open(path, *a, **k)

    monkeypatch.setattr(os, "open", full_disk)
    assert main([API, "--server", fake.url, "-q", "--out", str(tmp_path)]) == EXIT_EXECUTION
    lines = _error_lines(capsys)
    assert len(lines) == 1 and "No space left on device" in lines[0] and str(tmp_path) in lines[0]


def test_a_file_appearing_between_check_and_save_is_not_overwritten(fake, tmp_path, monkeypatch):
    """Two runners saving into one --out: the other one's file appears after this one looked for a free name.
    Simulated by an existence check that always says "free" while the file is there: the runner must still keep
    the other file and save its own under the next name."""
    first = main([API, "--server", fake.url, "-q", "--out", str(tmp_path)])
    assert first == EXIT_OK
    saved = sorted(p for p in tmp_path.rglob("*.png"))
    assert saved
    before = {p: p.read_bytes() for p in saved}
    for p in saved:  # mark the other runner's files, so that an overwrite is visible
        p.write_bytes(b"other runner " + before[p])
    fake._counter = 0  # the same names again, as a second server with a fresh output folder gives
    monkeypatch.setattr(Path, "exists", lambda self: False)
    assert main([API, "--server", fake.url, "-q", "--out", str(tmp_path)]) == EXIT_OK
    monkeypatch.undo()
    for p in saved:
        assert p.read_bytes() == b"other runner " + before[p]
    assert len(list(tmp_path.rglob("*.png"))) == 2 * len(saved)
    assert not list(tmp_path.rglob(".partial-*"))


def test_saving_falls_back_to_a_rename_without_hard_links(fake, tmp_path, monkeypatch):
    import errno
    import os

    def no_links(*a, **k):
        raise OSError(errno.EPERM, "Operation not permitted")

    assert main([API, "--server", fake.url, "-q", "--out", str(tmp_path)]) == EXIT_OK
    names = sorted(p.name for p in tmp_path.rglob("*.png"))
    fake._counter = 0
    monkeypatch.setattr(os, "link", no_links)
    assert main([API, "--server", fake.url, "-q", "--out", str(tmp_path)]) == EXIT_OK
    assert len(list(tmp_path.rglob("*.png"))) == 2 * len(names)
    assert not list(tmp_path.rglob(".partial-*"))


# --------------------------------------------------------------------------------------------- arguments
def test_binary_workflow_file_is_refused_plainly(fake, tmp_path, capsys):
    # Bug: a PNG (ComfyUI's images carry a workflow, users pass them) gave a UnicodeDecodeError traceback.
    png = tmp_path / "ComfyUI_00001_.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe")
    assert main([str(png), "--server", fake.url, "-q"]) == EXIT_INVALID
    lines = _error_lines(capsys)
    assert len(lines) == 1 and str(png) in lines[0] and "not a JSON text file" in lines[0]


def test_workflow_saved_with_a_utf8_bom_runs(fake, tmp_path):
    # Bug: a workflow re-saved by a Windows editor (UTF-8 with BOM) was "not valid JSON: Unexpected UTF-8 BOM".
    wf = tmp_path / "wf.api.json"
    wf.write_bytes(b"\xef\xbb\xbf" + Path(API).read_bytes())
    assert main([str(wf), "--server", fake.url, "-q", "--out", str(tmp_path / "out")]) == EXIT_OK


@pytest.mark.parametrize("url", ["http://127.0.0.1:abc", "http://", "ftp://127.0.0.1:8188"])
def test_malformed_server_url_is_named(url, capsys):
    # Bug: "--server http://127.0.0.1:abc" died with an http.client.InvalidURL traceback.
    assert main([API, "--server", url, "-q"]) == EXIT_INVALID
    lines = _error_lines(capsys)
    assert len(lines) == 1 and f"--server {url}" in lines[0]


def test_server_that_does_not_speak_http_exits_4(capsys):
    # Bug: --server pointing at a port of another service (here one that greets like SSH) died with a
    # http.client.BadStatusLine traceback instead of "not reachable" / exit 4.
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(5)

    def serve():
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            conn.recv(4096)
            conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        assert main([API, "--server", url, "-q"]) == EXIT_UNREACHABLE
    finally:
        sock.close()
    lines = _error_lines(capsys)
    assert len(lines) == 1 and url in lines[0] and "HTTP" in lines[0]


@pytest.mark.parametrize("flag", ["--timeout", "--start-timeout"])
@pytest.mark.parametrize("value", ["0", "-5", "nan", "soon"])
def test_timeouts_must_be_positive_seconds(fake, capsys, flag, value):
    # Bug: --timeout 0 or -5 queued the prompt (the server started loading the model) and cancelled it at once;
    # --timeout nan meant no limit at all.
    with pytest.raises(SystemExit) as info:
        main([API, "--server", fake.url, "-q", flag, value])
    assert info.value.code == EXIT_INVALID
    err = capsys.readouterr().err
    assert flag in err and repr(value) in err
    assert not fake.prompts


# --------------------------------------------------------------------------------------------- Ctrl-C
@pytest.mark.parametrize("answer_delay", [0.0, 20.0], ids=["while_following", "while_submitting"])
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_interrupting_the_runner_cancels_its_prompt_on_a_shared_server(fake, tmp_path, sig, answer_delay):
    # Promise: Ctrl-C (or SIGTERM) while waiting never leaves a --server busy with a prompt nobody waits for.
    # Bug (while_submitting): a signal that came while POST /prompt was in flight (the run had started, the answer
    # with its id had not arrived) cancelled nothing; the runner now asks for its own prompt_id, as ComfyUI allows.
    import signal

    fake.hang, fake.answer_delay = True, answer_delay
    with runner_process([API, "--server", fake.url, "-q", "--out", str(tmp_path / "out")]) as proc:
        deadline = time.monotonic() + 60
        while not fake.running and time.monotonic() < deadline:  # submitted and running
            time.sleep(0.05)
        assert fake.running
        proc.send_signal(getattr(signal, sig))
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130, stderr
    prompt_id = next(iter(fake.running))
    assert fake.cancelled == [("/queue", {"delete": [prompt_id]}), ("/interrupt", {"prompt_id": prompt_id})]
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())

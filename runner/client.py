"""A small client for ComfyUI's HTTP + websocket API (stdlib ``urllib`` and ``websocket-client`` only).

Invariant: every network failure surfaces as ``ServerUnreachable`` (exit 4), every refusal of the prompt as
``ValidationFailed`` (exit 2, one plain line per problem) and every failure while running as ``ExecutionFailed``
(exit 3). Downloads never leave a partial file: bytes go to a hidden temporary file in the target folder, which is
renamed into place only once complete.

Endpoints used (ComfyUI 0.3.x): ``GET /system_stats``, ``GET /object_info``, ``POST /prompt``
(``{"prompt", "client_id"}`` -> 200 ``{"prompt_id", "node_errors"}`` or 400 ``{"error", "node_errors"}``),
``GET /ws?clientId=`` (``execution_start``, ``execution_cached``, ``executing``, ``progress``, ``executed``,
``execution_success``, ``execution_error``, ``execution_interrupted``), ``GET /history/{id}``, ``GET /view``,
``POST /interrupt`` and ``POST /queue`` (``{"delete": [id]}``).
"""
from __future__ import annotations

import http.client
import json
import logging
import os
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Callable, Optional

from .errors import ExecutionFailed, ServerUnreachable, ValidationFailed
from .outputs import checked_output_name, place_without_overwriting

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------- messages
def _value(v: Any) -> str:
    text = json.dumps(v) if not isinstance(v, str) else repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def explain_error(err: dict) -> str:
    """One plain sentence for one entry of ComfyUI's ``node_errors[id]["errors"]``."""
    kind = err.get("type", "")
    extra = err.get("extra_info") or {}
    name = extra.get("input_name") or (err.get("details") or "").split(",")[0].split(":")[0] or "?"
    config = extra.get("input_config")
    expected = config[0] if isinstance(config, (list, tuple)) and config else None
    received = extra.get("received_value")
    if kind == "required_input_missing":
        return f"required input '{name}' is missing"
    if kind == "invalid_input_type":
        return f"input '{name}' = {_value(received)} is not a valid {expected} value"
    if kind == "return_type_mismatch":
        linked = extra.get("linked_node") or ["?", "?"]
        return (f"input '{name}' expects {expected} but is linked to output {linked[1]} of node {linked[0]}, "
                f"which gives {extra.get('received_type')}")
    if kind == "value_smaller_than_min":
        return f"input '{name}' = {_value(received)} is below its minimum {(config or [None, {}])[1].get('min')}"
    if kind == "value_bigger_than_max":
        return f"input '{name}' = {_value(received)} is above its maximum {(config or [None, {}])[1].get('max')}"
    if kind == "value_not_in_list":
        if isinstance(expected, list):
            allowed = ", ".join(map(str, expected[:10])) + (", ..." if len(expected) > 10 else "")
        else:
            allowed = (err.get("details") or "").rpartition(" not in ")[2] or "the node's menu"
        return f"input '{name}' = {_value(received)} is not one of the allowed values ({allowed})"
    if kind == "bad_linked_input":
        return f"input '{name}' is a malformed link {_value(received)}; a link is [node_id, output_index]"
    if kind == "custom_validation_failed":
        return f"input '{name}' was refused by the node's own check: {err.get('details')}"
    if kind in ("exception_during_validation", "exception_during_inner_validation"):
        return f"validation raised an exception: {err.get('details')}"
    return f"{err.get('message', 'error')}: {err.get('details', '')}".rstrip(": ")


def describe_refusal(body: Any) -> list[str]:
    """Plain lines, one per problem, for a ``POST /prompt`` refusal (or a 200 answer carrying ``node_errors``)."""
    lines: list[str] = []
    body = body if isinstance(body, dict) else {}
    node_errors = body.get("node_errors") or {}
    for node_id, entry in sorted(node_errors.items(), key=lambda kv: str(kv[0])):
        for err in entry.get("errors") or []:
            lines.append(f"node {node_id} ({entry.get('class_type', '?')}): {explain_error(err)}")
    error = body.get("error")
    if not lines and isinstance(error, dict):
        kind, details = error.get("type"), error.get("details") or ""
        if kind == "invalid_prompt" and "does not exist" in (error.get("message") or ""):
            node_type = error["message"].split("node ", 1)[-1].rsplit(" does not exist", 1)[0]
            where = details.replace("Node ID '#", "node ").rstrip("'") or "a node"
            lines.append(f"{where} ({node_type}): unknown node type; this ComfyUI does not provide it "
                         f"(install the node pack that does, or remove the node)")
        elif kind == "prompt_no_outputs":
            lines.append("the workflow has no output node (such as SaveImage), so ComfyUI has nothing to run")
        else:
            lines.append(f"{error.get('message', 'ComfyUI refused the workflow')}"
                         + (f": {details}" if details else ""))
    elif not lines:
        lines.append(f"ComfyUI refused the workflow: {json.dumps(body)[:300]}")
    return lines


def describe_execution_error(data: dict) -> list[str]:
    """Plain lines for an ``execution_error`` message (websocket or history)."""
    node = data.get("node_id", "?")
    line = (f"node {node} ({data.get('node_type', '?')}) failed: "
            f"{data.get('exception_type', 'Exception')}: {str(data.get('exception_message', '')).strip()}")
    return [line]


# --------------------------------------------------------------------------------------------- client
class ComfyClient:
    """Talks to one ComfyUI server at ``base_url`` (e.g. ``http://127.0.0.1:8188``)."""

    def __init__(self, base_url: str, request_timeout: float = 60.0):
        if not base_url.startswith(("http://", "https://")):
            base_url = "http://" + base_url
        self.base_url = base_url.rstrip("/")
        self.request_timeout = request_timeout

    # ----------------------------------------------------------------------------------------- HTTP
    def request(self, method: str, path: str, body: Any = None, query: Optional[dict] = None,
                timeout: Optional[float] = None) -> tuple[int, bytes]:
        url = self.base_url + path + ("?" + urllib.parse.urlencode(query) if query else "")
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data is not None else {})
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.request_timeout) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()
        except (urllib.error.URLError, ConnectionError, socket.timeout, TimeoutError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ServerUnreachable(f"ComfyUI is not reachable at {self.base_url}: {reason}") from exc
        except http.client.IncompleteRead as exc:  # the server went away in the middle of its answer
            raise ServerUnreachable(f"ComfyUI at {self.base_url} stopped answering in the middle of a reply "
                                    f"({exc})") from exc
        except http.client.HTTPException as exc:  # something answered, but not in HTTP (another service's port)
            raise ServerUnreachable(f"{self.base_url} did not answer in HTTP ({type(exc).__name__}: {exc}); "
                                    f"is this a ComfyUI server?") from exc

    def get_json(self, path: str, query: Optional[dict] = None, timeout: Optional[float] = None) -> Any:
        status, raw = self.request("GET", path, query=query, timeout=timeout)
        if status != 200:
            raise ServerUnreachable(f"ComfyUI at {self.base_url} answered {status} to GET {path}")
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise ServerUnreachable(f"{self.base_url}{path} did not answer JSON; is this a ComfyUI server?") from exc

    def ping(self, timeout: float = 5.0) -> dict:
        """``GET /system_stats``; raises ``ServerUnreachable`` when no ComfyUI answers."""
        return self.get_json("/system_stats", timeout=timeout)

    def object_info(self) -> dict:
        return self.get_json("/object_info")

    # ----------------------------------------------------------------------------------------- prompt
    def submit(self, prompt: dict, client_id: str, prompt_id: Optional[str] = None) -> str:
        """``POST /prompt``; returns the prompt id. Raises ``ValidationFailed`` with one line per problem.

        ``prompt_id`` asks for that id (ComfyUI takes a client-chosen one), so a caller interrupted while the
        request is in flight still knows which prompt to cancel; the id in the answer is the one to follow.

        A 200 answer that still lists ``node_errors`` means ComfyUI queued only the outputs that validated: the
        runner asked for the whole workflow, so that partial prompt is withdrawn and reported as a refusal.
        """
        body = {"prompt": prompt, "client_id": client_id}
        if prompt_id is not None:
            body["prompt_id"] = prompt_id
        status, raw = self.request("POST", "/prompt", body=body)
        try:
            body = json.loads(raw)
        except ValueError as exc:  # ComfyUI always answers JSON here: this is a proxy's error page or another service
            snippet = raw[:80].decode(errors="replace")
            raise ServerUnreachable(f"{self.base_url} answered {status} to POST /prompt with a non-JSON body "
                                    f"({snippet!r}); is this a ComfyUI server (or a proxy in front of one that "
                                    f"cannot reach it)?") from exc
        if status == 200 and isinstance(body, dict) and body.get("prompt_id"):
            if body.get("node_errors"):
                self.cancel(body["prompt_id"])
                raise ValidationFailed("ComfyUI refused part of the workflow", describe_refusal(body))
            return str(body["prompt_id"])
        lines = describe_refusal(body)
        raise ValidationFailed(lines[0], lines)

    def cancel(self, prompt_id: str) -> None:
        """Withdraw ``prompt_id`` from the queue and interrupt it if it runs (best effort, never raises)."""
        for path, body in (("/queue", {"delete": [prompt_id]}), ("/interrupt", {"prompt_id": prompt_id})):
            try:
                self.request("POST", path, body=body, timeout=5)
            except ServerUnreachable as exc:
                logger.warning("could not cancel prompt %s: %s", prompt_id, exc)

    def history(self, prompt_id: str) -> Optional[dict]:
        entry = self.get_json(f"/history/{urllib.parse.quote(prompt_id)}")
        return entry.get(prompt_id) if isinstance(entry, dict) else None

    def in_queue(self, prompt_id: str) -> Optional[bool]:
        """Whether ``GET /queue`` lists ``prompt_id`` as running or pending; ``None`` when the server cannot say."""
        status, raw = self.request("GET", "/queue")
        try:
            body = json.loads(raw) if status == 200 else None
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return None
        items = list(body.get("queue_running") or []) + list(body.get("queue_pending") or [])
        return any(isinstance(item, (list, tuple)) and len(item) > 1 and item[1] == prompt_id for item in items)

    # ----------------------------------------------------------------------------------------- websocket
    def open_websocket(self, client_id: str):
        """A connected ``websocket-client`` socket for ``/ws?clientId=``, or ``None`` (the runner then polls)."""
        try:
            import websocket  # websocket-client
        except ImportError:
            logger.warning("websocket-client is not installed; following the run by polling /history")
            return None
        url = "ws" + self.base_url[len("http"):] + "/ws?" + urllib.parse.urlencode({"clientId": client_id})
        try:
            return websocket.create_connection(url, timeout=10)
        except (OSError, websocket.WebSocketException) as exc:
            logger.warning("could not open %s (%s); following the run by polling /history", url, exc)
            return None

    def follow(self, prompt_id: str, ws, timeout: float, on_event: Callable[[str, dict], None] = lambda t, d: None,
               poll_interval: float = 1.0) -> dict:
        """Wait until ``prompt_id`` finished; return its ``/history`` entry.

        Events for this prompt go to ``on_event(type, data)`` (progress display). Raises ``ExecutionFailed`` on an
        execution error, a server-side interruption or when ``timeout`` seconds pass (the prompt is then cancelled).
        """
        deadline = time.monotonic() + timeout
        finished = False
        next_poll = time.monotonic() + poll_interval
        while not finished:
            now = time.monotonic()
            if now >= deadline:
                self.cancel(prompt_id)
                raise ExecutionFailed(f"the workflow did not finish within --timeout {timeout:g} s; it was cancelled")
            message = None
            if ws is not None:
                try:
                    message = self._receive(ws, min(poll_interval, deadline - now))
                except ServerUnreachable as exc:  # the run may go on (a proxy cut an idle socket): poll instead
                    logger.warning("%s; following the run by polling /history", exc)
                    ws = None
                    continue
            if ws is None:
                time.sleep(max(0.0, min(poll_interval, deadline - time.monotonic())))
            if message is not None:
                kind, data = message
                if data.get("prompt_id") not in (None, prompt_id):
                    continue
                on_event(kind, data)
                if kind == "execution_error":
                    raise ExecutionFailed("a node failed", describe_execution_error(data))
                if kind == "execution_interrupted":
                    raise ExecutionFailed(f"the run was interrupted on the server (node {data.get('node_id')})")
                if kind == "execution_success" or (kind == "executing" and data.get("node") is None
                                                   and data.get("prompt_id") == prompt_id):
                    finished = True
            if not finished and time.monotonic() >= next_poll:
                next_poll = time.monotonic() + poll_interval
                entry = self.history(prompt_id)
                finished = bool(entry and (entry.get("status") or {}).get("completed") is not None
                                and entry.get("status", {}).get("status_str") in ("success", "error"))
                # Neither finished nor queued (and still no history after asking the queue: it may have just
                # finished): deleted from the queue, the queue cleared, or the server restarted.
                if (entry is None and self.in_queue(prompt_id) is False
                        and self.history(prompt_id) is None):
                    raise ExecutionFailed(f"prompt {prompt_id} is no longer in ComfyUI's queue and has no result: "
                                          f"it was deleted from the queue (or the queue was cleared, or ComfyUI "
                                          f"restarted)")
        return self._final_history(prompt_id, deadline)

    @staticmethod
    def _receive(ws, wait: float) -> Optional[tuple[str, dict]]:
        import websocket

        ws.settimeout(max(wait, 0.01))
        try:
            frame = ws.recv()
        except websocket.WebSocketTimeoutException:
            return None
        except (OSError, websocket.WebSocketException) as exc:
            raise ServerUnreachable(f"lost the websocket connection to ComfyUI: {exc}") from exc
        if not isinstance(frame, str):
            return None  # binary preview frames
        try:
            msg = json.loads(frame)
        except ValueError:
            return None
        if not isinstance(msg, dict):
            return None
        return str(msg.get("type")), msg.get("data") if isinstance(msg.get("data"), dict) else {}

    def _final_history(self, prompt_id: str, deadline: float) -> dict:
        # ComfyUI writes the history entry just after it announces success: wait for it briefly.
        give_up = min(deadline, time.monotonic() + 30)
        while True:
            entry = self.history(prompt_id)
            if entry is not None and (entry.get("status") or {}).get("completed") is not None:
                break
            if time.monotonic() >= give_up:
                raise ExecutionFailed(f"ComfyUI has no history for prompt {prompt_id} after it finished")
            time.sleep(0.1)
        status = entry.get("status") or {}
        if status.get("status_str") == "error":
            for kind, data in status.get("messages") or []:
                if kind == "execution_error":
                    raise ExecutionFailed("a node failed", describe_execution_error(data))
                if kind == "execution_interrupted":
                    raise ExecutionFailed(f"the run was interrupted on the server (node {data.get('node_id')})")
            raise ExecutionFailed("ComfyUI reports the run failed (see its log)")
        return entry

    # ----------------------------------------------------------------------------------------- images
    def save_images(self, history_entry: dict, out_dir: Path, timeout: Optional[float] = None) -> list[Path]:
        """Download every image the run's output nodes list (``/view``) into ``out_dir``; return the paths.

        ``timeout`` bounds all the downloads together (the CLI's ``--timeout``): a stalled download fails with
        ``ExecutionFailed`` once it passes, instead of waiting ``request_timeout`` per image."""
        out_dir = Path(out_dir)
        deadline = time.monotonic() + timeout if timeout is not None else None
        saved = []
        for node_id in sorted(history_entry.get("outputs") or {}, key=str):
            for image in (history_entry["outputs"][node_id] or {}).get("images") or []:
                saved.append(self._download(image, out_dir, deadline))
        return saved

    def _download(self, image: dict, out_dir: Path, deadline: Optional[float] = None) -> Path:
        filename, subfolder, parts = checked_output_name(image, out_dir)
        query = {"filename": filename, "subfolder": subfolder, "type": image.get("type") or "output"}
        wait = self.request_timeout if deadline is None else min(self.request_timeout, deadline - time.monotonic())
        try:
            if wait <= 0:
                raise ServerUnreachable("no time left")
            status, data = self.request("GET", "/view", query=query, timeout=wait)
        except ServerUnreachable as exc:
            if deadline is None or time.monotonic() < deadline:
                raise
            raise ExecutionFailed(f"could not fetch output image {filename} within --timeout: {exc}") from exc
        if status != 200:
            raise ExecutionFailed(f"could not fetch output image {subfolder + '/' if subfolder else ''}{filename} "
                                  f"from /view (HTTP {status})")
        folder = out_dir.joinpath(*parts)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            tmp = folder / f".partial-{uuid.uuid4().hex}{Path(filename).suffix}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # umask applies, as for any saved file
        except OSError as exc:
            raise ExecutionFailed(f"could not save {filename} in {folder}: {exc.strerror or exc}") from exc
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            target = place_without_overwriting(tmp, folder / filename)
        except BaseException as exc:
            Path(tmp).unlink(missing_ok=True)
            if isinstance(exc, OSError):
                raise ExecutionFailed(f"could not save {filename} in {folder}: {exc.strerror or exc}") from exc
            raise
        return target

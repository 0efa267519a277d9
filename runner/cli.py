"""``python -m leandiffusion.run WORKFLOW.json``: run a ComfyUI workflow headless and save its images.

Invariant: the process exits with 0 (success), 2 (invalid workflow / validation error), 3 (execution error or
timeout), 4 (ComfyUI unreachable or failed to start) or 130 (interrupted), prints one plain line per problem on
stderr, and never leaves a server it started running (``LocalComfyUI`` is stopped on every path, Ctrl-C and
SIGTERM included).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
import urllib.parse
import uuid
from pathlib import Path
from typing import Optional, Sequence

from .client import ComfyClient
from .convert import apply_overrides, load_workflow, parse_override, ui_to_api
from .errors import (EXIT_INTERRUPTED, EXIT_OK, ExecutionFailed, RunnerError, ServerUnreachable, ValidationFailed,
                     WorkflowError)
from .local import LocalComfyUI, torch_has_accelerator
from .progress import RunProgress
from .tiny import (MODEL_INPUTS, class_types, files_needed, server_note, tiny_models_dir, tiny_notes, tiny_overrides,
                   write_files)

logger = logging.getLogger(__name__)


def _seconds(text: str) -> float:
    """argparse type for --timeout / --start-timeout: a positive number of seconds (``inf`` = no limit)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds (e.g. 600; inf = no limit)")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m leandiffusion.run",
        description="Run a ComfyUI workflow (API or editor format) headless and save every output image.",
        epilog="Exit codes: 0 success, 2 invalid workflow or validation error, 3 execution error or timeout, "
               "4 ComfyUI unreachable or failed to start, 130 interrupted.")
    p.add_argument("workflow", help="workflow file: API format (*.api.json) or editor (UI) format")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--server", metavar="URL", help="a running ComfyUI, e.g. http://127.0.0.1:8188")
    where.add_argument("--comfyui", metavar="PATH",
                       help="a ComfyUI folder to start headless with this pack (default: $COMFYUI_PATH)")
    p.add_argument("--out", metavar="DIR", default="out", help="where to save the output images (default: ./out)")
    p.add_argument("--set", dest="overrides", metavar="NODE.INPUT=VALUE", action="append", default=[],
                   help="override an input; NODE is a node id or a class type (all nodes of it); VALUE is parsed "
                        "as JSON when possible, else taken as a string. Repeatable.")
    p.add_argument("--tiny", action="store_true",
                   help="run without the workflow's models: the pack's tiny random stand-ins replace every model "
                        "input (listed on stderr; the pictures are noise), e.g. to try a workflow on a CPU-only "
                        "machine; --set applies after it")
    p.add_argument("--timeout", type=_seconds, default=600.0, metavar="S",
                   help="seconds the run may take once queued, downloading its images included (default: 600)")
    p.add_argument("--start-timeout", type=_seconds, default=180.0, metavar="S",
                   help="seconds a started ComfyUI may take to answer (default: 180)")
    p.add_argument("--python", metavar="EXE", help="interpreter for a started ComfyUI (default: $COMFYUI_PYTHON, "
                                                    "else PATH/.venv/bin/python, else this one)")
    p.add_argument("--cpu", action="store_true", help="start ComfyUI with --cpu")
    p.add_argument("--comfyui-arg", dest="comfyui_args", metavar="ARG", action="append", default=[],
                   help="extra argument for a started ComfyUI (repeatable), e.g. --comfyui-arg=--lowvram")
    p.add_argument("--models", metavar="DIR", default=os.environ.get("LEANDIFFUSION_MODELS"),
                   help="extra model folder (checkpoints/, diffusers/, loras/, upscale_models/ ...) for a started "
                        "ComfyUI (default: $LEANDIFFUSION_MODELS)")
    p.add_argument("--input-dir", metavar="DIR", help="input folder (LoadImage) for a started ComfyUI")
    p.add_argument("--comfyui-log", metavar="FILE", help="keep a started ComfyUI's log in FILE")
    p.add_argument("--convert-only", action="store_true",
                   help="print the API-format prompt (after conversion and --set) as JSON and exit without running")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    return p


def _read_workflow(path: str) -> tuple[str, dict]:
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise WorkflowError(f"cannot read workflow {path}: {exc.strerror or exc}") from exc
    try:
        text = raw.decode("utf-8-sig")  # editors on Windows may save UTF-8 with a byte-order mark
    except UnicodeDecodeError as exc:
        raise WorkflowError(f"workflow {path} is not a JSON text file (it is binary, e.g. an image); pass the "
                            f"workflow's .json file, or open the image in ComfyUI and use 'Export (API)'") from exc
    return load_workflow(text, source=path)


def _check_server_url(url: str) -> None:
    """Refuse a --server value that is no http(s) URL with a host and a valid port, naming it."""
    full = url if "://" in url else "http://" + url
    try:
        parts = urllib.parse.urlsplit(full)
        parts.port  # noqa: B018 -- raises ValueError for a non-numeric or out-of-range port
    except ValueError as exc:
        raise WorkflowError(f"--server {url}: not a URL like http://127.0.0.1:8188 ({exc})") from exc
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise WorkflowError(f"--server {url}: not a URL like http://127.0.0.1:8188 (it needs http:// or https:// "
                            f"and a host)")


def _check_out_dir(out: str) -> None:
    """Refuse an --out that cannot become a writable folder before anything runs (a run's images would be lost)."""
    path = Path(out)
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        what = "is a file" if probe == path else f"is under {probe}, which is a file"
        raise WorkflowError(f"--out {out} {what}, not a folder; name a folder for the images")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise WorkflowError(f"--out {out}: no permission to write in {probe}; name another folder")


def _check_known_nodes(prompt: dict, object_info: dict) -> None:
    problems = [f"node {nid} ({node['class_type']}): unknown node type; this ComfyUI does not provide it "
                f"(install the node pack that does, or remove the node)"
                for nid, node in prompt.items() if node.get("class_type") not in object_info]
    if problems:
        raise ValidationFailed(problems[0], problems)


def run_on_server(client: ComfyClient, kind: str, workflow: dict, args) -> int:
    """Convert, submit, follow and save; returns the exit code (raises ``RunnerError`` on failure)."""
    object_info = client.object_info()
    prompt = ui_to_api(workflow, object_info) if kind == "ui" else workflow
    _check_known_nodes(prompt, object_info)
    tiny = tiny_overrides(prompt, object_info) if args.tiny else []
    if not args.quiet:
        for line in tiny_notes(prompt, tiny):
            print(line, file=sys.stderr)
    prompt = apply_overrides(prompt, tiny + [parse_override(s) for s in args.overrides], object_info)
    if args.convert_only:
        print(json.dumps(prompt, indent=2))
        return EXIT_OK
    client_id = uuid.uuid4().hex
    ws = client.open_websocket(client_id)
    prompt_id = str(uuid.uuid4())  # chosen here, so a Ctrl-C cancels it even while POST /prompt is in flight
    queued = time.monotonic()
    try:
        prompt_id = client.submit(prompt, client_id, prompt_id=prompt_id)
        with RunProgress(prompt, quiet=args.quiet) as progress:
            entry = client.follow(prompt_id, ws, args.timeout, on_event=progress.event)  # cancels on timeout
    except ValidationFailed as exc:  # a model file that is not installed: say how to run without it
        if not args.tiny and any(f"input '{name}' = " in line for line in exc.lines for name in MODEL_INPUTS):
            exc.lines.append("  to try the workflow without its models, on the pack's tiny random stand-ins (the "
                             "pictures are noise): add --tiny")
        raise
    except KeyboardInterrupt:
        client.cancel(prompt_id)  # do not leave the prompt running on a server we do not own
        raise
    finally:
        if ws is not None:
            ws.close()
    saved = client.save_images(entry, Path(args.out), timeout=args.timeout - (time.monotonic() - queued))
    if saved:
        print(f"saved {len(saved)} image(s) to {Path(args.out).resolve()}:")
        for path in saved:
            print(f"  {path}")
    else:
        print("the workflow finished; it produced no images")
    return EXIT_OK


def _local_server(comfyui: str, args, workflow: tuple[str, dict]) -> LocalComfyUI:
    """The ComfyUI to start; with ``--cpu`` added (and said on stderr unless ``-q``) when its interpreter's torch
    sees no GPU, since ComfyUI would otherwise die with "Torch not compiled with CUDA enabled"; with ``--tiny``,
    with the stand-in files ``workflow`` (kind, workflow) needs in an extra model folder (``runner/tiny.py``)."""
    server = LocalComfyUI(comfyui, python=args.python, cpu=args.cpu, extra_args=args.comfyui_args,
                          models_dir=args.models, input_dir=args.input_dir, start_timeout=args.start_timeout,
                          log_path=args.comfyui_log)
    if args.tiny:  # the stand-in files the workflow's node types need, written by ComfyUI's own python
        folder = tiny_models_dir()
        write_files(server.python, server.pack_dir, folder, files_needed(class_types(*workflow)), quiet=args.quiet)
        server.extra_models_dirs.append(folder.resolve())
    device_flags = {"--cpu", "--directml"}
    if not args.cpu and not device_flags & {arg.split("=")[0] for arg in args.comfyui_args}:
        if torch_has_accelerator(server.python, cwd=server.comfyui_path) is False:
            server.cpu = True
            if not args.quiet:  # like "ComfyUI started at", an informational line
                print(f"note: the torch of ComfyUI's python ({server.python}) sees no GPU; starting ComfyUI with "
                      f"--cpu", file=sys.stderr)
    return server


def _run(args) -> int:
    for text in args.overrides:  # refuse a malformed --set before starting anything
        parse_override(text)
    kind, workflow = _read_workflow(args.workflow)
    if not args.convert_only:
        _check_out_dir(args.out)
    if args.server:
        _check_server_url(args.server)
        if args.tiny and not args.quiet:
            for line in server_note(files_needed(class_types(kind, workflow))):
                print(line, file=sys.stderr)
        return run_on_server(ComfyClient(args.server), kind, workflow, args)
    comfyui = args.comfyui or os.environ.get("COMFYUI_PATH")
    if not comfyui:
        raise WorkflowError("say where ComfyUI is: --server URL (a running ComfyUI), or --comfyui PATH / "
                            "COMFYUI_PATH (a ComfyUI folder to start headless)")
    with _local_server(comfyui, args, (kind, workflow)) as server:
        if not args.quiet:
            kept = f" (log: {server.log_file})" if args.comfyui_log else ""
            print(f"ComfyUI started at {server.url}{kept}", file=sys.stderr)
        try:
            return run_on_server(ComfyClient(server.url), kind, workflow, args)
        except (ValidationFailed, WorkflowError) as exc:  # "unknown node type" may mean: our pack did not import
            failure = server.pack_import_error()
            if not failure or not any("unknown node type" in line for line in exc.lines):
                raise
            reason = failure[-1].split("module for custom nodes:", 1)[-1].strip()
            raise ValidationFailed(f"the started ComfyUI could not import this pack: {reason}",
                                   [f"the started ComfyUI could not import this pack ({server.pack_dir}): {reason}; "
                                    f"install the pack's requirements.txt with ComfyUI's python ({server.python})",
                                    "  ComfyUI's log:"] + failure) from exc
        except ExecutionFailed as exc:  # the server's traceback is in its log, which goes away with the server
            exc.lines += ["  the end of ComfyUI's log:"] + server.log_tail(20)
            raise
        except ServerUnreachable as exc:  # our own server went away mid-run: say so, with the log that says why
            code = server.exited(wait=5)
            if code is None:
                raise
            raise ServerUnreachable(f"ComfyUI exited with code {code} during the run",
                                    [f"ComfyUI exited with code {code} during the run ({exc}); the end of its log:"]
                                    + server.log_tail(20)) from exc


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    previous = None
    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        try:  # SIGTERM behaves like Ctrl-C, so the started server is stopped on the way out
            previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
        except ValueError:  # not the main thread (e.g. called from a test thread)
            previous = None
    try:
        return _run(args)
    except RunnerError as exc:
        for line in exc.lines:  # one line per problem; indented lines are context (a server log's tail)
            print(line if line.startswith("  ") else f"error: {line}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)

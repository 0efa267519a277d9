"""The runner's private ComfyUI server: started with the pack linked in from outside, always stopped.

A fake ComfyUI folder whose ``main.py`` runs tests/fixtures/fake_comfyui.py stands in for ComfyUI, so the life
cycle (free port, temp folders, custom_nodes link, start failure, start timeout, Ctrl-C) is tested in seconds.
Guards: "it never leaves a server running" and "exit 4 when ComfyUI fails to start".
"""
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from leandiffusion.runner.client import ComfyClient
from leandiffusion.runner.errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_UNREACHABLE, ServerUnreachable
from leandiffusion.runner.local import PACK_ROOT, LocalComfyUI, comfyui_python
from leandiffusion.tests.kit.runner_process import runner_process

FIXTURES = Path(__file__).parent / "fixtures"
FAKE = FIXTURES / "fake_comfyui.py"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _server_pid(folder: Path) -> int:
    return int((folder.parent / "server.pid").read_text())


def test_start_links_the_pack_and_stop_leaves_nothing(fake_comfyui_dir, tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    server = LocalComfyUI(fake_comfyui_dir, python=sys.executable, cpu=True, models_dir=models)
    with server:
        assert ComfyClient(server.url).ping()["system"]["comfyui_version"] == "fake"
        pid, tmp = _server_pid(fake_comfyui_dir), server.tmp
        link = tmp / "custom_nodes" / "leandiffusion"
        assert link.is_symlink() and link.resolve() == PACK_ROOT
    log = server.log_text()
    assert f"custom_nodes: {tmp / 'custom_nodes'}" in log and f"base_path: {models.resolve()}" in log
    for flag in ("--cpu", "--listen 127.0.0.1", "--database-url sqlite:///:memory:", "--disable-auto-launch"):
        assert flag in log
    assert not _alive(pid) and not tmp.exists()


def test_pack_already_in_custom_nodes_is_not_linked_twice(fake_comfyui_dir):
    (fake_comfyui_dir / "custom_nodes").mkdir()
    (fake_comfyui_dir / "custom_nodes" / "any-name").symlink_to(PACK_ROOT)
    with LocalComfyUI(fake_comfyui_dir, python=sys.executable) as server:
        assert not (server.tmp / "custom_nodes" / "leandiffusion").exists()
    assert "custom_nodes:" not in server.log_text()


def test_crash_at_start_is_exit_4_with_log_tail(fake_comfyui_dir, monkeypatch):
    monkeypatch.setenv("FAKE_COMFYUI_MODE", "crash")
    server = LocalComfyUI(fake_comfyui_dir, python=sys.executable)
    with pytest.raises(ServerUnreachable) as info:
        server.start()
    assert info.value.exit_code == EXIT_UNREACHABLE
    assert "exited with code 3 while starting" in info.value.lines[0]
    assert any("fake start-up failure" in line for line in info.value.lines[1:])
    assert server.proc is None and server.tmp is None


def test_start_timeout_kills_the_server(fake_comfyui_dir, monkeypatch):
    monkeypatch.setenv("FAKE_COMFYUI_MODE", "silent")
    server = LocalComfyUI(fake_comfyui_dir, python=sys.executable, start_timeout=1.0)
    with pytest.raises(ServerUnreachable, match="did not answer within 1 s"):
        server.start()
    assert not _alive(_server_pid(fake_comfyui_dir))


def test_folder_without_main_py_is_refused(tmp_path):
    with pytest.raises(ServerUnreachable, match="main.py is missing"):
        LocalComfyUI(tmp_path)


def test_python_choice_order(tmp_path, monkeypatch):
    monkeypatch.delenv("COMFYUI_PYTHON", raising=False)
    assert comfyui_python(tmp_path) == sys.executable
    venv_python = tmp_path / ".venv" / "bin" / "python"
    venv_python.parent.mkdir(parents=True)
    venv_python.write_text("")
    assert comfyui_python(tmp_path) == str(venv_python)
    monkeypatch.setenv("COMFYUI_PYTHON", "/opt/py")
    assert comfyui_python(tmp_path) == "/opt/py"
    assert comfyui_python(tmp_path, "/explicit") == "/explicit"


# --------------------------------------------------------------------------------------------- the CLI process
def test_cli_starts_runs_and_stops_comfyui(fake_comfyui_dir, tmp_path):
    out = tmp_path / "out"
    with runner_process([str(FIXTURES / "core_image.api.json"), "--out", str(out), "-q"],
                        {"COMFYUI_PATH": str(fake_comfyui_dir), "COMFYUI_PYTHON": sys.executable}) as proc:
        stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_OK, stderr
    assert len(list(out.glob("*.png"))) == 2 and "saved 2 image(s)" in stdout
    assert not _alive(_server_pid(fake_comfyui_dir))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_cli_interrupted_mid_run_stops_comfyui(fake_comfyui_dir, tmp_path, sig):
    args = [str(FIXTURES / "core_image.api.json"), "--comfyui", str(fake_comfyui_dir), "--out", str(tmp_path / "out")]
    with runner_process(args, {"FAKE_COMFYUI_MODE": "hang", "COMFYUI_PYTHON": sys.executable}) as proc:
        pidfile = fake_comfyui_dir.parent / "server.pid"
        deadline = time.monotonic() + 120
        while not pidfile.exists() and time.monotonic() < deadline:  # the runner has started its server
            time.sleep(0.1)
        time.sleep(1.5)  # ... and submitted the prompt, which hangs
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_INTERRUPTED, stderr
    assert "interrupted" in stderr
    assert not _alive(_server_pid(fake_comfyui_dir))


# --------------------------------------------------------------------------------------------- failures of the server
def test_missing_interpreter_is_exit_4_naming_it(fake_comfyui_dir, tmp_path, capsys):
    # Bug: --python (or COMFYUI_PYTHON) naming a missing interpreter died with a FileNotFoundError traceback.
    from leandiffusion.runner.cli import main

    missing = tmp_path / "no-venv" / "bin" / "python"
    code = main([str(FIXTURES / "core_image.api.json"), "--comfyui", str(fake_comfyui_dir), "--python",
                 str(missing), "-q", "--out", str(tmp_path / "out")])
    assert code == EXIT_UNREACHABLE
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and str(missing) in lines[0]


@pytest.mark.parametrize("websocket", [True, False])
def test_server_dying_mid_run_names_its_exit_and_log(fake_comfyui_dir, tmp_path, capsys, websocket):
    # Bug: a started ComfyUI that died during the run (killed for memory, a crash in a kernel) gave only "lost the
    # websocket connection" / "not reachable", and its log -- the one place saying why -- was deleted with it.
    from leandiffusion.runner.cli import main

    (fake_comfyui_dir / "main.py").write_text(
        "import os, runpy, sys\n"
        f"ns = runpy.run_path({str(FAKE)!r})\n"
        "def crash(self, *a):\n"
        "    import time; time.sleep(0.5)\n"
        "    print('fake fatal: CUDA error: an illegal memory access', flush=True)\n"
        "    os._exit(9)\n"
        "ns['FakeComfyUI']._execute = crash\n"
        f"ns['FakeComfyUI'].drop_websocket = {not websocket}\n"
        "sys.argv = sys.argv\n"
        "ns['_serve_as_main']()\n")
    code = main([str(FIXTURES / "core_image.api.json"), "--comfyui", str(fake_comfyui_dir), "--python",
                 sys.executable, "-q", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == EXIT_UNREACHABLE, err
    assert "error: ComfyUI exited with code 9 during the run" in err
    assert "fake fatal: CUDA error" in err
    assert not _alive(_server_pid(fake_comfyui_dir))


def test_pack_that_failed_to_import_is_named_not_unknown_nodes(fake_comfyui_dir, tmp_path, capsys):
    # Bug: when the pack failed to import in the runner's own ComfyUI (a missing dependency in ComfyUI's
    # environment), the user read "unknown node type ... install the node pack that does" -- for the pack the
    # runner had just linked in -- and the log with the import error was deleted with the server.
    from leandiffusion.runner.cli import main

    (fake_comfyui_dir / "main.py").write_text(
        "import runpy, sys\n"
        "args = sys.argv[1:]\n"
        "cfg = open(args[args.index('--extra-model-paths-config') + 1]).read()\n"
        "nodes = [l.split(':', 1)[1].strip() for l in cfg.splitlines() if 'custom_nodes:' in l][0]\n"
        "print('Traceback (most recent call last):', flush=True)\n"
        "print(\"ModuleNotFoundError: No module named 'diffusers'\", flush=True)\n"
        "print(f\"Cannot import {nodes}/leandiffusion module for custom nodes: No module named 'diffusers'\", "
        "flush=True)\n"
        f"runpy.run_path({str(FAKE)!r}, run_name='__main__')\n")
    workflow = PACK_ROOT / "workflows_api" / "quickstart.api.json"
    code = main([str(workflow), "--comfyui", str(fake_comfyui_dir), "--python", sys.executable, "-q",
                 "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2, err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert errors[0].startswith("error: the started ComfyUI could not import this pack") and "unknown node type" not in err
    assert "No module named 'diffusers'" in err


def test_a_refusal_unrelated_to_unknown_nodes_is_not_blamed_on_the_pack(fake_comfyui_dir, tmp_path, capsys):
    """The pack's import failure is reported instead of a refusal only when the refusal is about unknown node types:
    a workflow of core nodes with a bad --set keeps its own error even when the started ComfyUI could not import
    the pack."""
    from leandiffusion.runner.cli import main

    (fake_comfyui_dir / "main.py").write_text(
        "import runpy, sys\n"
        "args = sys.argv[1:]\n"
        "cfg = open(args[args.index('--extra-model-paths-config') + 1]).read()\n"
        "nodes = [l.split(':', 1)[1].strip() for l in cfg.splitlines() if 'custom_nodes:' in l][0]\n"
        "print(f\"Cannot import {nodes}/leandiffusion module for custom nodes: No module named 'diffusers'\", "
        "flush=True)\n"
        f"runpy.run_path({str(FAKE)!r}, run_name='__main__')\n")
    code = main([str(FIXTURES / "core_image.api.json"), "--comfyui", str(fake_comfyui_dir), "--python",
                 sys.executable, "-q", "--set", "9.width=1", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2, err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "no node with id '9'" in errors[0] and "could not import" not in err


def test_a_node_failing_on_the_started_comfyui_brings_its_log(fake_comfyui_dir, tmp_path, monkeypatch, capsys):
    """The started server's traceback is in its log, which goes away with the server: the error lines end with the
    log's tail."""
    from leandiffusion.runner.cli import main
    from leandiffusion.runner.errors import EXIT_EXECUTION

    monkeypatch.setenv("FAKE_COMFYUI_MODE", "fail:2")
    code = main([str(FIXTURES / "core_image.api.json"), "--comfyui", str(fake_comfyui_dir), "--python",
                 sys.executable, "--out", str(tmp_path / "out"), "-q"])
    err = capsys.readouterr().err.splitlines()
    assert code == EXIT_EXECUTION
    assert err[0].startswith("error: node 2 (ImageScale) failed: ")
    assert "  the end of ComfyUI's log:" in err
    assert any("!!! Exception during processing !!! (the fake fails node 2)" in line for line in err)
    assert not _alive(_server_pid(fake_comfyui_dir)) and not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------ options reaching ComfyUI's command line
def test_options_reach_the_command_line_and_the_model_paths_config(fake_comfyui_dir, tmp_path):
    """Every model sub-folder is mapped under ``models_dir``; ``input_dir`` and ``extra_args`` reach ComfyUI's
    command line (the fake prints its arguments and the config into the log)."""
    models, inputs = tmp_path / "models", tmp_path / "inputs"
    models.mkdir()
    inputs.mkdir()
    with LocalComfyUI(fake_comfyui_dir, python=sys.executable, models_dir=models, input_dir=inputs,
                      extra_args=["--preview-method", "none"]) as server:
        pass
    log = server.log_text()
    for folder in ("checkpoints", "diffusers", "loras", "upscale_models", "vae", "embeddings", "text_encoders"):
        assert f"  {folder}: {folder}\n" in log
    assert f"--input-directory {inputs.resolve()}" in log and log.rstrip().count("--preview-method none") == 1
    assert "--cpu" not in log


def test_a_missing_models_folder_is_refused_before_anything_starts(fake_comfyui_dir, tmp_path):
    with pytest.raises(ServerUnreachable, match="models folder .*no-models does not exist"):
        LocalComfyUI(fake_comfyui_dir, python=sys.executable, models_dir=tmp_path / "no-models")


def test_dot_venv_comes_before_venv(tmp_path, monkeypatch):
    monkeypatch.delenv("COMFYUI_PYTHON", raising=False)
    for venv in ("venv", ".venv"):
        (tmp_path / venv / "bin").mkdir(parents=True)
        (tmp_path / venv / "bin" / "python").write_text("")
    assert comfyui_python(tmp_path) == str(tmp_path / ".venv" / "bin" / "python")


def test_a_second_start_is_refused_and_leaves_the_first_server_running(fake_comfyui_dir):
    with LocalComfyUI(fake_comfyui_dir, python=sys.executable) as server:
        with pytest.raises(RuntimeError, match="already started"):
            server.start()
        assert ComfyClient(server.url).ping()["system"]["comfyui_version"] == "fake"


def test_an_error_inside_the_block_propagates_after_the_server_stopped(fake_comfyui_dir):
    with pytest.raises(KeyError, match="inside"):
        with LocalComfyUI(fake_comfyui_dir, python=sys.executable) as server:
            log = server._log
            raise KeyError("inside")
    assert server.proc is None and server.tmp is None and log.closed
    assert not _alive(_server_pid(fake_comfyui_dir))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to tell a zombie from a live process")
def test_stop_asks_politely_first_then_kills_what_ignores_it(fake_comfyui_dir, tmp_path):
    """SIGTERM first, so ComfyUI can shut down cleanly (its handler runs); then SIGKILL to the whole group, so a
    child that ignores SIGTERM (a worker spawned by a custom node) is gone too."""
    marker, child_pid = tmp_path / "clean-exit", tmp_path / "child.pid"
    child = ("import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
             f"open({str(child_pid)!r}, 'w').write(str(os.getpid())); time.sleep(600)")
    (fake_comfyui_dir / "main.py").write_text(
        "import os, runpy, signal, subprocess, sys\n"
        f"subprocess.Popen([sys.executable, '-c', {child!r}])\n"
        f"signal.signal(signal.SIGTERM, lambda *a: (open({str(marker)!r}, 'w').close(), os._exit(0)))\n"
        f"runpy.run_path({str(FAKE)!r}, run_name='__main__')\n")
    with LocalComfyUI(fake_comfyui_dir, python=sys.executable):
        deadline = time.monotonic() + 30
        while not (child_pid.exists() and child_pid.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        pid = int(child_pid.read_text())
        assert _alive(pid)
    assert marker.exists()

    def running(pid):  # a killed orphan waits for init to reap it: a zombie counts as gone
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 5
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(pid)


def test_exited_waits_for_the_servers_exit_code(fake_comfyui_dir):
    (fake_comfyui_dir / "main.py").write_text(
        "import os, runpy, threading, time\n"
        "threading.Thread(target=lambda: (time.sleep(2.0), os._exit(5)), daemon=True).start()\n"
        f"runpy.run_path({str(FAKE)!r}, run_name='__main__')\n")
    with LocalComfyUI(fake_comfyui_dir, python=sys.executable) as server:
        assert server.exited() is None
        assert server.exited(wait=20) == 5


def test_a_log_path_keeps_the_log_after_stop(fake_comfyui_dir, tmp_path):
    log_path = tmp_path / "logs" / "comfyui.log"
    with LocalComfyUI(fake_comfyui_dir, python=sys.executable, log_path=log_path) as server:
        assert server.log_file == log_path
    assert "fake ComfyUI args:" in log_path.read_text()


def test_log_tail_and_pack_import_error_cut_the_log_where_they_say(fake_comfyui_dir, tmp_path):
    server = LocalComfyUI(fake_comfyui_dir, python=sys.executable)
    server.log_file = tmp_path / "log"
    server.log_file.write_text("a\nb\nTraceback\nModuleNotFoundError: x\n"
                               f"Cannot import {PACK_ROOT} module for custom nodes: x\nlater\nlast\n")
    assert server.log_tail(2) == ["  later", "  last"]
    assert server.pack_import_error(context=2) == ["  ModuleNotFoundError: x",
                                                   f"  Cannot import {PACK_ROOT} module for custom nodes: x"]

"""The runner's failures, each carrying the process exit code the CLI returns for it.

Exit codes (an API: scripts and CI test them): 0 success, 2 invalid workflow or validation error, 3 execution
error (incl. a run that did not finish within ``--timeout``), 4 ComfyUI unreachable or failed to start,
130 interrupted by the user (Ctrl-C / SIGTERM).
"""
from __future__ import annotations

EXIT_OK = 0
EXIT_INVALID = 2
EXIT_EXECUTION = 3
EXIT_UNREACHABLE = 4
EXIT_INTERRUPTED = 130


class RunnerError(Exception):
    """A failure the CLI reports as plain lines (``lines``) and turns into ``exit_code``."""

    exit_code = 1

    def __init__(self, message: str, lines: list[str] | None = None):
        super().__init__(message)
        self.lines = list(lines) if lines else [message]


class WorkflowError(RunnerError):
    """The workflow file, its format, a ``--set`` override or its conversion is invalid."""

    exit_code = EXIT_INVALID


class ValidationFailed(RunnerError):
    """ComfyUI refused the prompt (``POST /prompt`` answered with errors); one line per problem."""

    exit_code = EXIT_INVALID


class ExecutionFailed(RunnerError):
    """A node raised while ComfyUI executed the prompt, or the run timed out / was interrupted on the server."""

    exit_code = EXIT_EXECUTION


class ServerUnreachable(RunnerError):
    """No ComfyUI answered at the URL, or the local ComfyUI did not start."""

    exit_code = EXIT_UNREACHABLE

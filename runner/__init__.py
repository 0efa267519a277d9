"""Headless workflow runner: ``python -m leandiffusion.run WORKFLOW.json`` (see ``cli.py`` and docs/runner.md).

Light by design: only the standard library, ``websocket-client`` and (optionally) ``tqdm``; it never imports torch
or the pack's nodes (the package ``__init__`` loads the node registry lazily), so ``python -m leandiffusion.run``
also runs from a machine that only talks to a remote ComfyUI (``--server``) and has no torch.
"""
from .errors import (EXIT_EXECUTION, EXIT_INTERRUPTED, EXIT_INVALID, EXIT_OK, EXIT_UNREACHABLE, ExecutionFailed,
                     RunnerError, ServerUnreachable, ValidationFailed, WorkflowError)

__all__ = ["EXIT_OK", "EXIT_INVALID", "EXIT_EXECUTION", "EXIT_UNREACHABLE", "EXIT_INTERRUPTED", "RunnerError",
           "WorkflowError", "ValidationFailed", "ExecutionFailed", "ServerUnreachable", "main"]


def main(argv=None) -> int:
    from .cli import main as _main

    return _main(argv)

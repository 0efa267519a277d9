"""Entry point: ``python -m leandiffusion.run WORKFLOW.json [--server URL | --comfyui PATH] [--out DIR] ...``.

The runner itself lives in ``runner/`` (stdlib + websocket-client + tqdm only). ``python -m`` imports the package
``leandiffusion`` first, whose ``__init__`` loads the node registry (and torch) only on first access, so the runner
starts without torch (``tests/test_packaging.py``).
"""
import sys

from .runner.cli import main

if __name__ == "__main__":
    sys.exit(main())

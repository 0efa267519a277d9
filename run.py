"""Entry point: ``python -m leandiffusion.run WORKFLOW.json [--server URL | --comfyui PATH] [--out DIR] ...``.

The runner itself lives in ``runner/`` (stdlib + websocket-client + tqdm only). Note that ``python -m`` imports the
package ``leandiffusion`` first (its node registry); the runner modules do not need it.
"""
import sys

from .runner.cli import main

if __name__ == "__main__":
    sys.exit(main())

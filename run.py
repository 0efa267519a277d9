"""Entry point: ``python -m leandiffusion.run WORKFLOW.json [--server URL | --comfyui PATH] [--out DIR] ...``, or,
without installing the pack, ``python PATH/TO/PACK/run.py ...`` (the same runner).

The runner itself lives in ``runner/`` (stdlib + websocket-client + tqdm only). ``python -m`` imports the package
``leandiffusion`` first, whose ``__init__`` loads the node registry (and torch) only on first access, so the runner
starts without torch (``tests/test_packaging.py``). Run as a script, this file has no package: it imports its own
folder as the package ``leandiffusion`` (whatever the folder is called, e.g. ``custom_nodes/ComfyUI-LeanDiffusion``)
and takes that folder off ``sys.path``, where it would shadow top-level modules with the pack's sub-packages.
"""
import sys

if __package__:
    from .runner.cli import main
else:  # python .../run.py
    import importlib.util
    import os

    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
    _spec = importlib.util.spec_from_file_location("leandiffusion", os.path.join(_here, "__init__.py"),
                                                   submodule_search_locations=[_here])
    _package = importlib.util.module_from_spec(_spec)
    sys.modules["leandiffusion"] = _package
    _spec.loader.exec_module(_package)
    from leandiffusion.runner.cli import main

if __name__ == "__main__":
    sys.exit(main())

"""Which suites a run holds, how they are dealt into parts, and how the time budget is shared among them.

A suite is a file ``bench/suite_<name>.py``; its module-level constants (``QUICK_BUDGET_S`` / ``FULL_BUDGET_S`` /
``SMOKE_BUDGET_S``: its weight in seconds, ``REQUIRES_COMFYUI``) are read from the source with ``ast``, so the CLI
never imports a suite, nor CUDA. Before each suite the time still left is shared among the suites not yet run in
proportion to their weights; the suite sees ``SOFT_FRACTION`` of its share as its own budget and is killed once it
has also used ``OVERRUN_FRACTION`` of what the later suites would get.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

PKG = __package__ or "leandiffusion.bench"
BENCH_DIR = Path(__file__).parent
DEFAULT_BUDGET_S = {"smoke": 100.0, "quick": 575.0, "full": 540.0}
DEFAULT_WEIGHT_S = {"smoke": 10.0, "quick": 60.0, "full": 240.0}
WEIGHT_CONST = {"smoke": "SMOKE_BUDGET_S", "quick": "QUICK_BUDGET_S", "full": "FULL_BUDGET_S"}
SOFT_FRACTION = 0.85  # the suite's own budget (ctx.time_budget_s), as a fraction of its share
OVERRUN_FRACTION = 0.5  # a suite is killed once it has also used this fraction of the time left to the others
# below this (or half its weight) a suite is skipped. Smoke: 1 s, since the smoke weights together exceed twice the
# smoke budget, so half its weight was more than every suite of weight <= 10 got from the start (device, loader,
# finite were skipped without running); the tiny models need seconds, and a suite past its share is still killed
MIN_SHARE_S = {"smoke": 1.0, "quick": 20.0, "full": 20.0}


@dataclass(frozen=True)
class SuiteInfo:
    name: str
    path: Path
    module: Optional[str]  # dotted module name for suites inside the package, None for --suite-dir files
    constants: dict

    def weight(self, mode: str) -> float:
        value = self.constants.get(WEIGHT_CONST[mode], DEFAULT_WEIGHT_S[mode])
        return float(value) if isinstance(value, (int, float)) and value > 0 else DEFAULT_WEIGHT_S[mode]

    @property
    def requires_comfyui(self) -> bool:
        return bool(self.constants.get("REQUIRES_COMFYUI", False))


def read_constants(path: Path) -> dict:
    """Module-level ``NAME = <literal>`` assignments of a suite file, read without importing it."""
    out = {}
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except SyntaxError:  # the worker will report the real error when it imports the suite
        return out
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    return out


def discover(suite_dir: Optional[Path] = None) -> dict[str, SuiteInfo]:
    """``{name: SuiteInfo}`` for every ``suite_<name>.py`` in the package (or in ``suite_dir``), sorted by name."""
    folder = BENCH_DIR if suite_dir is None else Path(suite_dir)
    found = {}
    for path in sorted(folder.glob("suite_*.py")):
        name = path.stem[len("suite_"):]
        module = f"{PKG}.{path.stem}" if suite_dir is None else None
        found[name] = SuiteInfo(name, path, module, read_constants(path))
    return found


def parse_part(text: Optional[str]) -> Optional[tuple[int, int]]:
    if text is None:
        return None
    pieces = text.split("/")
    if len(pieces) != 2 or not all(p.strip().isdigit() for p in pieces):
        raise ValueError(f"--part={text!r}: expected K/N such as 1/4")
    k, n = (int(p) for p in pieces)
    if not (1 <= k <= n):
        raise ValueError(f"--part={text!r}: K must be between 1 and N")
    return k, n


def split_parts(suites: list[SuiteInfo], n: int, mode: str) -> list[list[SuiteInfo]]:
    """Deal suites into ``n`` parts balancing the weights (longest first, ties by name); each part sorted by name."""
    parts: list[list[SuiteInfo]] = [[] for _ in range(n)]
    loads = [0.0] * n
    for s in sorted(suites, key=lambda s: (-s.weight(mode), s.name)):
        i = min(range(n), key=lambda j: (loads[j], j))
        parts[i].append(s)
        loads[i] += s.weight(mode)
    return [sorted(p, key=lambda s: s.name) for p in parts]


def share_s(remaining_s: float, weights: list[float]) -> float:
    """The share of ``remaining_s`` of the first suite in ``weights`` (the suites still to run)."""
    total = sum(weights)
    return remaining_s * weights[0] / total if total > 0 else 0.0


def kill_after_s(remaining_s: float, share: float) -> float:
    """When a suite's process is killed: its share plus ``OVERRUN_FRACTION`` of what the later suites would get
    (so a slow suite eats into the others' time, but never all of it; the last suite may use all that is left)."""
    return share + OVERRUN_FRACTION * max(remaining_s - share, 0.0)

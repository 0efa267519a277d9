"""The pack's architecture, checked from its source: one-way layers, no import cycles, small modules and functions.

Layers (GUIDE section 2): ``nodes`` -> ``sampling`` -> (``lora``, ``vae``, ``upscale``) -> ``memory`` -> ``kernels``,
with ``bridge``, ``torchfile``, ``batch`` and ``keyrules`` at the bottom; ``bench`` may import the package but never
``tests``; nothing below imports ``bench``, ``tests``, ``nodes`` or ``runner``. Inside the pack imports are relative
(the folder is imported under any name by ComfyUI), and no module imports ComfyUI's own modules at import time
(only ``bridge`` does, lazily, inside functions).

Why a test: a layer that leaks upward (memory importing vae, lora reaching into memory's internals, bench importing
tests) is invisible in review of one file; parsing every import makes the rule hold on every commit.
"""
from __future__ import annotations

import ast
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# What each top-level unit of the pack may import from the pack (besides itself).
BOTTOM = {"bridge", "torchfile", "batch", "keyrules"}
ALLOWED: dict[str, set[str]] = {
    "__init__": {"nodes"},
    "nodes": {"sampling", "lora", "vae", "upscale", "memory", "kernels"} | BOTTOM,
    "sampling": {"lora", "vae", "memory", "kernels"} | BOTTOM,
    "lora": {"memory", "kernels"} | BOTTOM,
    "vae": {"memory", "kernels"} | BOTTOM,
    "upscale": {"memory", "kernels"} | BOTTOM,
    "memory": {"kernels"} | BOTTOM,
    "kernels": set(),
    "bridge": set(),
    "torchfile": set(),
    "keyrules": set(),
    "batch": {"bridge"},
    "runner": set(),
    "run": {"runner"},
    "bench": {"nodes", "sampling", "lora", "vae", "upscale", "memory", "kernels", "runner"} | BOTTOM,
}
NOT_PACKAGE = {"tests", "scripts", "docs", "workflows", "build", "dist"}
COMFYUI_MODULES = {"comfy", "comfy_extras", "folder_paths", "server", "nodes", "execution", "comfy_execution"}
# ``run.py`` run as a script has no package: it binds its own folder as ``leandiffusion`` and imports the runner from it.
ABSOLUTE_ALLOWED = {("run", "leandiffusion.runner.cli")}
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
MAX_BENCH_FUNCTION_LINES = 100


@dataclass(frozen=True)
class Module:
    name: str  # dotted, relative to the pack root ("memory.engine"; the root's own __init__ is "__init__")
    path: Path
    is_package: bool


def package_modules(root: Path) -> dict[str, Module]:
    """Every Python module of the pack under ``root`` (tests, scripts, docs and hidden folders excluded)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        top = rel.parts[0]
        if len(rel.parts) > 1 and (top in NOT_PACKAGE or top.startswith(".")):
            continue
        if any(part.startswith(".") or part == "__pycache__" for part in rel.parts):
            continue
        parts = list(rel.with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package and len(parts) > 1:
            parts = parts[:-1]
        found[".".join(parts)] = Module(".".join(parts), path, is_package)
    return found


def _resolve(name: str, modules: dict[str, Module]) -> str | None:
    """The longest known module that ``name`` (a dotted path, maybe ending in an attribute) lies in."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: Module, modules: dict[str, Module]) -> list[tuple[int, str, bool]]:
    """``(line, imported pack module or raw absolute name, at module level)`` for every import in ``module``."""
    tree = ast.parse(module.path.read_text(), filename=str(module.path))
    here = [] if module.name == "__init__" else module.name.split(".")
    base_of_dot = here if module.is_package else here[:-1]
    top_level = {id(node) for node in tree.body}
    top_level |= {id(n) for node in tree.body if isinstance(node, (ast.If, ast.Try)) for n in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        at_top = id(node) in top_level
        if isinstance(node, ast.ImportFrom) and node.level:
            base = base_of_dot[:len(base_of_dot) - (node.level - 1)] if node.level > 1 else base_of_dot
            prefix = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                target = _resolve(f"{prefix}.{alias.name}".strip("."), modules) or _resolve(prefix, modules)
                if target is None and not prefix:
                    target = "__init__"
                if target and target != module.name:
                    found.append((node.lineno, target, at_top))
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.lineno, "absolute:" + node.module, at_top))
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, "absolute:" + alias.name, at_top) for alias in node.names)
    return found


def _unit(name: str) -> str:
    return name.split(".")[0]


def layer_violations(root: Path) -> list[str]:
    """Imports that break the layering, import the pack absolutely, import tests, or import ComfyUI at import time."""
    modules = package_modules(root)
    problems = []
    for module in modules.values():
        unit = _unit(module.name)
        for line, target, at_top in imports_of(module, modules):
            where = f"{module.path.relative_to(root)}:{line}"
            if target.startswith("absolute:"):
                first = target[len("absolute:"):].split(".")[0]
                if (module.name, target[len("absolute:"):]) in ABSOLUTE_ALLOWED:
                    continue
                if first in ("leandiffusion", "tests"):
                    problems.append(f"{where} imports {target[9:]} (inside the pack: relative imports, never tests)")
                elif first in COMFYUI_MODULES and at_top and unit != "runner":
                    problems.append(f"{where} imports ComfyUI's {first} at import time (only bridge, lazily)")
                continue
            other = _unit(target)
            if other != unit and other not in ALLOWED.get(unit, set()):
                problems.append(f"{where}: {unit} must not import {other} ({target})")
    return problems


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan, iterative)."""
    index, low, on_stack, stack, result, counter = {}, {}, set(), [], [], [0]
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    result.append(sorted(component))
    return result


def import_cycles(root: Path) -> list[str]:
    """Cycles between files and between top-level units (lazy imports inside functions count too)."""
    modules = package_modules(root)
    files: dict[str, set[str]] = {name: set() for name in modules}
    units: dict[str, set[str]] = {}
    for module in modules.values():
        for _, target, _ in imports_of(module, modules):
            if target.startswith("absolute:"):
                continue
            files[module.name].add(target)
            a, b = _unit(module.name), _unit(target)
            units.setdefault(a, set())
            units.setdefault(b, set())
            if a != b:
                units[a].add(b)
    # A package's __init__ and its submodules import each other by design (re-exports); not a cycle.
    for name, targets in files.items():
        if modules[name].is_package:
            targets -= {t for t in targets if t.startswith(name + ".")}
    return [f"files: {' <-> '.join(c)}" for c in _cycles(files)] + \
        [f"units: {' <-> '.join(c)}" for c in _cycles(units)]


def size_violations(root: Path) -> list[str]:
    """Modules over ``MAX_MODULE_LINES`` lines and functions over their limit (bench's is larger)."""
    problems = []
    for module in package_modules(root).values():
        rel = module.path.relative_to(root)
        text = module.path.read_text()
        lines = text.count("\n") + (0 if text.endswith("\n") or not text else 1)
        if lines > MAX_MODULE_LINES:
            problems.append(f"{rel}: {lines} lines (at most {MAX_MODULE_LINES})")
        limit = MAX_BENCH_FUNCTION_LINES if _unit(module.name) == "bench" else MAX_FUNCTION_LINES
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    problems.append(f"{rel}:{node.lineno} {node.name}: {length} lines (at most {limit})")
    return problems


# ------------------------------------------------------------------------------------------------ the pack itself
def test_layers_are_one_way():
    assert layer_violations(ROOT) == []


def test_no_import_cycles_between_files_or_units():
    assert import_cycles(ROOT) == []


def test_modules_and_functions_stay_small():
    assert size_violations(ROOT) == []


def test_every_pack_unit_has_a_layer_rule():
    units = {_unit(name) for name in package_modules(ROOT)}
    assert units - set(ALLOWED) == set()


# ------------------------------------------------------------------------------ the checker catches what it should
def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, source in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    return root


CLEAN_PACK = {
    "__init__.py": "from .nodes import loader\n",
    "nodes/__init__.py": "",
    "nodes/loader.py": "from ..memory import engine\nfrom .. import bridge\n",
    "memory/__init__.py": "",
    "memory/engine.py": "from ..kernels import geglu\n",
    "kernels/__init__.py": "",
    "kernels/geglu.py": "import torch\n",
    "vae/__init__.py": "",
    "vae/tiled.py": "from ..memory.engine import x\n",
    "bridge.py": "def f():\n    import comfy.utils\n",
    "tests/test_x.py": "from leandiffusion.memory import engine\nimport bench\n",
}


def test_checker_passes_a_clean_pack(tmp_path):
    root = _write(tmp_path, CLEAN_PACK)
    assert layer_violations(root) == [] and import_cycles(root) == [] and size_violations(root) == []


@pytest.mark.parametrize("rel, source, expected", [
    ("memory/engine.py", "from ..vae import tiled\n", "memory must not import vae"),
    ("kernels/geglu.py", "from ..memory import engine\n", "kernels must not import memory"),
    ("vae/tiled.py", "def f():\n    from ..nodes import loader\n", "vae must not import nodes"),
    ("memory/engine.py", "from tests.kit import tiny\n", "imports tests.kit"),
    ("memory/engine.py", "from leandiffusion.kernels import geglu\n", "relative imports"),
    ("vae/tiled.py", "import folder_paths\n", "ComfyUI's folder_paths at import time"),
])
def test_checker_reports_a_planted_layer_violation(tmp_path, rel, source, expected):
    root = _write(tmp_path, {**CLEAN_PACK, rel: source})
    problems = layer_violations(root)
    assert any(expected in p for p in problems), problems


def test_checker_reports_a_planted_cycle_between_files(tmp_path):
    root = _write(tmp_path, {**CLEAN_PACK, "memory/plan.py": "from .engine import x\n",
                             "memory/engine.py": "def f():\n    from .plan import y\n"})
    assert import_cycles(root) == ["files: memory.engine <-> memory.plan"]


def test_checker_reports_a_planted_cycle_between_units(tmp_path):
    root = _write(tmp_path, {**CLEAN_PACK, "kernels/geglu.py": "from ..vae import tiled\n"})
    assert "units: kernels <-> memory <-> vae" in import_cycles(root)


def test_checker_reports_oversized_modules_and_functions(tmp_path):
    long_function = "def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES
    bench_function = "def g():\n" + "    x = 1\n" * MAX_FUNCTION_LINES  # within bench's larger limit
    root = _write(tmp_path, {**CLEAN_PACK, "memory/engine.py": long_function,
                             "vae/tiled.py": "x = 1\n" * (MAX_MODULE_LINES + 1),
                             "bench/__init__.py": "", "bench/suite.py": bench_function})
    problems = size_violations(root)
    assert problems == [f"memory/engine.py:1 f: {MAX_FUNCTION_LINES + 1} lines (at most {MAX_FUNCTION_LINES})",
                        f"vae/tiled.py: {MAX_MODULE_LINES + 1} lines (at most {MAX_MODULE_LINES})"], problems

"""docs/reliability.md: every node and the runner list at least 8 bad inputs, and every row cites tests that exist.

Why: the page promises each listed case is tested; a renamed or removed test would otherwise leave a row citing
nothing.
"""
import ast
import re
from pathlib import Path

PACK = Path(__file__).resolve().parents[1]
DOC = PACK / "docs" / "reliability.md"
SECTIONS = ["LeanModelLoader", "LeanSplitModelLoader", "LeanFusedDDIMSampler", "LeanKSampler", "LeanEditSampler", "LeanEditStreamSampler", "LeanStreamSampler", "LeanLoraInjector",
            "LeanTiledVAEDecode", "LeanESRGANUpscale", "run.py"]
TEST_ID = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")


def _rows_by_section() -> dict[str, list[str]]:
    rows: dict[str, list[str]] = {}
    current = None
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            current = line
            rows[current] = []
        elif current and line.startswith("| ") and not line.startswith("| bad input"):
            rows[current].append(line)
    return rows


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


def test_every_node_lists_at_least_eight_bad_inputs():
    rows = _rows_by_section()
    for key in SECTIONS:
        heading = [h for h in rows if key in h]
        assert len(heading) == 1, f"no single section for {key} in {DOC.name}: {list(rows)}"
        assert len(rows[heading[0]]) >= 8, f"{heading[0]}: {len(rows[heading[0]])} rows, expected at least 8"


def test_every_row_cites_tests_that_exist():
    names: dict[str, set[str]] = {}
    for heading, lines in _rows_by_section().items():
        for line in lines:
            cited = TEST_ID.findall(line)
            assert cited, f"{heading}: a row cites no test: {line}"
            for rel, name in cited:
                path = PACK / rel
                assert path.is_file(), f"{heading}: {rel} does not exist"
                if rel not in names:
                    names[rel] = _test_names(path)
                assert name in names[rel], f"{heading}: {rel}::{name} does not exist"

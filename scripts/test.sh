#!/usr/bin/env bash
# Installs what the tests need into ./.venv (CPU torch pinned) and runs the whole suite.
# Triton kernels run through the interpreter (TRITON_INTERPRET=1). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${LEANDIFFUSION_VENV:-.venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -c scripts/constraints-cpu.txt "torch==2.13.0"
"$VENV/bin/python" -m pip install -q -c scripts/constraints-cpu.txt -e ".[test]"
export TRITON_INTERPRET=1
exec "$VENV/bin/python" -m pytest -q -ra --timeout=900 tests "$@"

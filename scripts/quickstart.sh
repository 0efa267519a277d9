#!/usr/bin/env bash
# The README's one quickstart command: sets up ComfyUI with this pack (scripts/setup_comfyui.sh: uses COMFYUI_PATH
# when set, else clones ComfyUI into ~/.cache/leandiffusion/ComfyUI), runs workflows_api/quickstart.api.json headless
# through the runner (a private ComfyUI on a free local port, stopped afterwards) and says where the images went.
#
#   OUT=DIR             where to save the images (default: ./out/quickstart in the pack folder)
#   COMFYUI_PATH, COMFYUI_SOURCE, COMFYUI_REF, COMFYUI_PYTHON: see scripts/setup_comfyui.sh
# Extra arguments go to the runner (e.g. --set 2.seed=7). Without a CUDA GPU, ComfyUI runs with --cpu and the
# sampler's acceleration is set to `none`.
set -euo pipefail
PACK="$(cd "$(dirname "$0")/.." && pwd)"
export COMFYUI_PATH="${COMFYUI_PATH:-${XDG_CACHE_HOME:-$HOME/.cache}/leandiffusion/ComfyUI}"
OUT="${OUT:-$PACK/out/quickstart}"

bash "$PACK/scripts/setup_comfyui.sh"
PY="${COMFYUI_PYTHON:-$COMFYUI_PATH/.venv/bin/python}"

# The runner is `python -m leandiffusion.run`: expose the pack folder under that name without installing it.
LINKS="$(mktemp -d)"
trap 'rm -rf "$LINKS"' EXIT
ln -s "$PACK" "$LINKS/leandiffusion"

EXTRA=()
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "[quickstart] no CUDA GPU: running ComfyUI on the CPU" >&2
  EXTRA+=(--cpu --set LeanFusedDDIMSampler.acceleration=none)
fi
set +e
PYTHONPATH="$LINKS${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m leandiffusion.run "$PACK/workflows_api/quickstart.api.json" \
  --comfyui "$COMFYUI_PATH" --out "$OUT" ${EXTRA[@]+"${EXTRA[@]}"} "$@"
code=$?
set -e
if [ "$code" -eq 0 ]; then
  echo "[quickstart] done: the images are in $OUT"
else
  echo "[quickstart] the run failed with exit code $code (2 invalid workflow, 3 execution error, 4 ComfyUI did not start)" >&2
fi
exit "$code"
